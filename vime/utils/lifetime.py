"""A trainer rank must not outlive its launcher: torchrun SIGKILLed leaves its ranks running on.

`watch_parent` polls the parent pid from a daemon thread; once the rank is re-parented (its
launcher died, however), `on_orphaned` runs. Polling, not PR_SET_PDEATHSIG: that signal is tied
to the parent *thread* that forked the rank, which need not live as long as the launcher.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


def watch_parent(on_orphaned: Callable[[str], None], interval_s: float = 0.5) -> threading.Thread:
    parent = os.getppid()

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(interval_s):
            if os.getppid() != parent:
                on_orphaned(f"launcher pid {parent} exited (this rank's parent is gone)")
                return

    thread = threading.Thread(target=watch, daemon=True, name="vime-parent-watch")
    thread.start()
    return thread
