"""Reading back what an engine worker serves, under HF names: for the pre-send metadata check
and the post-sync checksums (`VimeWorkerExtension`).

With tensor parallelism each worker holds a slice of some tensors. `served_shards` says, for
every HF tensor, which slice this worker holds (a `Shard`: one dimension, a start and a stop in
the whole HF tensor), so the trainer can compare the worker's part with the same slice of the
tensor it sent. The slices follow vLLM's own weight loaders: column-parallel layers split rows
(per fused part: q/k/v, gate/up; k/v heads replicated when there are fewer of them than workers),
row-parallel layers split columns, vocab-parallel embeddings split vocabulary rows (their padding
is dropped), fused MoE experts are split back per expert (`engine.moe`); everything else is whole
on every worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vime.weight_sync.shards import Shard


@dataclass(frozen=True)
class ServedTensor:
    """One HF-named tensor as one worker serves it."""

    name: str
    tensor: torch.Tensor  # this worker's part (a meta tensor when not materialized)
    shape: tuple[int, ...]  # the whole HF tensor's shape
    shard: Shard | None  # None: the worker holds the whole tensor


def served_shards(model: torch.nn.Module, materialize: bool = True) -> Iterator[ServedTensor]:
    """The weights this worker serves, under checkpoint (HF) names, with the slice it holds.

    vLLM fuses some checkpoint tensors (q/k/v into qkv_proj, gate/up into gate_up_proj, per the
    model's `packed_modules_mapping`) and pads vocab rows; this splits and trims them back. With
    `materialize=False` the tensors are meta tensors (names, dtypes and shapes only, no compute).
    """
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from vime.weight_sync.engine.moe import expert_tensors, is_routed_experts

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    seen: set[int] = set()  # a tied lm_head shares the embedding's parameter: list it once
    for module_name, module in model.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        parent = module_name[: -len(leaf)]
        tp_rank, tp_size = getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)
        fused_experts = is_routed_experts(module)
        if fused_experts:
            for name, part, shape, shard in expert_tensors(module_name, module, materialize):
                yield ServedTensor(name, part, shape, shard)
            seen.update({id(module.w13_weight), id(module.w2_weight)})
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            tensor = _served_tensor(module, param_name, param, materialize)
            if isinstance(module, VocabParallelEmbedding):
                rows = module.shard_indices
                shape = (module.org_vocab_size, *tensor.shape[1:])
                start, stop = rows.org_vocab_start_index, rows.org_vocab_end_index
                shard = None if tp_size == 1 else Shard(0, start, stop)
                yield ServedTensor(full_name, tensor[: rows.num_org_elements], shape, shard)
            elif isinstance(module, ColumnParallelLinear):
                dim = getattr(param, "output_dim", 0)
                if leaf in packed and hasattr(module, "output_sizes"):
                    parts = tensor.split(list(module.output_partition_sizes), dim=dim)
                    for index, (sub_name, part) in enumerate(zip(packed[leaf], parts, strict=True)):
                        # k and v (parts 1, 2) repeat on num_kv_head_replicas workers each.
                        replicas = 1
                        if isinstance(module, QKVParallelLinear) and index > 0:
                            replicas = module.num_kv_head_replicas
                        name = f"{parent}{sub_name}.{param_name}"
                        yield _slice(name, part, dim, tp_rank // replicas, tp_size // replicas)
                else:
                    yield _slice(full_name, tensor, dim, tp_rank, tp_size)
            elif isinstance(module, RowParallelLinear) and tensor.dim() > 1:
                # Columns are split; the bias is whole on every worker.
                yield _slice(full_name, tensor, getattr(param, "input_dim", 1), tp_rank, tp_size)
            else:
                yield ServedTensor(full_name, tensor, tuple(tensor.shape), None)


def _slice(name: str, part: torch.Tensor, dim: int, index: int, count: int) -> ServedTensor:
    """`part` is slice `index` of `count` equal slices along `dim` of the whole tensor (one
    worker's share; count 1: the whole tensor, on every worker)."""
    size = part.shape[dim]
    shape = list(part.shape)
    shape[dim] = size * count
    shard = None if count == 1 else Shard(dim, index * size, (index + 1) * size)
    return ServedTensor(name, part, tuple(shape), shard)


def _served_tensor(
    module: torch.nn.Module, param_name: str, param: torch.Tensor, materialize: bool
) -> torch.Tensor:
    """`param` itself, except for linear weights that vLLM's CPU backend moved into a kernel.

    On CPU, vLLM repacks each linear weight into a oneDNN/SGL kernel and leaves an empty
    `weight`. The served matrix is read back through the kernel itself, from identity rows: each
    output element is a single product with 1.0, so the result is exact.
    """
    cpu_linear = getattr(module, "cpu_linear", None)
    if param_name != "weight" or param.numel() != 0 or cpu_linear is None:
        return param if materialize else torch.empty(param.shape, dtype=param.dtype, device="meta")
    rows = getattr(module, "output_size_per_partition", None) or module.output_size
    cols = getattr(module, "input_size_per_partition", None) or module.input_size
    if not materialize:
        return torch.empty((rows, cols), dtype=param.dtype, device="meta")
    transposed = torch.empty((cols, rows), dtype=param.dtype)
    chunk = 1024
    with torch.no_grad():
        for start in range(0, cols, chunk):
            stop = min(start + chunk, cols)
            identity = torch.zeros((stop - start, cols), dtype=param.dtype)
            identity[torch.arange(stop - start), torch.arange(start, stop)] = 1
            transposed[start:stop] = cpu_linear(identity, param, None)
    return transposed.t()
