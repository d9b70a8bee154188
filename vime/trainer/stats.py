"""A step's loss metrics over its micro-batches, summed over data-parallel ranks."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.trainer.batches import MicroBatch

# Histograms (importance weights): token counts in bins 0.05 wide in log w, centred on
# -4.0, -3.95, .., 0 (w = 1), .., 4.0 (w from 0.018 to 55, each bin ~5% wide), summed over
# micro-batches and data-parallel ranks, so a step's quantiles are those of all its tokens to a
# bin's width (beyond the range: the range's edge).
LOG_EDGES = torch.linspace(-4.025, 4.025, 162, dtype=torch.float64)
QUANTILES = {"p01": 0.01, "p10": 0.1, "p50": 0.5, "p90": 0.9, "p99": 0.99}


class StepStats:
    """The loss metrics of one step's micro-batches, on the last stage: `loss` and `num_tokens`
    summed, `*_max` maxed, the rest token-weighted means; histograms give `<name>_p50` etc."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self.num_tokens = 0.0
        self.same_version_diff = 0.0
        self.same_version_tokens = 0.0
        self.histograms: dict[str, torch.Tensor] = {}

    def add(self, metrics: dict[str, float], num_tokens: float) -> None:
        self.num_tokens += num_tokens
        for key, value in metrics.items():
            if key.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, -math.inf), value)
            else:
                weight = 1.0 if key in ("loss", "num_tokens") else num_tokens
                self.sums[key] = self.sums.get(key, 0.0) + weight * value

    def add_histogram(self, name: str, log_values: torch.Tensor, mask: torch.Tensor) -> None:
        """Count the tokens of `mask` by their log value (see LOG_EDGES); every data-parallel
        rank must add the same names (an empty mask adds nothing but the name)."""
        values = log_values.detach().to(torch.float64)[mask > 0].cpu()
        bins = torch.bucketize(values, LOG_EDGES)  # 0: below the first edge; len: above the last
        counts = torch.bincount(bins, minlength=len(LOG_EDGES) + 1).to(torch.float64)
        self.histograms[name] = self.histograms.get(name, torch.zeros_like(counts)) + counts

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
        histogram_keys = sorted(self.histograms)
        sums = torch.tensor(
            [self.sums[k] for k in sum_keys]
            + [self.num_tokens, self.same_version_diff, self.same_version_tokens],
            dtype=torch.float64,
        )
        sums = torch.cat([sums, *(self.histograms[k] for k in histogram_keys)]).to(device)
        dist.all_reduce(sums, group=group, async_op=True).wait(timeout)
        totals = sums.cpu()
        num_scalars = len(sum_keys) + 3
        *values, self.num_tokens, self.same_version_diff, self.same_version_tokens = totals[
            :num_scalars
        ].tolist()
        self.sums = dict(zip(sum_keys, values, strict=True))
        bins = len(LOG_EDGES) + 1
        for index, key in enumerate(histogram_keys):
            start = num_scalars + index * bins
            self.histograms[key] = totals[start : start + bins]
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
        for name, counts in self.histograms.items():
            metrics.update(histogram_quantiles(name, counts))
        return metrics


def histogram_quantiles(name: str, counts: torch.Tensor) -> dict[str, float]:
    """{name_p01: w, ...}: exp of the middle of the bin each quantile falls in (the range's edge
    for the outer bins); nothing when no token was counted."""
    total = float(counts.sum())
    if total == 0:
        return {}
    cumulative = torch.cumsum(counts, 0) / total
    middles = torch.cat([LOG_EDGES[:1], (LOG_EDGES[1:] + LOG_EDGES[:-1]) / 2, LOG_EDGES[-1:]])
    out = {}
    for suffix, q in QUANTILES.items():
        index = int(torch.searchsorted(cumulative, torch.tensor(q, dtype=torch.float64)))
        out[f"{name}_{suffix}"] = float(torch.exp(middles[min(index, len(middles) - 1)]))
    return out
