"""Shared-memory transport: each bucket is packed straight into a fresh POSIX segment (same host).

Needs the engines started with `--weight-transfer-config '{"backend": "shm"}'` on the trainer's
host (see `vime.weight_sync.vllm_extension`). The trainer creates /dev/shm/NAME with mode 0600
(same user only), packs into its mapping, posts the segment's name with the bucket description,
and unlinks the segment once every engine's update_weights call has returned.

Invariant: a segment is written once and never reused. After the ack an engine may still hold
views of it (layerwise reload keeps a layer's weights until the whole layer has arrived, possibly
from a later bucket), so refilling it would corrupt weights already "delivered". Unlinking is safe:
the engine's mapping keeps the pages alive until it drops them.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from vime.weight_sync.buckets import Bucket
from vime.weight_sync.transports.base import EngineCall, InFlightCalls, Transport

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_MODE = 0o600


class ShmTransport(Transport):
    """One new shared-memory segment and one update_weights request per bucket."""

    backend = "shm"

    def __init__(self, *, shm_dir: str = SHM_DIR, prefix: str = "vime", timeout_s: float = 600.0):
        super().__init__(timeout_s=timeout_s)
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir {shm_dir!r} is not a directory")
        self.shm_dir = shm_dir
        self.prefix = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._num_segments = 0
        self._pending: dict[int, str] = {}  # buffer data_ptr -> segment name, created not sent

    def connect(self, init_calls: Sequence[EngineCall]) -> list[dict[str, Any]]:
        info = {"shm_dir": self.shm_dir}
        InFlightCalls(init_calls, info, "init_weight_transfer_engine").wait(self.timeout_s)
        return [info] * len(init_calls)

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        """A new segment's mapping, to pack into; `send_bucket` posts it and then unlinks it."""
        name = f"{self.prefix}-{self._num_segments}"
        self._num_segments += 1
        path = os.path.join(self.shm_dir, name)
        size = max(bucket.nbytes, 1)  # a mapping cannot be empty
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, SEGMENT_MODE)
        try:
            os.fchmod(fd, SEGMENT_MODE)  # whatever the umask
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        mapping = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self._pending[mapping.data_ptr()] = name
        return mapping[: bucket.nbytes]

    def send_bucket(
        self, bucket: Bucket, buffer: torch.Tensor, update_calls: Sequence[EngineCall]
    ) -> dict[str, Any]:
        name = self._pending.pop(buffer.data_ptr(), None)
        if name is None:
            raise ValueError(
                f"bucket {bucket.index}: the buffer is not a pending segment of this transport; "
                f"pack into buffer_for(bucket) and send that exact tensor once"
            )
        try:
            if buffer.numel() < bucket.nbytes:
                raise ValueError(
                    f"bucket {bucket.index} needs {bucket.nbytes} bytes, buffer has "
                    f"{buffer.numel()}"
                )
            update_info = {"buckets": [{**bucket.to_dict(), "shm_name": name}]}
            InFlightCalls(update_calls, update_info, "update_weights").wait(self.timeout_s)
        finally:
            # Acknowledged (or failed): nobody will open the segment again. Engines that mapped
            # it keep their pages until they drop their views.
            os.unlink(os.path.join(self.shm_dir, name))
        return update_info

    def close(self) -> None:
        """Unlink segments handed out by buffer_for but never sent."""
        for name in self._pending.values():
            os.unlink(os.path.join(self.shm_dir, name))
        self._pending.clear()
