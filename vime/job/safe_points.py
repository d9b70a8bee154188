"""The loop's two safe points, where the job may change under it.

- taking a batch: engines that failed while it was generated recover first (fault tolerance);
- syncing the weights: engines join or leave just before (the fleet), joiners serve just after,
  a sync that failed because an engine died is repeated once it is back.

Fault tolerance (`vime.job.faults`) and the fleet (`vime.fleet`) live behind these calls; with
neither in use they are a plain wait for the batch and a plain sync. Every rank calls them in the
same order (rank 0 decides and broadcasts inside).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING

from vime.job.faults import EngineRecovery, FaultTolerance

if TYPE_CHECKING:
    from vime.fleet.fleet import Fleet
    from vime.rl.samples import RolloutBatch
    from vime.weight_sync.session import SyncReport


class SafePoints:
    def __init__(
        self, faults: FaultTolerance, fleet: Fleet, rank: int, recovery: EngineRecovery | None
    ) -> None:
        self.faults = faults
        self.fleet = fleet
        self.rank = rank
        self.recovery = recovery  # rank 0 with fault tolerance
        self._batch_wait_s = 0.0

    def take_batch(self, pending: concurrent.futures.Future | None) -> RolloutBatch | None:
        """Rank 0: the batch once generated (None on other ranks)."""
        waited = time.monotonic()
        batch = self.faults.until_batch(pending)
        self._batch_wait_s = time.monotonic() - waited
        if self.rank == 0:
            self.fleet.note_batch_wait(self._batch_wait_s)
        return batch

    def after_train(self, step: int, due: bool) -> tuple[SyncReport | None, dict[str, float]]:
        """After step `step` trained: its sync if `due` (weight_sync.interval), with the fleet's
        changes around it; the report (None without a sync) and the metrics of the fleet and of
        the engines' recovery (rank 0)."""
        self.faults.weights_ahead = True  # the engines serve older weights than the trainer's
        report = None
        if due:
            self.fleet.before_sync(step)  # engines join or leave here, never during a sync
            report = self.faults.update_weights()
            self.fleet.after_sync(report)  # joiners hold this sync's weights: they serve now
        metrics = self.recovery.metrics() if self.recovery is not None else {}
        metrics["time/batch_wait_s"] = self._batch_wait_s  # the trainer waiting for its batch
        if self.rank == 0:
            metrics.update(self.fleet.metrics())
        return report, metrics

    @property
    def engines_hold_trainer_weights(self) -> bool:
        """Whether the engines' current version is the trainer's current weights (no step
        trained since the last sync)."""
        return not self.faults.weights_ahead

    def sync_after_warm_start(self) -> SyncReport:
        """The sync after supervised warm-up (no fleet change before it)."""
        report = self.faults.update_weights()
        if self.rank == 0:
            self.fleet.note_sync(report)
        return report
