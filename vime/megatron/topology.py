"""Where this trainer rank sits in the Megatron mesh, as one value built once.

Library code receives a `Topology` instead of calling `parallel_state.get_*` itself; tests build one
by hand (`Topology.for_rank`) without initialising anything.

Weight sync sends from one rank per pipeline stage, the *pp sender*: the rank with tp, cp and dp
rank 0 of its stage. In Megatron's default rank order ("tp-cp-ep-dp-pp") that rank also has
expert-tp, ep and expert-dp rank 0, so the stage's experts can be gathered to it; `Topology`
checks this.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Sizes and ranks of every parallel axis for one rank (Megatron names: tp, pp, dp, cp, ep)."""

    world_rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    expert_tp_rank: int = 0
    expert_tp_size: int = 1
    expert_dp_rank: int = 0
    expert_dp_size: int = 1
    # Virtual pipeline stages per pipeline rank (interleaved 1F1B): the rank holds vp_size model
    # chunks; its stage still sends as one (all its chunks' layers).
    vp_size: int = 1

    def __post_init__(self) -> None:
        problems = []
        for axis in ("world", "tp", "pp", "dp", "cp", "ep", "expert_tp", "expert_dp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if size < 1 or not 0 <= rank < size:
                problems.append(f"{axis} rank {rank} is not in [0, {axis}_size={size})")
        dense = self.tp_size * self.cp_size * self.dp_size * self.pp_size
        if dense != self.world_size:
            problems.append(f"tp*cp*dp*pp={dense} != world_size={self.world_size}")
        expert = self.expert_tp_size * self.ep_size * self.expert_dp_size * self.pp_size
        if expert != self.world_size:
            problems.append(f"expert_tp*ep*expert_dp*pp={expert} != world_size={self.world_size}")
        sender_expert_ranks = (self.expert_tp_rank, self.ep_rank, self.expert_dp_rank)
        if self.is_pp_sender and sender_expert_ranks != (0, 0, 0):
            problems.append(
                "the pp sender (tp=cp=dp rank 0) must have expert_tp, ep and expert_dp rank 0, "
                f"got {sender_expert_ranks}; use Megatron's default rank order"
            )
        if self.vp_size < 1 or (self.vp_size > 1 and self.pp_size == 1):
            problems.append(f"vp_size={self.vp_size} needs pp_size > 1 (got {self.pp_size})")
        if problems:
            raise ValueError(f"invalid topology ({self.describe()}): " + "; ".join(problems))

    def describe(self) -> str:
        """Every degree and rank on one line, for errors and logs."""
        return (
            f"world {self.world_rank}/{self.world_size}, tp {self.tp_rank}/{self.tp_size}, "
            f"pp {self.pp_rank}/{self.pp_size}, dp {self.dp_rank}/{self.dp_size}, "
            f"cp {self.cp_rank}/{self.cp_size}, ep {self.ep_rank}/{self.ep_size}, "
            f"expert_tp {self.expert_tp_rank}/{self.expert_tp_size}, "
            f"expert_dp {self.expert_dp_rank}/{self.expert_dp_size}"
            + (f", vp {self.vp_size}" if self.vp_size > 1 else "")
        )

    @property
    def is_pp_sender(self) -> bool:
        """The one rank of this pipeline stage that holds the stage's gathered HF weights."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.dp_rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def for_rank(
        cls,
        world_rank: int,
        world_size: int,
        *,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        expert_tp: int | None = None,
        vp: int | None = None,
    ) -> Topology:
        """The topology Megatron's default rank order "tp-cp-ep-dp-pp" (tp fastest) gives a rank."""
        expert_tp = tp if expert_tp is None else expert_tp
        problems = [
            f"world_size={world_size} is not divisible by {name}={size}"
            for name, size in (("tp*cp*pp", tp * cp * pp), ("expert_tp*ep*pp", expert_tp * ep * pp))
            if size < 1 or world_size % size != 0
        ]
        if problems:
            raise ValueError(
                f"invalid parallel sizes (world_size={world_size}, tp={tp}, pp={pp}, cp={cp}, "
                f"ep={ep}, expert_tp={expert_tp}): " + "; ".join(problems)
            )
        dp = world_size // (tp * cp * pp)
        expert_dp = world_size // (expert_tp * ep * pp)
        rank = world_rank
        tp_rank, rank = rank % tp, rank // tp
        cp_rank, rank = rank % cp, rank // cp
        dp_rank, pp_rank = rank % dp, rank // dp
        rank = world_rank
        expert_tp_rank, rank = rank % expert_tp, rank // expert_tp
        ep_rank, rank = rank % ep, rank // ep
        expert_dp_rank = rank % expert_dp
        return cls(
            world_rank=world_rank,
            world_size=world_size,
            tp_rank=tp_rank,
            tp_size=tp,
            pp_rank=pp_rank,
            pp_size=pp,
            dp_rank=dp_rank,
            dp_size=dp,
            cp_rank=cp_rank,
            cp_size=cp,
            ep_rank=ep_rank,
            ep_size=ep,
            expert_tp_rank=expert_tp_rank,
            expert_tp_size=expert_tp,
            expert_dp_rank=expert_dp_rank,
            expert_dp_size=expert_dp,
            vp_size=vp or 1,
        )

    @classmethod
    def from_parallel_state(cls) -> Topology:
        """Read once from megatron's parallel_state (after `initialize_model_parallel`)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise ValueError("megatron parallel_state is not initialised")
        return cls(
            world_rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            expert_tp_rank=ps.get_expert_tensor_parallel_rank(),
            expert_tp_size=ps.get_expert_tensor_parallel_world_size(),
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
            expert_dp_size=ps.get_expert_data_parallel_world_size(),
            vp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        )
