"""Gather a sharded Megatron GPTModel into full, HF-named tensors, one pipeline stage at a time.

On every training rank:

    plan = GatherPlan(model, converter=converter, topology=topology)  # model: chunk or list
    groups = GatherGroups.from_parallel_state()                       # once
    for hf_name, tensor in plan.gather(groups):
        ...                                                           # only pp senders get here

Each pipeline stage gathers the tensors of its chunks (with global layer names) to its *pp sender*
(tp, cp and dp rank 0 of the stage, see `Topology`). Only senders yield; every other rank must
still run the generator to the end, because it takes part in the collectives its shards are needed
for: TP gathers in the sender's data-parallel replica, expert-TP and EP gathers in the sender's
expert-data-parallel replica. Ranks of other replicas hold the same weights and do nothing.

What a stage sends, and in which order, is read from the model itself (`param_names`): its chunks
in order, each in module order, so virtual pipeline stages, uneven layer splits and either layer
spec need no layer arithmetic here. `plan.stage_metadata()` lists the stage's HF tensors in that
order without communication; the updater shares it between stages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.megatron.converters import DecoderConverter
from vime.megatron.param_names import SyncTensor, model_chunks, sync_tensors
from vime.megatron.sharding import unshard
from vime.megatron.topology import Topology
from vime.utils.timing import PhaseTimer


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


class GatherPlan:
    """This rank's tensors to sync and how to gather them; built once per model."""

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        *,
        converter: DecoderConverter,
        topology: Topology,
    ) -> None:
        self.converter = converter
        self.topology = topology
        self.chunks = model_chunks(model)
        self.tensors, self.layout = sync_tensors(
            self.chunks, converter=converter, topology=topology
        )
        # Dense shards are needed in the sender's data-parallel replica only; expert shards in the
        # sender's expert-data-parallel replica (expert-tp) and, after that, in its EP group.
        self.join_tp = topology.dp_rank == 0 and topology.cp_rank == 0
        self.join_expert_tp = topology.expert_dp_rank == 0
        self.join_ep = topology.expert_dp_rank == 0 and topology.expert_tp_rank == 0

    def stage_metadata(self) -> list[HFWeightMeta]:
        """The HF tensors this rank's stage sends, in sending order (no communication; runs the
        converter on meta tensors)."""
        metadata = []
        for item in self.tensors:
            for name in item.full_names:
                meta = torch.empty(item.full_shape, dtype=item.tensor.dtype, device="meta")
                for hf_name, tensor in self.converter.to_hf(name, meta):
                    metadata.append(
                        HFWeightMeta(
                            hf_name, tensor.dtype, tuple(tensor.shape), self.topology.pp_rank
                        )
                    )
        return metadata

    def _unshard(self, item: SyncTensor, group: Any, timeout: timedelta) -> torch.Tensor | None:
        if group is None or item.axis is None:
            return item.tensor.detach()
        parts = _gather_to_first(item.tensor, group, timeout)
        if parts is None:
            return None
        return unshard(parts, partition_dim=item.partition_dim, glu=item.glu)

    def _full(
        self, item: SyncTensor, groups: GatherGroups, timeout: timedelta
    ) -> list[torch.Tensor] | None:
        """The full tensors `item` becomes (one per name in item.full_names) on the pp sender."""
        if not item.is_expert:
            if not self.join_tp:
                return None
            full = self._unshard(item, groups.tp, timeout)
            return None if full is None else [full]
        if not self.join_expert_tp:
            return None
        full = self._unshard(item, groups.expert_tp, timeout)
        if full is None or not self.join_ep:
            return None
        if groups.ep is None:
            return [full]
        return _gather_to_first(full, groups.ep, timeout)

    def gather(
        self,
        groups: GatherGroups,
        *,
        timeout: timedelta = timedelta(minutes=5),
        timer: PhaseTimer | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield this stage's full HF (name, tensor) pairs on its pp sender; nothing elsewhere.

        Run it to the end on every rank of the stage. Each collective wait times out after
        `timeout`. Tensors keep the parameters' dtype and device; they may share storage with
        the parameters (TP=1), so copy before the next optimizer step if you keep them. `timer`
        gets the time spent in the collectives and unsharding ("gather") and in the
        Megatron -> HF mapping ("convert").
        """
        timer = timer or PhaseTimer()
        for item in self.tensors:
            with timer.phase("gather"):
                parts = self._full(item, groups, timeout)
            if self.topology.is_pp_sender:
                assert parts is not None and len(parts) == len(item.full_names), item.local_name
                with timer.phase("convert"):
                    hf_tensors = [
                        pair
                        for name, part in zip(item.full_names, parts, strict=True)
                        for pair in self.converter.to_hf(name, part)
                    ]
                yield from hf_tensors


def gather_hf_weights(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    converter: DecoderConverter,
    topology: Topology,
    groups: GatherGroups,
    timeout: timedelta = timedelta(minutes=5),
    timer: PhaseTimer | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`GatherPlan(model, ...).gather(groups, ...)` in one call (see `GatherPlan.gather`)."""
    plan = GatherPlan(model, converter=converter, topology=topology)
    return plan.gather(groups, timeout=timeout, timer=timer)
