"""Trainer-side transports, one per `weight_sync.transport.kind`, built by `make_transport`.

The registry maps each kind (the same name as the engines' --weight-transfer-config backend) to
a builder taking the transport's config section and what this sender knows of its place: its
pipeline stage and a way to ask the engines for their worker counts. Transport modules are
imported when their kind is built, so a CPU job never imports the GPU ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vime.cluster.addresses import node_address
from vime.config import (
    TRANSPORT_KINDS,
    BroadcastTransportConfig,
    GlooTransportConfig,
    IpcTransportConfig,
    NcclTransportConfig,
    ShmTransportConfig,
    TransportConfig,
)
from vime.utils.net import free_port
from vime.weight_sync.transports.base import Transport


@dataclass(frozen=True)
class SenderPlace:
    """What a transport needs to know of the pp sender that builds it."""

    pp_rank: int
    pp_size: int
    engine_world_sizes: Sequence[int]  # each engine's workers, in engine order
    bucket_bytes: int
    timeout_s: float


def stage_group_name(pp_rank: int) -> str:
    """Each pipeline stage's broadcast group; the engines hold all stages' groups at once."""
    return f"vime-pp_{pp_rank}"


def _rendezvous(config: BroadcastTransportConfig) -> tuple[str, int]:
    # This sender's node: the engines' workers connect to it. Port 0: the transport picks one.
    address = config.master_address or node_address()
    port_range = config.master_port_range
    return address, free_port(address, port_range) if port_range else 0


def _gloo(config: GlooTransportConfig, place: SenderPlace) -> Transport:
    from vime.weight_sync.transports.gloo import GlooTransport

    address, port = _rendezvous(config)
    return GlooTransport(
        engine_world_sizes=place.engine_world_sizes,
        master_address=address,
        master_port=port,
        group_name=stage_group_name(place.pp_rank),
        timeout_s=place.timeout_s,
    )


def _nccl(config: NcclTransportConfig, place: SenderPlace) -> Transport:
    from vime.weight_sync.transports.nccl import NcclTransport

    if place.pp_size > 1:
        raise ValueError(
            f"weight_sync.transport nccl with pipeline parallel size {place.pp_size}: vLLM's "
            "NCCL backend holds one trainer group per engine, so only one stage can send. Use "
            "transport gloo, or pp=1"
        )
    address, port = _rendezvous(config)
    return NcclTransport(
        engine_world_sizes=place.engine_world_sizes,
        master_address=address,
        master_port=port or free_port(address),
        max_bucket_bytes=place.bucket_bytes,
        timeout_s=place.timeout_s,
    )


def _shm(config: ShmTransportConfig, place: SenderPlace) -> Transport:
    from vime.weight_sync.transports.shm import ShmTransport

    return ShmTransport(prefix=f"vime-pp_{place.pp_rank}", timeout_s=place.timeout_s)


def _ipc(config: IpcTransportConfig, place: SenderPlace) -> Transport:
    from vime.weight_sync.transports.ipc import IpcTransport

    return IpcTransport(timeout_s=place.timeout_s)


TRANSPORTS: dict[str, Callable[..., Transport]] = {
    "gloo": _gloo,
    "nccl": _nccl,
    "shm": _shm,
    "ipc": _ipc,
}
assert set(TRANSPORTS) == set(TRANSPORT_KINDS), "every config transport kind needs a builder"


def make_transport(config: TransportConfig, place: SenderPlace) -> Transport:
    """The transport `config.kind` names, for the sender at `place` (not yet connected)."""
    build = TRANSPORTS.get(config.kind)
    if build is None:
        raise ValueError(f"no transport registered for kind {config.kind!r}: {sorted(TRANSPORTS)}")
    return build(config, place)


__all__ = ["TRANSPORTS", "SenderPlace", "Transport", "make_transport", "stage_group_name"]
