"""Gather a sharded Megatron GPTModel into full, HF-named tensors, one pipeline stage at a time.

On every training rank:

    groups = GatherGroups.from_parallel_state()          # once
    for hf_name, tensor in gather_hf_weights(model, converter=converter, topology=topology,
                                             groups=groups):
        ...                                              # only pp senders get here

Each pipeline stage gathers its own layers (with global layer names) to its *pp sender* (tp, cp and
dp rank 0 of the stage, see `Topology`). Only senders yield; every other rank must still run the
generator to the end, because it takes part in the collectives its shards are needed for: TP
gathers in the sender's data-parallel replica, expert-TP and EP gathers in the sender's
expert-data-parallel replica. Ranks of other replicas hold the same weights and do nothing.

The order of tensors is fixed by `converter.megatron_shapes()` and is the order
`hf_weight_metadata` lists, which every rank computes without communication.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.megatron.converters import DecoderConverter
from vime.megatron.converters.base import EMBEDDING, FINAL_NORM, OUTPUT_LAYER
from vime.megatron.model import full_param_names, unwrap
from vime.megatron.sharding import unshard
from vime.megatron.topology import Topology
from vime.utils.timing import PhaseTimer

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class GatherGroups:
    """The process groups weight gathering uses; None where that axis has size 1."""

    tp: Any = None
    ep: Any = None
    expert_tp: Any = None

    @classmethod
    def from_parallel_state(cls) -> GatherGroups:
        from megatron.core import parallel_state as ps

        def sized(group: Any) -> Any:
            return group if dist.get_world_size(group) > 1 else None

        return cls(
            tp=sized(ps.get_tensor_model_parallel_group()),
            ep=sized(ps.get_expert_model_parallel_group()),
            expert_tp=sized(ps.get_expert_tensor_parallel_group()),
        )


@dataclass(frozen=True)
class HFWeightMeta:
    """What a receiver needs to allocate one HF tensor, and which pipeline stage sends it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pp_stage: int


def stage_layer_ranges(config: Any) -> list[range]:
    """Global layer indices of every pipeline stage, by megatron's own split (no communication)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.virtual_pipeline_model_parallel_size not in (None, 1):
        raise ValueError("virtual pipeline stages are not supported")
    ranges = []
    for pp_rank in range(config.pipeline_model_parallel_size):
        offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
        ranges.append(range(offset, offset + get_num_layers_to_build(config, pp_rank=pp_rank)))
    return ranges


def _stage_of(name: str, layer_ranges: list[range]) -> int:
    if name == EMBEDDING:
        return 0
    if name in (FINAL_NORM, OUTPUT_LAYER):
        return len(layer_ranges) - 1
    match = _LAYER.match(name)
    if match is None:
        raise ValueError(f"{name!r} is no embedding, final norm, output layer or layer weight")
    layer = int(match.group(1))
    return next(stage for stage, layers in enumerate(layer_ranges) if layer in layers)


def stage_plan(converter: DecoderConverter, config: Any, pp_rank: int) -> list[tuple[str, tuple]]:
    """The full Megatron (name, shape) pairs pipeline stage `pp_rank` sends, in sending order."""
    layer_ranges = stage_layer_ranges(config)
    return [
        (name, shape)
        for name, shape in converter.megatron_shapes()
        if _stage_of(name, layer_ranges) == pp_rank
    ]


def hf_weight_metadata(converter: DecoderConverter, config: Any) -> list[HFWeightMeta]:
    """Names, dtypes, shapes and sending stage of every HF tensor, in gathering order.

    Pure: runs the converter on meta tensors, so every rank computes the same list and no data
    moves. All parameters have `config.params_dtype`.
    """
    metadata = []
    for pp_rank in range(config.pipeline_model_parallel_size):
        for name, shape in stage_plan(converter, config, pp_rank):
            meta = torch.empty(shape, dtype=config.params_dtype, device="meta")
            for hf_name, tensor in converter.to_hf(name, meta):
                metadata.append(HFWeightMeta(hf_name, tensor.dtype, tuple(tensor.shape), pp_rank))
    return metadata


def _gather_to_first(
    tensor: torch.Tensor, group: Any, timeout: timedelta
) -> list[torch.Tensor] | None:
    """All ranks' `tensor` on group rank 0 (in group rank order), None elsewhere."""
    tensor = tensor.detach().contiguous()
    is_dst = dist.get_rank(group) == 0
    parts = (
        [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))] if is_dst else None
    )
    work = dist.gather(tensor, parts, group=group, group_dst=0, async_op=True)
    work.wait(timeout=timeout)
    return parts


