"""What one step's rollout is made of, and what the trainer receives.

`RolloutSample` (one response with its per-token log-probs and weight versions), `RolloutBatch`
(a step's samples in groups, with metrics and JSONL output) and `PackedBatch` (the tensors
`train_step` takes). No networking here: the trainer imports this, not the rollout manager.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# vLLM's weight-version label until the first labelled update.
INITIAL_WEIGHT_LABEL = "default"


def parse_weight_version(version: str | int | None, unlabelled_version: int = 0) -> int:
    """The integer weight version of an engine label: "7" -> 7; None, and vLLM's "default" (the
    weights loaded at start-up), -> unlabelled_version.

    A failed sync labels tokens "<version>-failed" (weights possibly half new): that parses to the
    version it was updating to; `RolloutSample.on_failed_sync` records that it happened.
    """
    if version is None or version == INITIAL_WEIGHT_LABEL:
        return unlabelled_version
    if isinstance(version, int):
        return version
    text = version.removesuffix("-failed")
    if not text.lstrip("-").isdigit():
        raise ValueError(
            f"weight version label {version!r} is not an integer (or '<int>-failed'); "
            "the trainer must label weight updates with integer versions"
        )
    return int(text)


@dataclass
class RolloutSample:
    """One completion of one prompt, with everything the loss and the staleness metrics need."""

    prompt_id: str
    group_index: int  # index of the prompt (group) in the batch
    sample_index: int  # index within the group
    prompt_text: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    rollout_logprobs: list[float]
    weight_versions: list[int]  # one per response token
    completion_text: str
    reward: float
    finish_reason: str | None
    start_time: float
    end_time: float
    engine_url: str
    metadata: dict[str, Any] = field(default_factory=dict)
    on_failed_sync: bool = False
    num_aborted_retries: int = 0
    # The version whose cache salt the request carried (None: unsalted), and how many prompt
    # tokens the engine took from its prefix cache (None: it did not say).
    salt_version: int | None = None
    num_cached_tokens: int | None = None
    # The experts each MoE layer routed each token to (engines that return them):
    # [prompt + response tokens - 1, MoE layers, top-k]; replayed by the trainer.
    routed_experts: np.ndarray | None = field(default=None, repr=False)

    @property
    def stale_prefix(self) -> bool:
        """Its prompt KV may be another version's than its first token: it was submitted before
        a sync (salted with the older version), first scheduled after it, and reused cached
        prefix blocks (which only requests of its own, older salt can have computed). Without
        the engine's cached-token count, every such request counts."""
        first = self.weight_versions[0] if self.weight_versions else None
        moved = self.salt_version is not None and first is not None and first != self.salt_version
        return moved and (self.num_cached_tokens is None or self.num_cached_tokens > 0)

    @property
    def oldest_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    @property
    def version_span(self) -> int:
        """Newest minus oldest weight version among the tokens (0: one policy made them all)."""
        if not self.weight_versions:
            return 0
        return max(self.weight_versions) - min(self.weight_versions)

    def lag(self, trainer_version: int) -> int:
        """How many versions the oldest token is behind the trainer's current version."""
        oldest = self.oldest_version
        return 0 if oldest is None else trainer_version - oldest


def staleness_metrics(samples: Sequence[RolloutSample], trainer_version: int) -> dict[str, float]:
    """Mean/max version span within samples, and their lag behind `trainer_version`."""
    spans = [sample.version_span for sample in samples]
    lags = [sample.lag(trainer_version) for sample in samples if sample.weight_versions]
    token_lags = [trainer_version - v for sample in samples for v in sample.weight_versions]
    return {
        "staleness/version_span_mean": statistics.fmean(spans) if spans else 0.0,
        "staleness/version_span_max": float(max(spans, default=0)),
        "staleness/mixed_version_fraction": (
            sum(span > 0 for span in spans) / len(spans) if spans else 0.0
        ),
        "staleness/lag_mean": statistics.fmean(lags) if lags else 0.0,
        "staleness/lag_max": float(max(lags, default=0)),
        "staleness/token_lag_mean": statistics.fmean(token_lags) if token_lags else 0.0,
        # The histogram: how many samples are k versions behind, for each k seen.
        **{f"staleness/samples_lag_{lag}": float(lags.count(lag)) for lag in sorted(set(lags))},
    }


@dataclass
class PackedBatch:
    """A batch as tensors aligned with `token_logprobs(model, input_ids)` ([batch, seq - 1]).

    Row i is prompt + response + padding; position t of the [batch, seq - 1] tensors scores
    input_ids[i, t + 1], so the mask is 1 exactly on response tokens.
    """

    input_ids: torch.Tensor  # [batch, seq] int64
    loss_mask: torch.Tensor  # [batch, seq - 1] float32
    rollout_logprobs: torch.Tensor  # [batch, seq - 1] float32, 0 where mask is 0
    rewards: torch.Tensor  # [batch] float32
    group_size: int
    token_versions: torch.Tensor | None = None  # [batch, seq - 1] int64, -1 where mask is 0
    # [batch, seq - 1, MoE layers, top-k] int64: the engines' experts per forward position
    # (every sample had them), for trainer.moe_routing_replay.
    routes: torch.Tensor | None = None


