"""What the job reports: one metrics row and one log line per step, and the summary at the end.

The step line says where the run is (k/N), how long the step took and when the run should end:

    step 12/40: reward 0.812, logprob diff 0.0031, sync 0.12 s, version 13, step 1.4 s, ETA 39 s

A failed job's summary says so (`"failed": true` and the error), so nothing downstream takes a
half run for a whole one.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime.cluster.addresses import HOST_IP_ENV
from vime.rl.metrics import MetricsWriter, prefixed

if TYPE_CHECKING:
    from vime.weight_sync.session import SyncReport

logger = logging.getLogger(__name__)


class Reporter:
    """Rank 0's metrics rows and step lines (`writer` None on other ranks: nothing is written)."""

    def __init__(self, writer: MetricsWriter | None, *, num_steps: int, start_step: int) -> None:
        self.writer = writer
        self.num_steps = num_steps
        self.start_step = start_step
        self.job_start = time.time()
        self._step_start = time.time()
        self._step_seconds: list[float] = []

    def step(
        self,
        step: int,
        *,
        batch: Any,
        train: dict[str, float],
        trainer_version: int,
        sync: SyncReport | None,
        train_span: tuple[float, float],
        extra: dict[str, float] | None = None,
    ) -> None:
        """Log step `step`: trained on `batch` by a trainer whose weights the engines served as
        `trainer_version`, then synced by the report `sync` (None: no sync after this step)."""
        now = time.time()
        self._step_seconds.append(now - self._step_start)
        self._step_start = now
        if self.writer is None:
            return
        start = self.job_start
        metrics = {
            **batch.metrics(trainer_version=trainer_version),
            **prefixed(train, "train/"),
            "rollout/num_samples": len(batch.samples),
            "time/gen_start": batch.start_time - start,
            "time/gen_end": batch.end_time - start,
            "time/train_start": train_span[0] - start,
            "time/train_end": train_span[1] - start,
            "time/step_end": now - start,
            "time/step_s": self._step_seconds[-1],
            # The version the engines serve once this step is done.
            "sync/weight_version": sync.weight_version if sync is not None else trainer_version,
            **(_sync_metrics(sync) if sync is not None else {}),
            **(extra or {}),
        }
        self.writer.log(step, metrics)
        logger.info(
            "step %d/%d: reward %.3f, logprob diff %.4f, %s, step %.1f s, ETA %.0f s",
            step + 1,
            self.num_steps,
            metrics.get("rollout/reward_mean", float("nan")),
            train.get("logprob_diff", float("nan")),
            f"sync {sync.total_s:.2f} s to version {sync.weight_version}"
            if sync is not None
            else f"no sync (version {trainer_version})",
            self._step_seconds[-1],
            self.eta_s(step),
        )

    def eta_s(self, step: int) -> float:
        """Seconds until the last step ends, at the mean pace of the steps so far."""
        recent = self._step_seconds[-10:]
        return (self.num_steps - step - 1) * sum(recent) / max(len(recent), 1)


def _sync_metrics(sync: SyncReport) -> dict[str, float]:
    """A step's sync: its time, bytes, checksum verdict, cache flush, phases and delta."""
    return {
        "sync/time_s": sync.total_s,
        # How long the engines stood still for it (pause request to resume answered).
        "sync/paused_s": sync.paused_s,
        "sync/verified": float(sync.verified),
        "sync/bytes": sync.num_bytes,
        "sync/prefix_cache_flushed": float(bool(sync.prefix_cache_flushed)),
        **prefixed(sync.seconds, "sync/phase_"),
        **_delta_metrics(sync),
    }


def _delta_metrics(sync: Any) -> dict[str, float]:
    """weight_sync.transport.delta: whether the sync was a delta, whether it was a failed delta
    repaired in full before the engines resumed, what share of the elements changed, what a full
    sync would have sent (rank 0's stage)."""
    if getattr(sync, "delta", None) is None:
        return {}
    metrics = {
        "sync/delta": float(sync.delta == "delta"),
        "sync/delta_repaired": float(sync.repaired),
        "sync/full_bytes": float(sync.full_bytes),
    }
    if sync.changed_fraction is not None:
        metrics["sync/changed_fraction"] = sync.changed_fraction
    return metrics


def write_summary(run_dir: Path, summary: dict[str, Any], error: BaseException | None) -> None:
    """run_dir/summary.json: the run's figures, where rank 0 ran, and whether it failed."""
    summary = {
        **summary,
        "failed": error is not None,
        **({"error": f"{type(error).__name__}: {error}"} if error is not None else {}),
        "run_dir": str(run_dir),
        # Where rank 0 ran (engines.json says where each engine ran).
        "trainer_node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
        "trainer_address": os.environ.get(HOST_IP_ENV, ""),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
