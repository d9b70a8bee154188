"""Shared-memory transport: buckets are packed into POSIX segments the engines map (same host).

Needs the engines started with `--weight-transfer-config '{"backend": "shm"}'` on the trainer's
host (see `vime.weight_sync.vllm_extension`). The trainer creates one segment per bucket in
/dev/shm with mode 0600 (same user only), reserves its pages up front (a full /dev/shm is an
error here, not a SIGBUS mid-copy), packs into its mapping and posts the segment's name with the
bucket description. Each engine maps a segment once and keeps the mapping; once every engine has
acknowledged a segment, the trainer unlinks its name, so nothing is left in /dev/shm if either
side dies: the pages live exactly as long as some process maps them.

Segments are kept and refilled sync after sync: no page is allocated, zeroed or faulted in after
the first sync. Invariant: a segment is refilled only in a later sync than the one that filled
it, never within a sync. Within a sync an engine may still hold views of a bucket it has
acknowledged (layerwise reload keeps a layer's weights until the whole layer has arrived,
possibly from a later bucket), so every bucket of a sync has its own segment; finish_weight_update
releases all views. A segment a sync did not use is dropped by both sides when it ends (a delta
sync has fewer buckets than a full one). After a failed sync, engines may not have let go:
`discard()` (called on any error here, and by the updater when a session fails) drops every
segment, and the next sync starts with fresh ones.

Sending is pipelined: the trainer packs bucket i+1 while the engines load bucket i.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vime.weight_sync.buckets import Bucket
from vime.weight_sync.names import SEGMENT_MODE, SEGMENT_NAME, SEGMENT_PREFIX, SHM_DIR
from vime.weight_sync.transports.base import EngineCall, FillBucket, InFlightCalls, Transport

logger = logging.getLogger(__name__)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink vime's segments in shm_dir that this user owns and whose creator has exited (a
    trainer SIGKILLed mid-sync leaves the names of the buckets no engine acknowledged)."""
    removed = []
    for entry in os.scandir(shm_dir):
        match = SEGMENT_NAME.fullmatch(entry.name)
        if match is None or _alive(int(match["pid"])):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.unlink(entry.path)
            removed.append(entry.name)
        except OSError:
            continue
    if removed:
        logger.info("removed %d stale vime segments from %s: %s", len(removed), shm_dir, removed)
    return removed


@dataclass
class _Segment:
    name: str
    mapping: torch.Tensor  # the trainer's shared, writable mapping of the whole segment
    linked: bool = True  # the name still exists in shm_dir (no engine has acknowledged it yet)


# A bucket of no bytes (a delta's commit) needs no segment; engines map none for it.
_EMPTY = _Segment(name="", mapping=torch.empty(0, dtype=torch.uint8), linked=False)


