"""Ending a rank at once, from any thread: a dead or stalled engine, a dead launcher, a failure.

The main thread may be blocked in a call that never returns (a collective waiting for a dead
peer), so `abort` waits for nothing: it names why on stderr and in run_dir/failure.json, kills
the engine actors this rank owns (their keepers end the servers) and exits with
ABORT_EXIT_CODE; torchrun then ends the other ranks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ABORT_EXIT_CODE = 3


class Abort:
    """`abort(message)` ends this process; what to clean up is set once it exists."""

    def __init__(self) -> None:
        self.run_dir: Path | None = None
        self.engines: list[Any] = []
        self._once = threading.Lock()

    def __call__(self, message: str) -> None:
        if not self._once.acquire(blocking=False):
            return
        logger.error("aborting the job: %s", message)
        print(f"vime.train: {message}", file=sys.stderr, flush=True)
        if self.run_dir is not None:
            rank = int(os.environ.get("RANK", "0"))
            failure = {"error": message, "rank": rank, "time": time.time()}
            (self.run_dir / "failure.json").write_text(json.dumps(failure, indent=2))
        for engine in self.engines:
            kill = getattr(engine, "kill", None)  # Ray actors; external engines are left up
            if kill is None:
                continue
            try:
                kill()
            except Exception as exc:  # noqa: BLE001 (best effort: the keepers end them anyway)
                logger.warning("could not kill %s: %s", engine, exc)
        logging.shutdown()
        os._exit(ABORT_EXIT_CODE)


abort = Abort()
