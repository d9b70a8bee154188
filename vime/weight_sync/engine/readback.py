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

vLLM's CPU backend repacks each linear weight into a kernel and keeps no readable copy; reading
one back goes through the kernel (`_served_tensor`: exact, but a matrix product per layer, ~0.4 s
for 135M parameters on one core). `record_load_digests` is the cheap way: it wraps vLLM's CPU GEMM
dispatch so that the moment before a layer is repacked, the digests of its logical weight (the
bytes vLLM's weight loaders placed: names, fused layouts, slices and dtypes all applied) are kept
on the layer; `served_shards(loaded_digests=True)` reports those instead of reading the kernel.
What they do not cover is the repack itself (vLLM's own code on those bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vime.weight_sync.shards import Shard


@dataclass(frozen=True)
class ServedTensor:
    """One HF-named tensor as one worker serves it."""

    name: str
    tensor: torch.Tensor  # this worker's part (a meta tensor when not materialized)
    shape: tuple[int, ...]  # the whole HF tensor's shape
    shard: Shard | None  # None: the worker holds the whole tensor
    digest: str | None = None  # its digest taken at load (tensor is then a meta tensor)


# On a repacked linear layer: {(first row, end row) of its logical weight: digest}, for the whole
# weight and for each fused part (q/k/v, gate/up), taken just before the repack.
LOAD_DIGESTS = "_vime_load_digests"


def record_load_digests() -> None:
    """From now on (in this process) every linear layer vLLM's CPU backend repacks keeps the
    digests of its logical weight (`LOAD_DIGESTS`). Idempotent; a no-op where vLLM has no CPU
    GEMM dispatch (GPU builds do not repack)."""
    from vllm.model_executor.layers import utils

    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or getattr(original, "records_load_digests", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        # remove_weight=False (embeddings) keeps the weight readable: nothing to record.
        if (
            remove_weight
            and isinstance(weight, torch.Tensor)
            and weight.ndim == 2
            and not weight.is_meta
        ):
            setattr(layer, LOAD_DIGESTS, _row_digests(layer, weight.detach()))
        original(layer, remove_weight)

    dispatch.records_load_digests = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch


def _row_digests(layer: torch.nn.Module, weight: torch.Tensor) -> dict[tuple[int, int], str]:
    from vime.weight_sync.buckets import tensor_digest

    rows = weight.shape[0]
    ranges = {(0, rows)}
    sizes = list(getattr(layer, "output_partition_sizes", None) or [])
    if len(sizes) > 1 and sum(sizes) == rows:
        start = 0
        for size in sizes:
            ranges.add((start, start + size))
            start += size
    return {(a, b): tensor_digest(weight[a:b]) for a, b in sorted(ranges)}


def served_shards(
    model: torch.nn.Module, materialize: bool = True, loaded_digests: bool = False
) -> Iterator[ServedTensor]:
    """The weights this worker serves, under checkpoint (HF) names, with the slice it holds.

    vLLM fuses some checkpoint tensors (q/k/v into qkv_proj, gate/up into gate_up_proj, per the
    model's `packed_modules_mapping`) and pads vocab rows; this splits and trims them back. With
    `materialize=False` the tensors are meta tensors (names, dtypes and shapes only, no compute).
    With `loaded_digests` a repacked linear weight whose load digests were recorded
    (`record_load_digests`) comes as a meta tensor with its digest instead of being read back
    through its kernel.
    """
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from vime.weight_sync.engine.moe import expert_tensors, is_routed_experts

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    # A tied lm_head shares the embedding's parameter: listed once, under the embedding's name;
    # read back as served, the head's own CPU kernel (a packed copy) is read too, under that name.
    seen: dict[int, str] = {}
    for module_name, module in model.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        parent = module_name[: -len(leaf)]
        tp_rank, tp_size = getattr(module, "tp_rank", 0), getattr(module, "tp_size", 1)
        fused_experts = is_routed_experts(module)
        if fused_experts:
            for name, part, shape, shard in expert_tensors(module_name, module, materialize):
                yield ServedTensor(name, part, shape, shard)
            seen.update({id(module.w13_weight): "", id(module.w2_weight): ""})
        for param_name, param in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            recorded = None
            if id(param) in seen:
                tied_kernel = getattr(module, "cpu_linear", None) is not None and param.ndim == 2
                if not (seen[id(param)] and tied_kernel and materialize and not loaded_digests):
                    continue
                full_name = seen[id(param)]  # what the head computes with, as the tied weight
                tensor = _through_kernel(module.cpu_linear, param, *param.shape)
            else:
                seen[id(param)] = full_name
                if loaded_digests and _is_repacked(module, param_name, param):
                    recorded = getattr(module, LOAD_DIGESTS, None)
                materialized = materialize and recorded is None
                tensor = _served_tensor(module, param_name, param, materialized)
            if isinstance(module, VocabParallelEmbedding):
                rows = module.shard_indices
                shape = (module.org_vocab_size, *tensor.shape[1:])
                start, stop = rows.org_vocab_start_index, rows.org_vocab_end_index
                shard = None if tp_size == 1 else Shard(0, start, stop)
                yield ServedTensor(full_name, tensor[: rows.num_org_elements], shape, shard)
            elif isinstance(module, ColumnParallelLinear):
                dim = getattr(param, "output_dim", 0)
                if leaf in packed and hasattr(module, "output_sizes"):
                    sizes = list(module.output_partition_sizes)
                    parts = tensor.split(sizes, dim=dim)
                    starts = [sum(sizes[:index]) for index in range(len(sizes))]
                    for index, (sub_name, part) in enumerate(zip(packed[leaf], parts, strict=True)):
                        # k and v (parts 1, 2) repeat on num_kv_head_replicas workers each.
                        replicas = 1
                        if isinstance(module, QKVParallelLinear) and index > 0:
                            replicas = module.num_kv_head_replicas
                        name = f"{parent}{sub_name}.{param_name}"
                        served = _slice(name, part, dim, tp_rank // replicas, tp_size // replicas)
                        span = (starts[index], starts[index] + sizes[index])
                        yield _with_digest(served, recorded, span, dim)
                else:
                    served = _slice(full_name, tensor, dim, tp_rank, tp_size)
                    yield _with_digest(served, recorded, (0, tensor.shape[0]), dim)
            elif isinstance(module, RowParallelLinear) and tensor.dim() > 1:
                # Columns are split; the bias is whole on every worker.
                dim = getattr(param, "input_dim", 1)
                served = _slice(full_name, tensor, dim, tp_rank, tp_size)
                yield _with_digest(served, recorded, (0, tensor.shape[0]), 0)
            else:
                # Whole on every worker (e.g. ReplicatedLinear: an MoE router, repacked too).
                served = ServedTensor(full_name, tensor, tuple(tensor.shape), None)
                yield (
                    served
                    if recorded is None
                    else _with_digest(served, recorded, (0, len(tensor)), 0)
                )


def _is_repacked(module: torch.nn.Module, param_name: str, param: torch.Tensor) -> bool:
    """vLLM's CPU backend moved this linear weight into a kernel (an empty `weight` remains)."""
    return (
        param_name == "weight"
        and param.numel() == 0
        and getattr(module, "cpu_linear", None) is not None
    )


def _with_digest(
    served: ServedTensor, recorded: dict | None, rows: tuple[int, int], dim: int
) -> ServedTensor:
    """`served` with the load digest of its rows of the logical weight (rows along `dim` 0);
    unchanged when nothing was recorded."""
    if recorded is None:
        return served
    digest = recorded.get(rows) if dim == 0 else None
    if digest is None:
        raise RuntimeError(
            f"{served.name}: no load digest of rows {rows} (dim {dim}) was recorded; read it "
            "back through its kernel (weight_sync.verify_source: served)"
        )
    return ServedTensor(served.name, served.tensor, served.shape, served.shard, digest)


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
    if not _is_repacked(module, param_name, param):
        return param if materialize else torch.empty(param.shape, dtype=param.dtype, device="meta")
    cpu_linear = module.cpu_linear
    rows = getattr(module, "output_size_per_partition", None) or module.output_size
    cols = getattr(module, "input_size_per_partition", None) or module.input_size
    if not materialize:
        return torch.empty((rows, cols), dtype=param.dtype, device="meta")
    return _through_kernel(cpu_linear, param, rows, cols)


def _through_kernel(cpu_linear: Any, param: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] matrix a CPU linear kernel multiplies by, read from identity rows."""
    transposed = torch.empty((cols, rows), dtype=param.dtype)
    chunk = 1024
    with torch.no_grad():
        for start in range(0, cols, chunk):
            stop = min(start + chunk, cols)
            identity = torch.zeros((stop - start, cols), dtype=param.dtype)
            identity[torch.arange(stop - start), torch.arange(start, stop)] = 1
            transposed[start:stop] = cpu_linear(identity, param, None)[:, :rows]
    return transposed.t()
