"""The `shm` engine backend: the trainer writes each bucket into a POSIX shared-memory segment;
the worker maps it read-only, keeps the mapping for later syncs, and loads from it without
copying it first. Only vime's segments of this user, mode 0600, in /dev/shm are mapped.
"""

from __future__ import annotations

import mmap
import os
import stat
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from vime.weight_sync.buckets import unpack
from vime.weight_sync.engine.base import BucketEngine, parse_buckets
from vime.weight_sync.names import SHM_DIR, check_segment_name


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous; the directory the trainer creates segments in."""

    shm_dir: str = SHM_DIR


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """Buckets (Bucket.to_dict) each with an extra "shm_name": the segment holding its bytes."""

    buckets: list[dict[str, Any]]

    def __post_init__(self) -> None:
        self.parsed = parse_buckets(self.buckets)
        self.shm_names: list[str] = []
        for bucket, parsed in zip(self.buckets, self.parsed, strict=True):
            name = bucket.get("shm_name")
            if parsed.nbytes == 0 and name == "":  # no bytes, no segment (a delta's commit)
                self.shm_names.append("")
                continue
            check_segment_name(name if isinstance(name, str) else repr(name))
            self.shm_names.append(str(name))


def _check_private(path: str, info: os.stat_result) -> None:
    """A segment is mapped only if it is a regular file of this user that no one else can write."""
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"shm segment {path} is not a private regular file of uid {os.getuid()} (uid "
            f"{info.st_uid}, mode {stat.filemode(info.st_mode)}): vime's segments are 0600"
        )


class ShmWeightTransferEngine(BucketEngine):
    """Loads buckets straight from the trainer's POSIX shared-memory segments (same host).

    Each segment is mapped once (shared, read-only, page tables populated up front) and the
    mapping is kept: the trainer refills the same segments sync after sync and unlinks their names
    once acknowledged, so later syncs find them here by name. Mappings a sync did not use are
    dropped when it finishes (the trainer made new segments; an update that read no segment
    keeps them all), and all of them on a new init_transfer_engine or after a failed update.
    """

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shm_dir = SHM_DIR
        self._mappings: dict[str, torch.Tensor] = {}  # segment name -> read-only mapping
        self._used: set[str] = set()  # segment names this sync read

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        # Whoever reaches the route chooses shm_dir and the names: only vime's own segments in
        # /dev/shm, owned by this user and private to it, are ever mapped into the weights.
        if os.path.realpath(init_info.shm_dir) != SHM_DIR:
            raise ValueError(
                f"shm_dir {init_info.shm_dir!r} is not {SHM_DIR}: the shm backend maps vime's "
                f"segments from {SHM_DIR} only"
            )
        self._shm_dir = SHM_DIR
        self._mappings.clear()

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self._used = set()

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        if not self._used:
            return  # no segment read (a live engine's seed, a delta with nothing changed)
        for name in set(self._mappings) - self._used:
            del self._mappings[name]

    def _mapping(self, name: str, nbytes: int) -> torch.Tensor:
        mapping = self._mappings.get(name)
        if mapping is None or mapping.numel() < nbytes:
            check_segment_name(name)
            path = os.path.join(self._shm_dir, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    _check_private(path, os.fstat(fd))
                    buffer = mmap.mmap(
                        fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
                    )
                finally:
                    os.close(fd)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"shm segment {path} does not exist and is not mapped by this worker (a "
                    "restarted engine?): the trainer makes new segments after a failed sync"
                ) from None
            if len(buffer) < nbytes:
                raise ValueError(f"shm segment {path} has {len(buffer)} bytes, need {nbytes}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only buffer: nothing here writes to it
                mapping = torch.frombuffer(buffer, dtype=torch.uint8)
            self._mappings[name] = mapping
        self._used.add(name)
        return mapping[:nbytes]

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        try:
            for bucket, name in zip(update_info.parsed, update_info.shm_names, strict=True):
                began = time.perf_counter()
                if bucket.nbytes == 0:
                    view = torch.empty(0, dtype=torch.uint8)
                else:
                    view = self._mapping(name, bucket.nbytes)
                self._count("receive", began)
                self._receive(bucket, unpack(view, bucket))
        except BaseException:
            self._mappings.clear()
            raise

    def shutdown(self) -> None:
        self._mappings.clear()
