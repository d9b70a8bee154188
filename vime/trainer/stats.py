"""A step's loss metrics over its micro-batches, summed over data-parallel ranks."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.trainer.batches import MicroBatch


class StepStats:
    """The loss metrics of one step's micro-batches, on the last stage: `loss` and `num_tokens`
    summed, `*_max` maxed, the rest token-weighted means."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self.num_tokens = 0.0
        self.same_version_diff = 0.0
        self.same_version_tokens = 0.0

    def add(self, metrics: dict[str, float], num_tokens: float) -> None:
        self.num_tokens += num_tokens
        for key, value in metrics.items():
            if key.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, -math.inf), value)
            else:
                weight = 1.0 if key in ("loss", "num_tokens") else num_tokens
                self.sums[key] = self.sums.get(key, 0.0) + weight * value

    def add_same_version(
        self, train_logprobs: torch.Tensor, micro: MicroBatch, weight_version: int
    ) -> None:
        """|train - rollout| on samples generated entirely by `weight_version`. Whole samples
        only: one that straddled a sync (keep pause, clear_cache false) continues on KV computed
        by the old weights, so even its new-version tokens differ from a recompute."""
        assert micro.versions is not None
        on = micro.mask > 0
        whole = ((micro.versions == weight_version) | ~on).all(dim=1) & on.any(dim=1)
        same = whole[:, None] & on
        diff = (train_logprobs - micro.rollout_logprobs).abs()
        self.same_version_diff += float(diff[same].sum())
        self.same_version_tokens += float(same.sum())

    def all_reduce(self, group: Any, timeout: timedelta, device: torch.device) -> None:
        """Sum (max) over the data-parallel ranks, which hold the same keys."""
        sum_keys, max_keys = sorted(self.sums), sorted(self.maxes)
        sums = torch.tensor(
            [self.sums[k] for k in sum_keys]
            + [self.num_tokens, self.same_version_diff, self.same_version_tokens],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(sums, group=group, async_op=True).wait(timeout)
        *values, self.num_tokens, self.same_version_diff, self.same_version_tokens = sums.tolist()
        self.sums = dict(zip(sum_keys, values, strict=True))
        if max_keys:
            maxes = torch.tensor(
                [self.maxes[k] for k in max_keys], dtype=torch.float64, device=device
            )
            work = dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group, async_op=True)
            work.wait(timeout)
            self.maxes = dict(zip(max_keys, maxes.tolist(), strict=True))

    def metrics(self) -> dict[str, float]:
        tokens = max(self.num_tokens, 1.0)
        metrics = {
            key: value if key in ("loss", "num_tokens") else value / tokens
            for key, value in self.sums.items()
        }
        metrics.update(self.maxes)
        if self.same_version_tokens:
            metrics["logprob_diff_same_version"] = self.same_version_diff / self.same_version_tokens
        metrics["same_version_token_fraction"] = self.same_version_tokens / tokens
        return metrics
