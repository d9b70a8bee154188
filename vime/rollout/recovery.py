"""Engine fault tolerance (engine.fault_tolerance): a dead or stalled engine is restarted, synced
to the trainer's current weights, and only then serves again; its lost requests are resubmitted.

Rank 0 owns an EngineRecovery. The watchdog (vime.rollout.watchdog) reports a failure from its
thread: the engine is marked down in the generation client (its requests in flight are cancelled
and wait to be resubmitted) and its restart starts at once, in the background (the restart ends
the old server, so a call stuck on a stalled engine fails now instead of at its timeout). The
training loop, at its next safe point (waiting for a batch, or after a sync that failed), asks
`pending()`, has every rank reconnect the weight updater and sync, then calls `restored()`: the
engine is marked up and watched again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from vime.rollout.generation import GenerationClient
from vime.rollout.watchdog import EngineFailedError, EngineWatchdog

logger = logging.getLogger(__name__)


class EngineRecovery:
    def __init__(self, engines: Sequence[Any], client: GenerationClient, restart_timeout_s: float):
        self.engines = engines
        self.client = client
        self.watchdog: EngineWatchdog | None = None
        self.restart_timeout_s = restart_timeout_s
        self.num_restarts = 0
        self.recovery_s: list[float] = []  # failure detected -> engine serves again, per restart
        self._lock = threading.Lock()
        self._restarts: dict[int, tuple[Future, float]] = {}  # index -> (restart, detected at)
        self._failed = threading.Event()
        self._executor = ThreadPoolExecutor(max(1, len(engines)), thread_name_prefix="vime-restart")

    def on_failure(self, failure: EngineFailedError) -> None:
        """From the watchdog's thread: mark the engine down and restart it."""
        index = failure.engine_index
        with self._lock:
            if index in self._restarts:
                return
            logger.warning("fault tolerance: restarting engine %d (%s)", index, failure)
            self.client.mark_down(index)
            restart = self._executor.submit(self.engines[index].restart)
            self._restarts[index] = (restart, time.monotonic())
        self._failed.set()

    def pending(self) -> list[int]:
        """Engines down or restarting, not yet synced."""
        with self._lock:
            return sorted(self._restarts)

    def wait_for_failure(self, timeout_s: float) -> list[int]:
        """After a failed sync: the engines found down within timeout_s (empty: none was)."""
        self._failed.wait(timeout_s)
        return self.pending()

    def wait_restarted(self, indices: Sequence[int]) -> None:
        for index in indices:
            restart, _ = self._restarts[index]
            restart.result(timeout=self.restart_timeout_s)  # a restart that fails ends the job

    def restored(self, indices: Sequence[int]) -> None:
        """The engines serve the trainer's weights again: route requests to them, watch them."""
        with self._lock:
            for index in indices:
                _, detected = self._restarts.pop(index)
                self.recovery_s.append(time.monotonic() - detected)
                self.num_restarts += 1
                self.client.mark_up(index)
                if self.watchdog is not None:
                    self.watchdog.watch(index)
                logger.warning(
                    "fault tolerance: engine %d serves again, %.1f s after its failure was "
                    "detected",
                    index,
                    self.recovery_s[-1],
                )
            if not self._restarts:
                self._failed.clear()

    def metrics(self) -> dict[str, float]:
        return {
            "fault/engine_restarts": float(self.num_restarts),
            "fault/resubmitted_requests": float(self.client.num_resubmitted),
        }

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
