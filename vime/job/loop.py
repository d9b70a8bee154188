"""The RL loop, as the algorithm reads.

Bounded staleness (`rollout.max_staleness: K`): once batch k is taken, batches k+1 .. k+K are
generating, so the engines generate while the trainer trains; each sync pauses them with `keep`,
and the requests in flight continue on the new weights (each token records the version that
produced it). A sample's oldest token is then at most K versions behind the trainer that trains
on it; one further behind adds nothing to the loss. K = 0 generates, trains and syncs in turn.
With `weight_sync.interval: N` the sync comes after every N-th step only: a version counts syncs.
Every rank runs these lines; only rank 0 has rollouts (the others get each batch by broadcast).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime.config import TrainConfig
from vime.job.report import Reporter
from vime.job.safe_points import SafePoints
from vime.job.stages import Evaluator, supervised_stage
from vime.megatron.checkpoint import TrainingState, save_checkpoint
from vime.utils.collectives import broadcast_object

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vime.plugin import WeightSync
    from vime.rl.rollout import RolloutThread
    from vime.trainer.trainer import MegatronTrainer

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """What the loop works with, built by `vime.job.run`; rank-0-only parts are None elsewhere."""

    config: TrainConfig
    rank: int
    run_dir: Path
    trainer: MegatronTrainer
    sync: WeightSync
    safe_points: SafePoints
    tokenizer: PreTrainedTokenizerBase
    pad_id: int
    start_step: int
    resumed: bool
    rollouts: RolloutThread | None  # rank 0
    evaluate: Evaluator
    report: Reporter

    def submit(self, step: int) -> concurrent.futures.Future | None:
        """Rank 0: start generating step `step`'s batch (None elsewhere), its requests salted
        with the version the engines serve now."""
        if self.rollouts is None:
            return None
        return self.rollouts.submit(step, self.sync.weight_version)


def run_loop(job: Job) -> dict[str, Any]:
    """Evaluate, warm start (SFT), then generate -> train -> sync for every step; evaluate."""
    config, sync = job.config, job.sync
    summary: dict[str, Any] = {}
    job.evaluate("resumed" if job.resumed else "before", job.start_step, sync.weight_version)
    if config.sft.enabled and not job.resumed:
        summary["sft"] = supervised_stage(config, job.trainer, job.tokenizer, job.run_dir, job.rank)
        job.safe_points.sync_after_warm_start()
        job.evaluate("after_sft", job.start_step, sync.weight_version)
    max_staleness = config.rollout.max_staleness
    ahead: deque[concurrent.futures.Future | None] = deque()  # batches of steps not yet taken
    submitted = job.start_step  # the next step to submit

    def submit_until(last_step: int) -> None:
        nonlocal submitted
        while submitted <= min(last_step, config.num_steps - 1):
            ahead.append(job.submit(submitted))
            submitted += 1

    for step in range(job.start_step, config.num_steps):
        submit_until(step)
        batch = job.safe_points.take_batch(ahead.popleft())  # rank 0's; failed engines recover
        submit_until(step + max_staleness)  # these generate while this batch trains
        if batch is not None and config.save_rollouts:  # rank 0
            batch.write_jsonl(job.run_dir / "rollouts.jsonl", sync.weight_version)
        packed, stale = None, []
        if batch is not None:  # rank 0
            stale = batch.too_stale(sync.weight_version, max_staleness)
            packed = batch.pack(job.pad_id, leave_out=stale)
        packed = broadcast_object(packed, sync.group)
        trainer_version = sync.weight_version  # what the engines serve: the trainer's version
        # The same-version log-prob gap needs the trainer's weights to be that version's.
        same_weights = job.safe_points.engines_hold_trainer_weights
        train_start = time.time()
        train = job.trainer.train_step(
            packed, weight_version=trainer_version if same_weights else None
        )
        train_end = time.time()
        due = config.weight_sync.due(step, config.num_steps)
        report, extra = job.safe_points.after_train(step, due)
        extra["rollout/dropped_stale"] = float(len(stale))
        if job.rollouts is not None:
            extra.update(job.rollouts.occupancy())
        job.report.step(
            step,
            batch=batch,
            train=train,
            trainer_version=trainer_version,
            sync=report,
            train_span=(train_start, train_end),
            extra=extra,
        )
        if config.checkpoint.due(step + 1, config.num_steps):
            # Weights not synced yet are a version of their own: the resumed job's engines
            # get them as the next one.
            version = sync.weight_version + (0 if report is not None else 1)
            state = TrainingState(next_step=step + 1, weight_version=version)
            root = config.checkpoint.root(job.run_dir)
            save_checkpoint(job.trainer, root, state, keep=config.checkpoint.keep)
    try:
        job.evaluate("after", config.num_steps, sync.weight_version)
    except Exception as exc:  # noqa: BLE001 (training and its checkpoint are done: report it)
        logger.error("held-out eval after training failed: %s", exc)
        job.evaluate.results["after_error"] = str(exc)
    return summary
