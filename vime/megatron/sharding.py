"""How a full Megatron parameter is cut into tensor-parallel shards, and put back together.

Pure tensor functions, shared by checkpoint loading (full -> this rank's shard) and weight gathering
(all shards -> full), so the two cannot disagree.

The one non-obvious layout: a gated MLP's `linear_fc1` is [gate; up] *per shard*, so TP rank r holds
[gate_r; up_r], and the full tensor is [gate_0 .. gate_{n-1}; up_0 .. up_{n-1}], not a plain
concatenation of the shards.
"""

from __future__ import annotations

import torch


def shard(
    full: torch.Tensor, *, partition_dim: int, rank: int, num_shards: int, glu: bool
) -> torch.Tensor:
    """Shard `rank` of `num_shards` of a full parameter split along `partition_dim`."""
    if full.shape[partition_dim] % (2 * num_shards if glu else num_shards) != 0:
        raise ValueError(
            f"dim {partition_dim} of shape {tuple(full.shape)} does not split into "
            f"{num_shards} shards (glu={glu})"
        )
    if not glu:
        return torch.chunk(full, num_shards, dim=partition_dim)[rank]
    gate, up = torch.chunk(full, 2, dim=partition_dim)
    return torch.cat(
        [
            torch.chunk(gate, num_shards, dim=partition_dim)[rank],
            torch.chunk(up, num_shards, dim=partition_dim)[rank],
        ],
        dim=partition_dim,
    )


def unshard(shards: list[torch.Tensor], *, partition_dim: int, glu: bool) -> torch.Tensor:
    """The full parameter from all its shards in rank order; the inverse of `shard`."""
    if len(shards) == 1:
        return shards[0]
    if not glu:
        return torch.cat(shards, dim=partition_dim)
    halves = [torch.chunk(s, 2, dim=partition_dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=partition_dim)
