"""UpdateWeightFromDistributed: each pipeline stage's sender broadcasts its buckets to the engines.

For engines on other hosts (or GPUs) than the trainer. Every stage has its own broadcast group,
named `vime-pp_{pp_rank}`, of world size 1 + all engines' workers: the stage's sender is rank 0,
engine e's workers follow from `rank_offset = 1 + sum(world sizes of engines before e)`. The
engines hold all stages' groups at once and each update names its group; stages take turns.

Transports (`weight_sync.transport`): `gloo` (CPU, TCP; engines started with the vime `gloo`
backend) or `nccl` (GPU; vLLM's own NCCL backend, which holds one group per engine, so only one
pipeline stage).
"""

from __future__ import annotations

from vime.cluster.addresses import node_address
from vime.utils.net import free_port
from vime.weight_sync.transports import GlooTransport, NcclTransport, Transport
from vime.weight_sync.updater import WeightUpdater


def stage_group_name(pp_rank: int) -> str:
    return f"vime-pp_{pp_rank}"


class UpdateWeightFromDistributed(WeightUpdater):
    """Broadcast weight sync (gloo on CPU, nccl on GPU); see the module docstring."""

    mode = "distributed"

    def make_transport(self) -> Transport:
        config = self.config
        world_sizes = [int(engine.get_world_size()) for engine in self.engines]
        # This sender's node: the engines' workers connect to it.
        address = config.master_address or node_address()
        port_range = config.master_port_range
        if config.transport == "gloo":
            return GlooTransport(
                engine_world_sizes=world_sizes,
                master_address=address,
                master_port=free_port(address, port_range) if port_range else 0,
                group_name=stage_group_name(self.topology.pp_rank),
                timeout_s=config.transfer_timeout_s,
            )
        if config.transport == "nccl":
            if self.topology.pp_size > 1:
                raise ValueError(
                    f"transport 'nccl' with pipeline parallel size {self.topology.pp_size}: vLLM's "
                    "NCCL backend holds one trainer group per engine, so only one stage can send. "
                    "Use transport 'gloo', or pp=1"
                )
            return NcclTransport(
                engine_world_sizes=world_sizes,
                master_address=address,
                master_port=free_port(address, port_range),
                max_bucket_bytes=config.update_weight_buffer_size,
                timeout_s=config.transfer_timeout_s,
            )
        raise ValueError(
            f"mode 'distributed' sends with transport 'gloo' or 'nccl', not {config.transport!r}"
        )
