"""The job's stages around RL: the supervised warm start, and held-out greedy evaluation."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from pathlib import Path
from typing import Any

from vime.config import TrainConfig
from vime.rl.data import load_demonstrations, load_prompts
from vime.rl.evaluate import eval_metrics
from vime.rl.metrics import MetricsWriter, prefixed
from vime.rl.sft import sft_batch

logger = logging.getLogger(__name__)


def supervised_stage(
    config: TrainConfig, trainer: Any, tokenizer: Any, run_dir: Path, rank: int
) -> dict[str, float]:
    """Every rank: `sft.num_steps` supervised steps (rank 0 writes run_dir/sft.jsonl), then
    the trainer starts RL from these weights. Returns the first and last steps' loss."""
    assert config.sft.data_path is not None
    records = load_demonstrations(config.sft.data_path)
    trainer.start_sft(config.sft.lr)
    started = time.time()
    rows = []
    for step in range(config.sft.num_steps):
        input_ids, loss_mask = sft_batch(records, step, config.sft, tokenizer)
        metrics = trainer.sft_step(input_ids, loss_mask)
        rows.append({"step": step, **prefixed(metrics, "sft/")})
        if step % 10 == 0 or step + 1 == config.sft.num_steps:
            logger.info(
                "sft step %d/%d: loss %.4f, confident %.3f",
                step + 1,
                config.sft.num_steps,
                metrics["loss"],
                metrics["confident_fraction"],
            )
    trainer.start_rl()
    if rank == 0:
        (run_dir / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "sft/num_steps": float(config.sft.num_steps),
        "sft/loss_first": rows[0]["sft/loss"],
        "sft/loss_last": rows[-1]["sft/loss"],
        "sft/wall_s": time.time() - started,
    }


class Evaluator:
    """Rank 0: greedy pass@1 on eval.prompts_path through the engines, as they serve now.

    `when`: before (the initial model), resumed (a resumed job's checkpoint), after_sft, after
    (RL). A no-op without eval.prompts_path or on other ranks (rollouts None)."""

    def __init__(self, config: TrainConfig, rollouts: Any, writer: MetricsWriter | None) -> None:
        self.config = config
        self.rollouts = rollouts
        self.writer = writer
        self.results: dict[str, Any] = {}  # when -> scores; "after_error": why not
        self._rollout = None
        if rollouts is not None and config.eval.prompts_path is not None:
            num_prompts = len(load_prompts(config.eval.prompts_path))
            self._rollout = config.eval.rollout_config(config.rollout, num_prompts)

    def __call__(self, when: str, step: int, weight_version: int) -> None:
        if self._rollout is None or self.writer is None:
            return
        future = self.rollouts.evaluate(self._rollout, weight_version)
        timeout_s = self.config.eval.timeout_s
        try:
            scores = eval_metrics(future.result(timeout=timeout_s))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"held-out eval {when} step {step} took over eval.timeout_s={timeout_s:g} s "
                "(raise it, or use fewer eval prompts)"
            ) from None
        scores["eval/weight_version"] = float(weight_version)
        self.writer.log_eval(step, scores, stage=when)
        self.results[when] = scores
        logger.info("held-out eval %s step %d: pass@1 %.3f", when, step, scores["eval/pass_at_1"])
