"""The CUDA plug-ins: an NCCL broadcast group (distributed shape) and CUDA IPC handles (colocated
shape). Importable without CUDA; used only where the buffers live on a GPU.

Never run in this repository's CI (no GPU with vLLM there): the suite runs the same transports and
receivers with the CPU plug-ins (`devices.cpu`); `tools/gpu_check.sh` runs these.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Self

import torch
import torch.distributed as dist

from vime.weight_sync.devices.base import Communicator, Handles

POLL_S = 0.0005
UNIQUE_ID_KEY = "nccl_unique_id"


class _NcclPending:
    """A broadcast queued on the communicator's stream; an event tells when it is done. A raw
    NCCL broadcast cannot be interrupted: the control side polls and gives up at its deadline
    (then `abort()` tears the communicator down)."""

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"NCCL broadcast not done within {timeout_s:g} s")
            time.sleep(POLL_S)


class NcclCommunicator(Communicator):
    """vLLM's PyNcclCommunicator, its unique id exchanged through the group's TCPStore (so the
    rendezvous has the store's deadline), broadcasting on a stream of its own."""

    name = "nccl"

    def __init__(self, comm: Any, store: dist.Store, device: torch.device):
        super().__init__(device)
        self.comm = comm
        self.store = store
        self.stream = torch.cuda.Stream(device=device)

    @classmethod
    def join(
        cls,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        address: str | None,
        device: torch.device,
    ) -> Self:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        if device.type != "cuda":
            raise ValueError(
                f"the nccl communicator needs a CUDA device, this process has {device}: use "
                "weight_sync.transport gloo (or nccl with device: cpu, which runs gloo)"
            )
        if rank == 0:
            unique_id = bytes(NCCLLibrary().ncclGetUniqueId().internal)
            store.set(UNIQUE_ID_KEY, unique_id)
        else:
            unique_id = store.get(UNIQUE_ID_KEY)  # waits up to the store's timeout
        comm = PyNcclCommunicator.from_unique_id_bytes(unique_id, rank, world_size, device)
        return cls(comm, store, device)

    def broadcast(self, buffer: torch.Tensor) -> _NcclPending:
        # The sender's packing ran on the current stream: the broadcast must see its bytes.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.comm.broadcast(buffer, src=0, stream=self.stream)
        buffer.record_stream(self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        return _NcclPending(event)

    def abort(self) -> None:
        # ncclCommAbort (in a thread, bounded by vLLM): safe with a broadcast still queued.
        self.comm.destroy()


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)


class IpcHandles(Handles):
    """Buffers on this process's GPU, named by CUDA IPC handles sent as JSON fields."""

    name = "ipc"

    def __init__(self, device: torch.device, *, prefix: str = ""):
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC handles need a CUDA device, this process has {device}")
        self.device = device

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, dict[str, Any]]:
        from torch.multiprocessing.reductions import reduce_tensor

        buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        _, args = reduce_tensor(buffer)
        # (cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size,
        #  storage_offset, requires_grad, ref_counter_handle, ref_counter_offset,
        #  event_handle, event_sync_required): the bytes travel base64, nothing pickled.
        handle = {
            "size": list(args[1]),
            "storage_handle": _b64(args[7]),
            "storage_size": int(args[8]),
            "storage_offset": int(args[9]),
            "ref_counter_handle": _b64(args[11]),
            "ref_counter_offset": int(args[12]),
            "event_handle": _b64(args[13]),
            "event_sync_required": bool(args[14]),
        }
        return buffer[:nbytes], handle

    @staticmethod
    def open(handle: dict[str, Any], nbytes: int, device: torch.device) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if device.type != "cuda":
            raise ValueError(f"a CUDA IPC handle cannot be opened on {device}")
        size = [int(n) for n in handle["size"]]
        if size[0] < nbytes:
            raise ValueError(f"IPC buffer has {size[0]} bytes, need {nbytes}")
        return rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(size),
            (1,),
            0,
            torch.storage.UntypedStorage,
            torch.uint8,
            device.index if device.index is not None else torch.cuda.current_device(),
            _bytes(handle["storage_handle"]),
            int(handle["storage_size"]),
            int(handle["storage_offset"]),
            False,
            _bytes(handle["ref_counter_handle"]),
            int(handle["ref_counter_offset"]),
            _bytes(handle["event_handle"]),
            bool(handle["event_sync_required"]),
        )

    @staticmethod
    def key(handle: dict[str, Any]) -> str:
        return str(handle.get("storage_handle"))
