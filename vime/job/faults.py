"""Engine fault tolerance (engine.fault_tolerance), both halves in one place.

A dead or stalled engine is restarted, synced to the trainer's current weights, and only then
serves again; its lost requests are resubmitted.

- `EngineRecovery` (rank 0): the watchdog (vime.engines.watchdog) reports a failure from its
  thread; the engine is marked down in the generation client (its requests in flight are
  cancelled and wait to be resubmitted) and its restart starts at once, in the background (the
  restart ends the old server, so a call stuck on a stalled engine fails now instead of at its
  timeout).
- `FaultTolerance` (every rank): the training loop's safe points. Waiting for a batch, or after a
  sync that failed, rank 0 says which engines are down and every rank then waits for their
  restarts, reconnects the weight sync and pushes the current weights (`resync`: no new version
  unless the trainer stepped since the last sync, weight_sync.interval > 1);
  then the engines are marked up and watched again. Without fault tolerance the safe points only
  wait for the batch and sync.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from vime.engines.generation import GenerationClient
from vime.engines.watchdog import EngineFailedError, EngineWatchdog
from vime.utils.collectives import broadcast_object
from vime.weight_sync.session import SyncReport, WeightSyncError

logger = logging.getLogger(__name__)


class EngineRecovery:
    """Rank 0: restarts failed engines and tracks them until they serve again."""

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
        # Engines may join later (vime.fleet.fleet): room for restarts of more than the first ones.
        workers = max(8, len(engines))
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="vime-restart")

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


class FaultTolerance:
    """The loop's safe points; every rank calls the same methods in the same order, rank 0
    decides and broadcasts. `sync` is a `vime.plugin.WeightSync`."""

    def __init__(
        self, sync: Any, recovery: EngineRecovery | None, group: Any, failure_wait_s: float
    ) -> None:
        self.sync = sync
        self.recovery = recovery  # rank 0 with fault tolerance, else None
        self.group = group
        self.failure_wait_s = failure_wait_s
        self.enabled = broadcast_object(recovery is not None, group)
        # Whether the trainer stepped since the last sync (set by the loop's safe points).
        self.weights_ahead = False

    def until_batch(self, pending: concurrent.futures.Future | None) -> Any:
        """Rank 0: the batch, once generated (None on other ranks); engines that fail meanwhile
        are recovered first, on every rank."""
        while True:
            down: list[int] = []
            batch = None
            if self.recovery is not None:
                while not (down := self.recovery.pending()):
                    try:
                        batch = pending.result(timeout=0.5) if pending is not None else None
                        break
                    except concurrent.futures.TimeoutError:
                        continue
            elif pending is not None:
                batch = pending.result()
            if self.enabled:
                down = broadcast_object(down, self.group)
            if not down:
                return batch
            self._recover(down, resync=True)

    def update_weights(self) -> SyncReport:
        """sync.update_weights(); with fault tolerance a sync that fails because an engine failed
        is retried once the engine is back (the failed version number is sent again)."""
        recovered: list[int] = []
        while True:
            try:
                report = self.sync.update_weights()
            except WeightSyncError:
                if not self.enabled:
                    raise
                down = self.recovery.wait_for_failure(self.failure_wait_s) if self.recovery else []
                down = broadcast_object(down, self.group)
                if not down:
                    raise
                recovered += self._recover(down, resync=False)
                continue
            if recovered and self.recovery is not None:
                self.recovery.restored(recovered)  # the retried sync reached them
            self.weights_ahead = False
            return report

    def _recover(self, down: list[int], *, resync: bool) -> list[int]:
        """Every rank: wait for the restarts (rank 0), reconnect the sync to every engine and,
        if `resync`, push the trainer's current weights into every engine (the same version;
        a new one if the trainer stepped since the last sync).
        Engines found down while waiting (several failing in one step) are waited for too:
        the reconnect needs every engine up. Returns the engines recovered."""
        logger.warning("recovering engines %s", down)
        if self.recovery is not None:
            while True:
                self.recovery.wait_restarted(down)
                more = sorted(set(self.recovery.pending()) - set(down))
                if not more:
                    break
                logger.warning("engines %s failed too; waiting for their restarts", more)
                down = sorted(set(down) | set(more))
        down = broadcast_object(down, self.group)
        dist.barrier(group=self.group)
        self.sync.reconnect()
        if resync:
            if self.weights_ahead:
                # The trainer stepped since the last sync (weight_sync.interval > 1): its
                # weights are not the engines' version, so every engine gets them as a new one.
                self.update_weights()
            else:
                self.sync.resync()
            if self.recovery is not None:
                self.recovery.restored(down)
        logger.warning("engines %s reconnected%s", down, " and synced" if resync else "")
        return down