@dataclass
class RolloutBatch:
    """All samples of one step; group g is samples[g * group_size : (g + 1) * group_size]."""

    step: int
    samples: list[RolloutSample]
    group_size: int
    start_time: float
    end_time: float

    @property
    def rewards(self) -> list[float]:
        return [sample.reward for sample in self.samples]

    def write_jsonl(self, path: str | Path, trainer_version: int | None = None) -> None:
        """Append one line per sample (ids, log-probs, versions, reward, text) for inspection."""
        with Path(path).open("a") as out:
            for sample in self.samples:
                row = {"step": self.step, **asdict(sample)}
                row.pop("routed_experts")  # an array; kept out of the text file
                if trainer_version is not None:
                    row["lag"] = sample.lag(trainer_version)
                out.write(json.dumps(row) + "\n")

    def too_stale(self, trainer_version: int, max_lag: int) -> list[int]:
        """Indices of the samples whose oldest token is more than `max_lag` versions behind."""
        return [i for i, s in enumerate(self.samples) if s.lag(trainer_version) > max_lag]

    def pack(self, pad_token_id: int, leave_out: Sequence[int] = ()) -> PackedBatch:
        """The batch as tensors. The samples at `leave_out` (e.g. `too_stale`) keep their reward
        (their group's baseline) but no token of theirs is in the loss mask."""
        stale = set(leave_out)
        rows = [s.prompt_token_ids + s.response_token_ids for s in self.samples]
        seq_len = max(len(row) for row in rows)
        batch = len(rows)
        input_ids = torch.full((batch, seq_len), pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(batch, seq_len - 1)
        rollout_logprobs = torch.zeros(batch, seq_len - 1)
        token_versions = torch.full((batch, seq_len - 1), -1, dtype=torch.long)
        for i, (row, sample) in enumerate(zip(rows, self.samples, strict=True)):
            input_ids[i, : len(row)] = torch.tensor(row)
            start = len(sample.prompt_token_ids) - 1
            end = start + len(sample.response_token_ids)
            loss_mask[i, start:end] = 0.0 if i in stale else 1.0
            rollout_logprobs[i, start:end] = torch.tensor(sample.rollout_logprobs)
            versions = torch.tensor(sample.weight_versions, dtype=torch.long)
            # A sample whose prompt KV may be another version's is no one version's: -2 matches
            # no trainer version, so the same-version log-prob check leaves it out.
            token_versions[i, start:end] = -2 if sample.stale_prefix else versions
        routes = None
        if all(s.routed_experts is not None for s in self.samples):
            routes = pack_routes([s.routed_experts for s in self.samples], seq_len - 1)
        return PackedBatch(
            input_ids=input_ids,
            loss_mask=loss_mask,
            rollout_logprobs=rollout_logprobs,
            rewards=torch.tensor(self.rewards, dtype=torch.float32),
            group_size=self.group_size,
            token_versions=token_versions,
            routes=routes,
        )

    def metrics(self, trainer_version: int | None = None) -> dict[str, float]:
        """Reward, length, throughput and (given the trainer's version) staleness metrics."""
        rewards = self.rewards
        lengths = [len(s.response_token_ids) for s in self.samples]
        groups = [
            rewards[start : start + self.group_size]
            for start in range(0, len(rewards), self.group_size)
        ]
        duration = max(self.end_time - self.start_time, 1e-9)
        metrics = {
            "rollout/reward_mean": statistics.fmean(rewards),
            "rollout/reward_std": statistics.pstdev(rewards),
            "rollout/reward_max": max(rewards),
            "rollout/solved_fraction": sum(r >= 1.0 for r in rewards) / len(rewards),
            "rollout/zero_variance_groups": sum(max(g) == min(g) for g in groups) / len(groups),
            "rollout/response_len_mean": statistics.fmean(lengths),
            "rollout/truncated_fraction": (
                sum(s.finish_reason == "length" for s in self.samples) / len(self.samples)
            ),
            "rollout/aborted_retries": float(sum(s.num_aborted_retries for s in self.samples)),
            # Submitted before a sync, first scheduled after it (its salt was the old version's).
            "rollout/stale_prefix_fraction": (
                sum(s.stale_prefix for s in self.samples) / len(self.samples)
            ),
            "rollout/time_s": duration,
            "rollout/tokens_per_s": sum(lengths) / duration,
        }
        known = [s for s in self.samples if s.num_cached_tokens is not None]
        if known:
            # The engines' prefix-cache hits on the prompts (group routing keeps a group's prompt
            # on one engine: all but its first sample can hit).
            prompt_tokens = sum(len(s.prompt_token_ids) for s in known)
            metrics["rollout/prompt_cache_hit_rate"] = sum(
                s.num_cached_tokens or 0 for s in known
            ) / max(prompt_tokens, 1)
        if trainer_version is not None:
            metrics.update(staleness_metrics(self.samples, trainer_version))
        return metrics


def pack_routes(routes: Sequence[np.ndarray | None], seq_len: int) -> torch.Tensor:
    """The batch's routes as one [batch, seq_len, layers, top-k] int64 tensor aligned with the
    trainer's forward inputs (`input_ids[:, :-1]`, seq_len of them). Positions past a sample's
    own (padding) route to experts 0..k-1: the causal model's real tokens never see them."""
    first = next((r for r in routes if r is not None), None)
    if first is None:
        raise ValueError("no sample has routed experts")
    num_layers, topk = first.shape[1:]
    packed = torch.arange(topk, dtype=torch.long).expand(len(routes), seq_len, num_layers, topk)
    packed = packed.clone()
    for row, sample_routes in enumerate(routes):
        if sample_routes is None:
            raise ValueError(
                f"sample {row} has no routed experts: with trainer.moe_routing_replay every "
                "engine must return them (vLLM --enable-return-routed-experts)"
            )
        if sample_routes.shape[1:] != (num_layers, topk) or len(sample_routes) > seq_len:
            raise ValueError(
                f"sample {row}: routed experts of shape {tuple(sample_routes.shape)} do not fit "
                f"{seq_len} positions x {num_layers} MoE layers x top-{topk}"
            )
        packed[row, : len(sample_routes)] = torch.from_numpy(sample_routes.astype(np.int64))
    return packed
