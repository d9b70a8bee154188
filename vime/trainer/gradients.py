"""Gradients between backward and the optimizer step: sums over copies and replicas, clipping.

- A tied embedding lives twice at PP > 1 (the first stage's embedding, the last stage's output
  layer): its gradient is summed over the two copies (megatron's embedding group), so they stay
  equal.
- Data-parallel ranks sum their gradients (the loss already divides by the whole batch's token
  count): one all-reduce per bucket of flattened gradients, not one per parameter.
- Clipping uses the global norm over TP x PP (every element counted once) and gives every rank
  the same factor.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from vime.megatron.model import unwrap
from vime.megatron.topology import Topology

DP_BUCKET_BYTES = 64 * 1024**2  # gradients per data-parallel all-reduce


def reduce_gradients(
    chunks: Sequence[torch.nn.Module], topology: Topology, dp_group: Any, timeout: timedelta
) -> None:
    """Sum the tied embedding's gradient over its two copies, then every gradient over DP."""
    if topology.pp_size > 1:
        from megatron.core import parallel_state

        for chunk in map(unwrap, chunks):
            # The chunk that embeds (first rank, first chunk) and the one with the output layer
            # (last rank, last chunk) hold the two copies; middle chunks neither.
            if not chunk.share_embeddings_and_output_weights:
                continue
            if not (chunk.pre_process or chunk.post_process):
                continue
            weight = chunk.shared_embedding_or_output_weight()
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            group = parallel_state.get_embedding_group()
            dist.all_reduce(weight.grad, group=group, async_op=True).wait(timeout)
    if topology.dp_size == 1:
        return
    params = [p for chunk in chunks for p in chunk.parameters()]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    for bucket in _buckets([p.grad for p in params if p.grad is not None]):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=dp_group, async_op=True).wait(timeout)
        for grad, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(summed)


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype and device, each group cut at DP_BUCKET_BYTES (every rank cuts
    the same list the same way: the same collectives in the same order)."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for tensor in tensors:
        buckets = groups.setdefault((tensor.dtype, tensor.device), [[]])
        size = sum(t.numel() * t.element_size() for t in buckets[-1])
        if buckets[-1] and size + tensor.numel() * tensor.element_size() > DP_BUCKET_BYTES:
            buckets.append([])
        buckets[-1].append(tensor)
    return [bucket for buckets in groups.values() for bucket in buckets if bucket]


def clip_by_global_norm(
    params: Sequence[torch.nn.Parameter], topology: Topology, max_norm: float, timeout: timedelta
) -> float:
    """Clip by the global norm over the whole model; every rank gets the same factor.

    A TP-sharded parameter contributes its shard on every TP rank; a replicated one (norms,
    biases of row-parallel layers) only on TP rank 0; each pipeline stage its own layers, the
    last stage's copy of a tied embedding (`shared`) not at all. The sum over the model-parallel
    (TP x PP) group then counts every element once. Returns the norm before clipping.
    """
    device = params[0].device
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for param in params:
        if param.grad is None or getattr(param, "shared", False):
            continue
        if getattr(param, "tensor_model_parallel", False) or topology.tp_rank == 0:
            squares += torch.linalg.vector_norm(param.grad, dtype=torch.float64).square()
    if topology.tp_size * topology.pp_size > 1:
        from megatron.core import parallel_state

        group = parallel_state.get_model_parallel_group()
        dist.all_reduce(squares, group=group, async_op=True).wait(timeout)
    total_norm = float(squares.sqrt())
    factor = max_norm / (total_norm + 1e-6)
    if factor < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(factor)
    return total_norm
