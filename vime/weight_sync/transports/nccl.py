"""NCCL transport: trainer rank 0 broadcasts each bucket to vLLM's own NCCL engine (CUDA only).

Needs the engines started with `--weight-transfer-config '{"backend": "nccl"}'` (vLLM 0.32's
`NCCLWeightTransferEngine`, packed mode). That engine reads a dense concatenation and cuts its
chunks itself: it appends tensors until their total exceeds `packed_buffer_size_bytes`. This
transport sets that size to `max_bucket_bytes` and sends exactly the tensors of one bucket per
update_weights call, so each bucket arrives as one broadcast on both sides. Plan with the same
cap: `plan_buckets(..., max_bucket_bytes, alignment=NcclTransport.alignment)` (1: dense).

Rank layout as vLLM's: trainer rank 0, engine e's workers from `1 + sum(engine_world_sizes[:e])`.
Importable without CUDA; connect() needs a GPU and vLLM's pynccl.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from vime.weight_sync.buckets import Bucket
from vime.weight_sync.transports.base import (
    EngineCall,
    InFlightCalls,
    Transport,
    check_engine_world_sizes,
)

logger = logging.getLogger(__name__)

PACKED_NUM_BUFFERS = 2  # vLLM's default; only the engine's stream rotation depends on it


class NcclTransport(Transport):
    """Rank 0 of vLLM's trainer<->worker NCCL group; one packed broadcast per bucket."""

    backend = "nccl"
    alignment = 1

    def __init__(
        self,
        *,
        engine_world_sizes: Sequence[int],
        master_address: str,
        master_port: int,
        max_bucket_bytes: int,
        timeout_s: float = 600.0,
    ):
        """`master_port` must be free on this host: rank 0 serves vLLM's StatelessProcessGroup."""
        super().__init__(timeout_s=timeout_s)
        if max_bucket_bytes <= 0:
            raise ValueError(f"max_bucket_bytes must be positive, got {max_bucket_bytes}")
        self.engine_world_sizes = check_engine_world_sizes(engine_world_sizes)
        self.world_size = 1 + sum(self.engine_world_sizes)
        self.master_address = master_address
        self.master_port = master_port
        self.max_bucket_bytes = max_bucket_bytes
        self._communicator: Any = None
        self._buffer: torch.Tensor | None = None

    def init_infos(self) -> list[dict[str, Any]]:
        """Each engine's init_info (vLLM's NCCLWeightTransferInitInfo fields)."""
        infos = []
        rank_offset = 1
        for size in self.engine_world_sizes:
            infos.append(
                {
                    "master_address": self.master_address,
                    "master_port": self.master_port,
                    "rank_offset": rank_offset,
                    "world_size": self.world_size,
                    "packed": True,
                    "packed_buffer_size_bytes": self.max_bucket_bytes,
                    "packed_num_buffers": PACKED_NUM_BUFFERS,
                }
            )
            rank_offset += size
        return infos

    @staticmethod
    def update_info(bucket: Bucket) -> dict[str, Any]:
        """The update_info for one bucket (vLLM's NCCLWeightTransferUpdateInfo fields)."""
        described = bucket.to_dict()
        return {k: described[k] for k in ("names", "dtype_names", "shapes")}

    def connect(self, init_calls: Sequence[EngineCall]) -> list[dict[str, Any]]:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        if len(init_calls) != len(self.engine_world_sizes):
            raise ValueError(
                f"{len(init_calls)} init calls for {len(self.engine_world_sizes)} engines"
            )
        infos = self.init_infos()
        in_flight = [
            InFlightCalls([call], info, f"init_weight_transfer_engine (engine {i})")
            for i, (call, info) in enumerate(zip(init_calls, infos, strict=True))
        ]
        try:
            self._communicator = trainer_init(
                {
                    "master_address": self.master_address,
                    "master_port": self.master_port,
                    "world_size": self.world_size,
                }
            )
        except BaseException:
            for calls in in_flight:
                calls.abandon()
            raise
        for calls in in_flight:
            calls.wait(self.timeout_s)
        return infos

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        # Reused: send_bucket returns after the broadcast has completed on the GPU and every
        # engine acknowledged; the engines received into buffers of their own.
        if self._buffer is None or self._buffer.numel() < bucket.nbytes:
            self._buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device="cuda")
        return self._buffer[: bucket.nbytes]

    def send_bucket(
        self, bucket: Bucket, buffer: torch.Tensor, update_calls: Sequence[EngineCall]
    ) -> dict[str, Any]:
        if self._communicator is None:
            raise RuntimeError("NcclTransport is not connected: call connect() first")
        if not bucket.is_dense():
            raise ValueError(
                f"bucket {bucket.index} has padding; vLLM's NCCL engine reads dense buckets: "
                f"plan with alignment={self.alignment}"
            )
        if bucket.nbytes > self.max_bucket_bytes and len(bucket.tensors) > 1:
            raise ValueError(
                f"bucket {bucket.index} holds {bucket.nbytes} bytes in {len(bucket.tensors)} "
                f"tensors, over max_bucket_bytes={self.max_bucket_bytes}: the engine would cut it "
                f"differently. Plan with the transport's max_bucket_bytes."
            )
        update_info = self.update_info(bucket)
        in_flight = InFlightCalls(update_calls, update_info, "update_weights")
        try:
            in_flight.raise_if_failed()
            stream = torch.cuda.current_stream()
            self._communicator.broadcast(buffer[: bucket.nbytes], src=0, stream=stream)
            done = torch.cuda.Event()
            done.record(stream)
            # A raw NCCL broadcast cannot be interrupted; poll so the control side can time out.
            deadline = time.monotonic() + self.timeout_s
            while not done.query():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"NCCL broadcast of bucket {bucket.index} did not finish within "
                        f"{self.timeout_s:g} s; the group is unusable, rebuild it"
                    )
                time.sleep(0.001)
        except BaseException:
            in_flight.abandon()
            raise
        in_flight.wait(self.timeout_s)
        return update_info

    def close(self) -> None:
        if self._communicator is not None:
            self._communicator.destroy()
            self._communicator = None
        self._buffer = None
