"""Trainer-side transports, keyed by the engine backend name they talk to."""

from vime.weight_sync.transports.base import Transport
from vime.weight_sync.transports.gloo import GlooTransport
from vime.weight_sync.transports.ipc import IpcTransport
from vime.weight_sync.transports.nccl import NcclTransport
from vime.weight_sync.transports.shm import ShmTransport

TRANSPORTS: dict[str, type[Transport]] = {
    cls.backend: cls for cls in (GlooTransport, ShmTransport, NcclTransport, IpcTransport)
}

__all__ = [
    "TRANSPORTS",
    "GlooTransport",
    "IpcTransport",
    "NcclTransport",
    "ShmTransport",
    "Transport",
]