class ShmTransport(Transport):
    """One reusable shared-memory segment per bucket and one update_weights request per bucket."""

    backend = "shm"

    def __init__(self, *, shm_dir: str = SHM_DIR, prefix: str = "vime", timeout_s: float = 600.0):
        super().__init__(timeout_s=timeout_s)
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir {shm_dir!r} is not a directory")
        if not SEGMENT_PREFIX.fullmatch(prefix):
            raise ValueError(f"shm segment prefix {prefix!r} is not 'vime' or 'vime-pp_K'")
        self.shm_dir = shm_dir
        sweep_stale_segments(shm_dir)
        self.prefix = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._num_segments = 0
        self._segments: dict[int, _Segment] = {}  # bucket index -> its segment

    def connect(self, init_calls: Sequence[EngineCall]) -> list[dict[str, Any]]:
        self.discard()  # engines that (re)join have mapped none of the old segments
        info = {"shm_dir": self.shm_dir}
        InFlightCalls(init_calls, info, "init_weight_transfer_engine").wait(self.timeout_s)
        return [info] * len(init_calls)

    @property
    def num_bytes_held(self) -> int:
        """Bytes of shared memory the kept segments pin (about one model copy)."""
        return sum(segment.mapping.numel() for segment in self._segments.values())

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's segment (created on first use) as a writable view to pack into."""
        return self._segment_for(bucket).mapping[: bucket.nbytes]

    def _segment_for(self, bucket: Bucket) -> _Segment:
        segment = self._segments.get(bucket.index)
        if segment is None or segment.mapping.numel() < bucket.nbytes:
            if segment is not None:
                self._unlink(segment)
            segment = self._create(bucket)
            self._segments[bucket.index] = segment
        return segment

    def _create(self, bucket: Bucket) -> _Segment:
        name = f"{self.prefix}-{self._num_segments}"
        self._num_segments += 1
        path = os.path.join(self.shm_dir, name)
        size = max(bucket.nbytes, 1)  # a mapping cannot be empty
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, SEGMENT_MODE)
        try:
            os.fchmod(fd, SEGMENT_MODE)  # whatever the umask
            try:
                # Reserve every page now: writing past a full tmpfs would SIGBUS the trainer.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                free = os.statvfs(self.shm_dir)
                raise OSError(
                    exc.errno,
                    f"cannot reserve {size} bytes in {self.shm_dir} for bucket {bucket.index} "
                    f"({free.f_bavail * free.f_frsize} bytes free; the shm transport keeps "
                    f"about one model copy there): enlarge {self.shm_dir} or use "
                    "weight_sync.transport=gloo",
                ) from exc
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        mapping = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return _Segment(name, mapping)

    def _segment_of(self, bucket: Bucket, buffer: torch.Tensor) -> _Segment:
        segment = self._segments.get(bucket.index)
        if segment is None or buffer.data_ptr() != segment.mapping.data_ptr():
            raise ValueError(
                f"bucket {bucket.index}: the buffer is not this transport's segment for it; "
                f"pack into buffer_for(bucket) and send that exact tensor"
            )
        if buffer.numel() < bucket.nbytes:
            raise ValueError(
                f"bucket {bucket.index} needs {bucket.nbytes} bytes, buffer has {buffer.numel()}"
            )
        return segment

    def _post(
        self, bucket: Bucket, segment: _Segment, update_calls: Sequence[EngineCall]
    ) -> tuple[dict[str, Any], InFlightCalls]:
        update_info = {"buckets": [{**bucket.to_dict(), "shm_name": segment.name}]}
        return update_info, InFlightCalls(update_calls, update_info, "update_weights")

    def _acknowledged(self, segment: _Segment, in_flight: InFlightCalls) -> None:
        in_flight.wait(self.timeout_s)
        self._unlink(segment)  # every engine has it mapped now; the name is no longer needed

    def send_bucket(
        self, bucket: Bucket, buffer: torch.Tensor, update_calls: Sequence[EngineCall]
    ) -> dict[str, Any]:
        segment = self._segment_of(bucket, buffer)
        try:
            update_info, in_flight = self._post(bucket, segment, update_calls)
            self._acknowledged(segment, in_flight)
        except BaseException:
            self.discard()
            raise
        return update_info

    def send_buckets(
        self, buckets: Sequence[Bucket], fill: FillBucket, update_calls: Sequence[EngineCall]
    ) -> list[dict[str, Any]]:
        """One request per bucket; bucket i+1 is packed while the engines load bucket i."""
        infos: list[dict[str, Any]] = []
        previous: tuple[_Segment, InFlightCalls] | None = None
        try:
            for bucket in buckets:
                segment = self._segment_for(bucket) if bucket.nbytes else _EMPTY
                fill(bucket, segment.mapping[: bucket.nbytes])
                if previous is not None:
                    self._acknowledged(*previous)
                    previous = None
                update_info, in_flight = self._post(bucket, segment, update_calls)
                previous = (segment, in_flight)
                infos.append(update_info)
            if previous is not None:
                self._acknowledged(*previous)
        except BaseException:
            if previous is not None:
                previous[1].abandon()
            self.discard()
            raise
        # Mirror of the engines' rule: a segment this sync did not use is dropped at its end
        # (they unmap it at finish), so a later sync with more buckets (a full one after a
        # delta) makes new segments instead of refilling ones the engines let go.
        used = {bucket.index for bucket in buckets if bucket.nbytes}
        for index in set(self._segments) - used:
            self._unlink(self._segments.pop(index))
        return infos

    def _unlink(self, segment: _Segment) -> None:
        """Remove the segment's name (if still there); mappings keep its pages alive."""
        if segment.linked:
            try:
                os.unlink(os.path.join(self.shm_dir, segment.name))
            except FileNotFoundError:
                pass
            segment.linked = False

    def discard(self) -> None:
        """Drop every segment (unlink the names still linked); the next sync makes new ones.

        Engines that still map a dropped segment keep its pages until they let go of it.
        """
        for segment in self._segments.values():
            self._unlink(segment)
        self._segments.clear()

    def close(self) -> None:
        self.discard()
