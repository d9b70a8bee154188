"""Pure tensor layouts shared by the Megatron <-> HF converters.

Megatron fuses tensors that HF keeps apart:
- `linear_qkv` rows are grouped per query group: for each of the `num_query_groups` groups,
  the group's query heads, then its key head, then its value head ([q_g0, k_g0, v_g0, q_g1, ...]).
  HF keeps `q_proj` (heads in order), `k_proj` and `v_proj`. The same layout holds for the bias.
- `linear_fc1` of a gated MLP is [gate; up] along dim 0 (HF `gate_proj`, `up_proj`).

All functions only move data, so HF -> Megatron -> HF is bit-identical.
"""

from __future__ import annotations

import torch


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_query_groups: int
) -> torch.Tensor:
    """HF q/k/v (weights [rows, hidden] or biases [rows]) -> Megatron linear_qkv."""
    rest = q.shape[1:]
    q_groups = q.reshape(num_query_groups, -1, *rest)
    k_groups = k.reshape(num_query_groups, -1, *rest)
    v_groups = v.reshape(num_query_groups, -1, *rest)
    return torch.cat([q_groups, k_groups, v_groups], dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, *, num_attention_heads: int, num_query_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron linear_qkv -> HF (q, k, v); the inverse of `merge_qkv`."""
    heads_per_group = num_attention_heads // num_query_groups
    rows_per_group = qkv.shape[0] // num_query_groups
    head_dim = rows_per_group // (heads_per_group + 2)
    rest = qkv.shape[1:]
    groups = qkv.reshape(num_query_groups, rows_per_group, *rest)
    q, k, v = torch.split(groups, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


def merge_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate_proj, up_proj -> Megatron linear_fc1 ([gate; up])."""
    return torch.cat([gate, up], dim=0)


def split_glu(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron linear_fc1 -> HF (gate_proj, up_proj); the inverse of `merge_glu`."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()
