"""Wall-clock time per named phase, accumulated over many short intervals."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """`with timer.phase("pack"): ...` adds the block's wall time to `timer.seconds["pack"]`.

    Phases may nest; each block counts towards its own name only, so nested phases overlap.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began

    def reset(self) -> None:
        self.seconds = {}