class _StageGatherer:
    """Gathers one stage's parameters; decides in one place who joins which collective."""

    def __init__(
        self,
        model: torch.nn.Module,
        converter: DecoderConverter,
        topology: Topology,
        groups: GatherGroups,
        timeout: timedelta,
    ) -> None:
        self.converter = converter
        self.topology = topology
        self.groups = groups
        self.timeout = timeout
        names = full_param_names(model, topology)
        self.params = {names[local]: param for local, param in model.named_parameters()}
        self.num_local_experts = converter.dims.num_experts // topology.ep_size
        # Dense shards are needed in the sender's data-parallel replica only; expert shards in the
        # sender's expert-data-parallel replica (expert-tp) and, after that, in its EP group.
        self.join_tp = topology.dp_rank == 0 and topology.cp_rank == 0
        self.join_expert_tp = topology.expert_dp_rank == 0
        self.join_ep = topology.expert_dp_rank == 0 and topology.expert_tp_rank == 0
        self.expert_cache: dict[str, torch.Tensor] = {}

    def _unshard(self, name: str, param: torch.nn.Parameter, group: Any) -> torch.Tensor | None:
        if group is None or not getattr(param, "tensor_model_parallel", False):
            return param.detach()
        parts = _gather_to_first(param, group, self.timeout)
        if parts is None:
            return None
        return unshard(parts, partition_dim=param.partition_dim, glu=self.converter.is_glu(name))

    def dense(self, name: str) -> torch.Tensor | None:
        if not self.join_tp:
            return None
        return self._unshard(name, self.params[name], self.groups.tp)

    def expert(self, name: str) -> torch.Tensor | None:
        """Expert `e` of a layer; the EP gather for local expert j runs at e == j (< num_local)."""
        match = _EXPERT.match(name)
        if match is None:
            raise ValueError(f"{name!r} is not an expert weight")
        layer, expert_text, suffix = match.groups()
        expert = int(expert_text)
        if expert < self.num_local_experts and self.join_expert_tp:
            local_name = f"decoder.layers.{layer}.mlp.experts.local_experts.{{}}.{suffix}"
            owned = self.topology.ep_rank * self.num_local_experts + expert
            full = self._unshard(
                local_name.format(owned),
                self.params[local_name.format(owned)],
                self.groups.expert_tp,
            )
            if full is not None and self.join_ep:
                parts = (
                    [full]
                    if self.groups.ep is None
                    else _gather_to_first(full, self.groups.ep, self.timeout)
                )
                for ep_rank, part in enumerate(parts or []):
                    global_expert = ep_rank * self.num_local_experts + expert
                    self.expert_cache[local_name.format(global_expert)] = part
        return self.expert_cache.pop(name, None)


def gather_hf_weights(
    model: torch.nn.Module,
    *,
    converter: DecoderConverter,
    topology: Topology,
    groups: GatherGroups,
    timeout: timedelta = timedelta(minutes=5),
    timer: PhaseTimer | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield this stage's full HF (name, tensor) pairs on its pp sender; yield nothing elsewhere.

    Run it to the end on every rank of the stage. Each collective wait times out after `timeout`.
    Tensors keep the parameters' dtype and device; they may share storage with the parameters
    (TP=1), so copy before the next optimizer step if you keep them. `timer` gets the time spent
    in the collectives and unsharding ("gather") and in the Megatron -> HF mapping ("convert").
    """
    timer = timer or PhaseTimer()
    model = unwrap(model)
    gatherer = _StageGatherer(model, converter, topology, groups, timeout)
    plan = [name for name, _ in stage_plan(converter, model.config, topology.pp_rank)]
    # The last stage's copy of a tied embedding maps to no HF tensor and is not in the plan.
    unplanned = set(gatherer.params) - set(plan) - {OUTPUT_LAYER}
    assert not unplanned, f"parameters missing from the gather plan: {sorted(unplanned)}"
    for name in plan:
        with timer.phase("gather"):
            full = gatherer.expert(name) if _EXPERT.match(name) else gatherer.dense(name)
        if topology.is_pp_sender:
            assert full is not None, f"{name} did not reach the pp sender"
            with timer.phase("convert"):
                hf_tensors = list(converter.to_hf(name, full))
            yield from hf_tensors
