"""The device plug-ins of weight sync: the only code that differs between a CPU and a GPU sync.

Each sync shape has one trainer transport and one engine receiver; the device enters through
exactly one plug-in, looked up here by the name the transport's init_info carries:

- distributed shape (`transport.kind` gloo | nccl): a `Communicator`, the broadcast group of one
  pipeline stage (its sender is rank 0, the engines' workers follow). `gloo`: a ProcessGroupGloo
  over TCP on CPU buffers (`devices.cpu`); `nccl`: NCCL through vLLM's PyNcclCommunicator on the
  CUDA device's buffers (`devices.cuda`). Both rendezvous through the sender's TCPStore, so the
  rendezvous waits as long as `weight_sync.transfer_timeout_s`, never a fixed time.
- colocated shape (shm | ipc): `Handles`, how a buffer a trainer rank filled is named to an engine
  worker on the same device. `shm`: a POSIX shared-memory segment (`devices.cpu`); `ipc`: a CUDA
  IPC handle (`devices.cuda`), sent as JSON (nothing is unpickled).

The interfaces and device ids live in `devices.base`. This package imports no trainer code
(engine workers import it); the GPU plug-ins are imported only when asked for.
"""

from __future__ import annotations

import torch

from vime.weight_sync.devices.base import (
    HOST,
    Communicator,
    Handles,
    Pending,
    device_id,
    is_distinct,
)


def plugin_device(plugin: str) -> torch.device:
    """Where a trainer rank's buffers live for `plugin`: the current GPU for nccl and ipc, the
    CPU for gloo and shm; ValueError when a GPU plug-in has no GPU."""
    if plugin not in ("nccl", "ipc"):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"the {plugin} plug-in moves GPU buffers but this process has no CUDA device: set "
            "weight_sync.transport.device: cpu (or use gloo / shm)"
        )
    return torch.device("cuda", torch.cuda.current_device())


def communicator_class(name: str) -> type[Communicator]:
    """The communicator plug-in `name` ("gloo" or "nccl"); the GPU one is imported on use."""
    if name == "gloo":
        from vime.weight_sync.devices.cpu import GlooCommunicator

        return GlooCommunicator
    if name == "nccl":
        from vime.weight_sync.devices.cuda import NcclCommunicator

        return NcclCommunicator
    raise ValueError(f"unknown communicator {name!r}: expected 'gloo' or 'nccl'")


def handles_class(name: str) -> type[Handles]:
    """The handle plug-in `name` ("shm" or "ipc"); the GPU one is imported on use."""
    if name == "shm":
        from vime.weight_sync.devices.cpu import ShmHandles

        return ShmHandles
    if name == "ipc":
        from vime.weight_sync.devices.cuda import IpcHandles

        return IpcHandles
    raise ValueError(f"unknown handle kind {name!r}: expected 'shm' or 'ipc'")


__all__ = [
    "HOST",
    "Communicator",
    "Handles",
    "Pending",
    "communicator_class",
    "device_id",
    "handles_class",
    "is_distinct",
    "plugin_device",
]
