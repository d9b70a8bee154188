"""Trainer-side transports, one per sync shape, built by `make_transport` for a transport config.

`weight_sync.transport.kind` picks the shape and the device plug-in (`vime.weight_sync.devices`):

| kind | shape (transport, engine backend)              | plug-in on GPU | with device: cpu |
|------|------------------------------------------------|----------------|------------------|
| gloo | `BroadcastTransport`, `vime_broadcast`         | (CPU only)     | gloo             |
| nccl | `BroadcastTransport`, `vime_broadcast`         | nccl           | gloo             |
| shm  | `ColocatedTransport`, `vime_colocated`         | (CPU only)     | shm              |
| ipc  | `ColocatedTransport`, `vime_colocated`         | ipc            | shm              |

The GPU plug-ins are imported only when built, so a CPU job never imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vime.cluster.addresses import node_address
from vime.config import BroadcastTransportConfig, TransportConfig
from vime.utils.net import free_port
from vime.weight_sync.devices import handles_class
from vime.weight_sync.transports.base import Transport
from vime.weight_sync.transports.broadcast import BroadcastTransport
from vime.weight_sync.transports.colocated import ColocatedTransport, Spread


@dataclass(frozen=True)
class SenderPlace:
    """What a transport needs to know of the rank that builds it."""

    pp_rank: int
    engine_world_sizes: Sequence[int]  # each engine's workers, in engine order
    timeout_s: float
    device: torch.device  # where this rank's buffers live
    device_id: str  # `devices.device_id` of `device` (colocated handles are keyed by it)
    spread: Spread | None = None  # colocated, engine workers on several devices


def stage_group_name(pp_rank: int) -> str:
    """Each pipeline stage's broadcast group; the engines hold all stages' groups at once."""
    return f"vime-pp_{pp_rank}"


def _rendezvous(config: BroadcastTransportConfig) -> tuple[str, int]:
    # This sender's node: the engines' workers connect to it. Port 0: the transport picks one.
    address = config.master_address or node_address()
    port_range = config.master_port_range
    return address, free_port(address, port_range) if port_range else 0


def make_transport(config: TransportConfig, place: SenderPlace, shadow: bool = False) -> Transport:
    """The transport `config` names, for the rank at `place` (not yet connected); `shadow`: the
    engines load each update beside the served weights (`weight_sync.shadow`)."""
    if isinstance(config, BroadcastTransportConfig):
        address, port = _rendezvous(config)
        return BroadcastTransport(
            engine_world_sizes=place.engine_world_sizes,
            communicator=config.plugin,
            device=place.device,
            master_address=address,
            master_port=port,
            group_name=stage_group_name(place.pp_rank),
            timeout_s=place.timeout_s,
            shadow=shadow,
        )
    handles = handles_class(config.plugin)(place.device, prefix=f"vime-pp_{place.pp_rank}")
    return ColocatedTransport(
        handles=handles,
        device_id=place.device_id,
        device=place.device,
        spread=place.spread,
        timeout_s=place.timeout_s,
        shadow=shadow,
    )


__all__ = ["SenderPlace", "Spread", "Transport", "make_transport", "stage_group_name"]
