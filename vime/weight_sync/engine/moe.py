"""vLLM's fused MoE experts as vime's engine side sees them: per-expert names, and a CPU fix.

Names. vLLM holds a layer's routed experts in one module (`RoutedExperts`) as two tensors:
`w13_weight` [local experts, 2 x intermediate, hidden] (each expert's gate rows, then its up
rows) and `w2_weight` [local experts, hidden, intermediate]. Checkpoints and vime's trainer name
them per expert (`<prefix>.experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`).
`expert_tensors` splits them back, with the slice a tensor-parallel worker holds (its share of
the intermediate dimension), for the pre-send check and the checksums.

CPU prepack. vLLM 0.32's CPU MoE kernel (`CPUUnquantizedExperts`) prepacks w13/w2 into its
grouped-gemm layout when the model loads. On a weight update `UnquantizedFusedMoEMethod.
_setup_kernel` sees `moe_kernel` already set, copies the new logical weights into the parameters
and skips `fused_experts.process_weights_after_loading`, so the kernel then reads logical bytes
as if they were prepacked: the layer computes garbage until the engine restarts (greedy output
after a sync differs from a fresh engine on the same weights). `refresh_cpu_moe_prepack` runs
the kernel's own prepack again after each update. The prepacked bytes cannot be read back, so it
keeps the logical tensors beside them for `expert_tensors` (the checksums then cover what the
prepack was given; the cost is one more copy of the experts' weights, CPU engines only).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from vime.weight_sync.shards import Shard

_SERVED = "_vime_logical_weights"  # layer attribute: {param name: logical tensor}
_ROUTED_SUFFIX = re.compile(r"\.routed_experts$")
# A checkpoint name of a routed expert weight (per expert or fused): group 1 is the experts'
# module prefix as vLLM names it too (".experts", never "shared_experts").
_EXPERT_WEIGHT = re.compile(
    r"^(.*\.experts)\.(?:\d+\.)?(?:gate_up_proj|gate_proj|up_proj|down_proj)\b"
)


def expert_prefixes(names: Iterator[str] | list[str]) -> set[str]:
    """The experts modules (".experts" prefixes) the checkpoint names load into."""
    return {match.group(1) for name in names if (match := _EXPERT_WEIGHT.match(name))}


def is_routed_experts(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return isinstance(module, RoutedExperts)


def expert_tensors(
    module_name: str, module: torch.nn.Module, materialize: bool
) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...], Shard | None]]:
    """(HF name, this worker's part, whole HF shape, slice held) of every routed expert weight.

    Raises ValueError for expert parallelism in the engine (a worker's experts are a subset
    named by vLLM's expert map, which vime does not read back).
    """
    parallel = module.moe_config.moe_parallel_config
    if parallel.use_ep and parallel.ep_size > 1:
        raise ValueError(
            f"{module_name}: engine expert parallelism (ep_size={parallel.ep_size}) is not "
            "supported by vime's weight readback; serve MoE models without EP"
        )
    tp_rank, tp_size = parallel.tp_rank, parallel.tp_size
    prefix = _ROUTED_SUFFIX.sub("", module_name) + "."
    logical = getattr(module, _SERVED, {})
    w13 = logical.get("w13_weight", module.w13_weight)
    w2 = logical.get("w2_weight", module.w2_weight)
    if not materialize:
        w13 = torch.empty(w13.shape, dtype=w13.dtype, device="meta")
        w2 = torch.empty(w2.shape, dtype=w2.dtype, device="meta")
    num_experts, rows, hidden = w13.shape
    inter = rows // 2  # this worker's share of the intermediate dimension
    full_inter = inter * tp_size

    def rows_slice() -> Shard | None:
        return None if tp_size == 1 else Shard(0, tp_rank * inter, (tp_rank + 1) * inter)

    def cols_slice() -> Shard | None:
        return None if tp_size == 1 else Shard(1, tp_rank * inter, (tp_rank + 1) * inter)

    for expert in range(num_experts):
        base = f"{prefix}{expert}."
        yield f"{base}gate_proj.weight", w13[expert, :inter], (full_inter, hidden), rows_slice()
        yield f"{base}up_proj.weight", w13[expert, inter:], (full_inter, hidden), rows_slice()
        yield f"{base}down_proj.weight", w2[expert], (hidden, full_inter), cols_slice()


def refresh_cpu_moe_prepack(model: torch.nn.Module, loaded: set[str]) -> int:
    """After a weight update: prepack again every CPU MoE layer whose experts the update loaded
    (`loaded`: their ".experts" prefixes, see `expert_prefixes`), keeping the logical tensors
    for readback. A layer the update did not load still holds prepacked bytes and is left alone
    (prepacking twice would scramble it). Returns the layers refreshed."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    refreshed = 0
    for name, module in model.named_modules():
        if not is_routed_experts(module) or _ROUTED_SUFFIX.sub("", name) not in loaded:
            continue
        kernel = getattr(module.quant_method, "moe_kernel", None)
        experts: Any = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        logical = {
            "w13_weight": module.w13_weight.detach().clone(),
            "w2_weight": module.w2_weight.detach().clone(),
        }
        experts.process_weights_after_loading(module)
        if getattr(experts, "_use_zentorch", False):
            continue  # zentorch reads the logical layout: nothing was prepacked
        setattr(module, _SERVED, logical)
        refreshed += 1
    return refreshed
