"""The `vime_colocated` engine backend: each bucket arrives as a handle to a buffer a trainer rank
on this worker's device filled; the worker opens it (a shared-memory segment, a CUDA IPC handle:
the `Handles` plug-in the trainer names at init), keeps it open for later syncs, and loads from
views of it without copying it first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from vime.weight_sync.buckets import buffers_to_drop, unpack
from vime.weight_sync.devices import Handles, device_id, handles_class
from vime.weight_sync.engine.base import BucketEngine, parse_buckets


@dataclass
class ColocatedInitInfo(WeightTransferInitInfo):
    """Which handle plug-in the trainer's buffers come with: "shm" or "ipc"."""

    handles: str = "shm"
    shadow: bool = False  # weight_sync.shadow: load beside the served weights (engine.shadow)
    timeout_s: float = 600.0  # the longest a commit waits for such a load


@dataclass
class ColocatedUpdateInfo(WeightTransferUpdateInfo):
    """Buckets (Bucket.to_dict), each with "handles": {device id: handle} of its buffers."""

    buckets: list[dict[str, Any]]

    def __post_init__(self) -> None:
        self.parsed = parse_buckets(self.buckets)
        self.handles: list[dict[str, Any]] = []
        for bucket in self.buckets:
            handles = bucket.get("handles")
            if not isinstance(handles, dict):
                raise ValueError(f"bucket {bucket.get('index')}: 'handles' must be a mapping")
            self.handles.append(handles)


class ColocatedWeightTransferEngine(BucketEngine):
    """Loads buckets straight from the trainer's buffers on this worker's device.

    A buffer is opened once and kept: the trainer refills the same buffers sync after sync, so
    later syncs find them here by their handle. Buffers a sync did not use are let go when it
    finishes (the trainer made new ones; an update that read none keeps them all), and all of
    them on a new init_transfer_engine or after a failed update.
    """

    init_info_cls = ColocatedInitInfo
    update_info_cls = ColocatedUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handles: type[Handles] | None = None
        self._opened: dict[str, torch.Tensor] = {}  # handle key -> the whole buffer
        self._used: set[str] = set()  # handle keys this sync read
        self._unused_syncs: dict[str, int] = {}  # handle key -> syncs in a row without it

    @property
    def device_id(self) -> str:
        return device_id(torch.device(self.device), self.parallel_config.rank)

    def init_transfer_engine(self, init_info: ColocatedInitInfo) -> None:
        handles = handles_class(init_info.handles)
        if handles.name == "ipc" and torch.device(self.device).type != "cuda":
            raise ValueError(
                f"weight_sync.transport ipc sends CUDA IPC handles; this worker runs on "
                f"{self.device}: use shm on CPU (or ipc with device: cpu)"
            )
        self.set_shadow_mode(init_info.shadow, init_info.timeout_s)
        self._handles = handles
        self._opened.clear()
        self._unused_syncs.clear()

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self._used = set()

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        if self._used:  # none read: a live engine's peer copy, a delta with nothing changed
            # The trainer's rule, counting only syncs that read a buffer: never sooner than the
            # trainer drops it.
            for key in buffers_to_drop(self._opened, self._used, self._unused_syncs):
                del self._opened[key]
        if self.stats:  # the buffers this worker keeps mapped for the next sync
            self.stats["buffers_kept"] = len(self._opened)
            self.stats["buffer_bytes_kept"] = sum(b.numel() for b in self._opened.values())

    def _open(self, handles: dict[str, Any], nbytes: int) -> torch.Tensor:
        if self._handles is None:
            raise RuntimeError("call init_weight_transfer_engine before update_weights")
        mine = self.device_id
        handle = handles.get(mine)
        if not isinstance(handle, dict):
            raise ValueError(
                f"no buffer on this worker's device {mine} (the update has {sorted(handles)}): "
                "every engine worker needs a trainer rank on its own device"
            )
        key = self._handles.key(handle)
        buffer = self._opened.get(key)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._handles.open(handle, nbytes, torch.device(self.device))
            if buffer.numel() < nbytes:
                raise ValueError(f"buffer {key} has {buffer.numel()} bytes, need {nbytes}")
            self._opened[key] = buffer
        self._used.add(key)
        return buffer[:nbytes]

    def receive_weights(self, update_info: ColocatedUpdateInfo) -> None:
        try:
            for bucket, handles in zip(update_info.parsed, update_info.handles, strict=True):
                began = time.perf_counter()
                if bucket.nbytes == 0:
                    view = torch.empty(0, dtype=torch.uint8, device=self.device)
                else:
                    view = self._open(handles, bucket.nbytes)
                self._count("receive", began)
                self._receive(bucket, unpack(view, bucket))
        except BaseException:
            self._opened.clear()
            self._unused_syncs.clear()
            raise

    def shutdown(self) -> None:
        self._opened.clear()
        self._unused_syncs.clear()
