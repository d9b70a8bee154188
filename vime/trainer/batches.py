"""A data-parallel rank's share of a packed batch, cut into micro-batches of one size."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vime.rl.samples import PackedBatch


@dataclass
class MicroBatch:
    """One micro-batch of this DP rank's samples (rows past the real ones have mask 0)."""

    index: int
    input_ids: torch.Tensor  # [size, seq]
    mask: torch.Tensor  # [size, seq - 1], 1 on response tokens
    rollout_logprobs: torch.Tensor  # [size, seq - 1]
    advantages: torch.Tensor  # [size]
    versions: torch.Tensor | None  # [size, seq - 1] weight version of each token, -1 on padding
    routes: torch.Tensor | None = None  # [size, seq - 1, MoE layers, top-k] experts to replay


def split_micro_batches(
    batch: PackedBatch,
    advantages: torch.Tensor,
    mine: slice,
    micro_batch_size: int,
    least: int,
    device: torch.device,
) -> list[MicroBatch]:
    """The samples `mine` of `batch` in micro-batches of one size (pipeline stages exchange
    activations of a fixed shape): ceil(n / micro_batch_size) of them (at least `least`), as even
    as possible, the last padded with rows that carry no loss (mask 0)."""
    n = mine.stop - mine.start
    count = max(math.ceil(n / micro_batch_size), least)
    size = math.ceil(n / count)
    pad = count * size - n

    def rows(tensor: torch.Tensor, fill: float) -> torch.Tensor:
        tensor = tensor[mine]
        if pad:
            filler = torch.full((pad, *tensor.shape[1:]), fill, dtype=tensor.dtype)
            tensor = torch.cat([tensor, filler])
        return tensor.to(device)

    # The packed batch lives on the CPU; the model on its device (a GPU when there is one).
    input_ids = rows(batch.input_ids, 0)
    mask = rows(batch.loss_mask, 0)
    rollout = rows(batch.rollout_logprobs, 0)
    advantages = rows(advantages, 0)
    versions = None if batch.token_versions is None else rows(batch.token_versions, -1)
    routes = None if batch.routes is None else rows(batch.routes, 0)
    return [
        MicroBatch(
            index=i,
            input_ids=input_ids[i * size : (i + 1) * size],
            mask=mask[i * size : (i + 1) * size],
            rollout_logprobs=rollout[i * size : (i + 1) * size],
            advantages=advantages[i * size : (i + 1) * size],
            versions=None if versions is None else versions[i * size : (i + 1) * size],
            routes=None if routes is None else routes[i * size : (i + 1) * size],
        )
        for i in range(count)
    ]
