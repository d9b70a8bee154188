"""CUDA IPC transport: engines on the trainer's GPU read each bucket from its memory (CUDA only).

Needs the engines started with `--weight-transfer-config '{"backend": "ipc"}'` (vLLM 0.32's
`IPCWeightTransferEngine`) and, since handles travel pickled over HTTP, the server env
`VLLM_ALLOW_INSECURE_SERIALIZATION=1`. The engine's packed consumer reads a dense bucket
(`alignment = 1`) and clones each tensor out of it before update_weights returns.

Single trainer process and GPU: handles are keyed by this GPU's UUID, so the engine worker must
sit on the same physical GPU. Importable without CUDA.
"""

from __future__ import annotations

import base64
import logging
import pickle
from collections.abc import Sequence
from typing import Any

import torch

from vime.weight_sync.buckets import Bucket
from vime.weight_sync.transports.base import EngineCall, InFlightCalls, Transport

logger = logging.getLogger(__name__)


class IpcTransport(Transport):
    """One staging buffer on this GPU, exported afresh for each bucket."""

    backend = "ipc"
    alignment = 1

    def __init__(self, *, timeout_s: float = 600.0):
        super().__init__(timeout_s=timeout_s)
        self._buffer: torch.Tensor | None = None

    def connect(self, init_calls: Sequence[EngineCall]) -> list[dict[str, Any]]:
        info = {"packed": True}
        InFlightCalls(init_calls, info, "init_weight_transfer_engine").wait(self.timeout_s)
        return [info] * len(init_calls)

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        # Reused across buckets: send_bucket returns only after every engine answered, and vLLM's
        # packed IPC consumer clones each tensor out of the buffer before it answers. Without
        # that ack, refilling would overwrite bytes an engine is still copying.
        if self._buffer is None or self._buffer.numel() < bucket.nbytes:
            self._buffer = torch.empty(max(bucket.nbytes, 1), dtype=torch.uint8, device="cuda")
        return self._buffer[: bucket.nbytes]

    @staticmethod
    def update_info(bucket: Bucket, ipc_handle: dict[str, tuple]) -> dict[str, Any]:
        """vLLM's IPCWeightTransferUpdateInfo fields, handles pickled for JSON transport."""
        described = bucket.to_dict()
        return {
            "names": described["names"],
            "dtype_names": described["dtype_names"],
            "shapes": described["shapes"],
            "tensor_sizes": [t.nbytes for t in bucket.tensors],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(ipc_handle)).decode("ascii"),
        }

    def send_bucket(
        self, bucket: Bucket, buffer: torch.Tensor, update_calls: Sequence[EngineCall]
    ) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        if not bucket.is_dense():
            raise ValueError(
                f"bucket {bucket.index} has padding; vLLM's IPC engine reads dense buckets: "
                f"plan with alignment={self.alignment}"
            )
        if buffer.device.type != "cuda" or buffer.dtype != torch.uint8:
            raise ValueError(
                f"IPC sends a CUDA uint8 buffer; got {buffer.dtype} on {buffer.device}"
            )
        torch.cuda.current_stream(buffer.device).synchronize()  # packing copies have landed
        # One export per bucket pairs with the engine's one import/release per handle.
        _, ipc_args = reduce_tensor(buffer)
        gpu_uuid = str(torch.cuda.get_device_properties(buffer.device).uuid)
        update_info = self.update_info(bucket, {gpu_uuid: ipc_args})
        InFlightCalls(update_calls, update_info, "update_weights").wait(self.timeout_s)
        return update_info

    def close(self) -> None:
        self._buffer = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()


def check_ipc_placement(
    sender_gpus: Sequence[str], worker_gpus: Sequence[str | None], engine: int
) -> None:
    """ValueError unless every worker of `engine` sits on the GPU of every stage's sender.

    Each stage's one sender exports its staging buffer on its own GPU and keys the handle by that
    GPU's UUID; vLLM's IPC consumer opens only the handle of its worker's GPU, so a worker
    elsewhere would fail in the middle of a sync. (Several GPUs need every colocated rank to hold
    and export each bucket, as vLLM's IPC trainer engine does: not in vime.)
    """
    if not sender_gpus:
        raise ValueError("weight_sync.transport ipc needs the trainer's senders on a GPU")
    for worker, gpu in enumerate(worker_gpus):
        if gpu is None:
            raise ValueError(
                f"engine {engine} worker {worker} runs on the CPU: weight_sync.transport ipc "
                "needs engines on the trainer's GPU (use shm on CPU)"
            )
        away = sorted({s for s in sender_gpus if s != gpu})
        if away:
            raise ValueError(
                f"engine {engine} worker {worker} is on GPU {gpu}, the sender of a pipeline "
                f"stage on {away[0]}: vime's ipc transport sends each stage from one GPU and "
                "reaches only engine workers on that GPU; use transport nccl, or put the "
                "engines and every stage's sender on one GPU"
            )
