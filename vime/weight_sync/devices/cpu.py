"""The CPU plug-ins: a gloo broadcast group (distributed shape) and POSIX shared-memory segments
(colocated shape).

Segments: the trainer creates each in /dev/shm with mode 0600 (same user only), reserves its
pages up front (a full /dev/shm is an error here, not a SIGBUS mid-copy) and unlinks its name once
every engine has mapped it, so nothing is left in /dev/shm if either side dies: the pages live
exactly as long as some process maps them. An engine maps only vime's segments of its own user,
private to it, from /dev/shm; never anything a request names elsewhere.
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import stat
import threading
import uuid
import warnings
from typing import Any, Self

import torch
import torch.distributed as dist

from vime.utils.rendezvous import gloo_group
from vime.weight_sync.devices.base import Communicator, Handles
from vime.weight_sync.names import (
    SEGMENT_MODE,
    SEGMENT_NAME,
    SEGMENT_PREFIX,
    SHM_DIR,
    check_segment_name,
)

logger = logging.getLogger(__name__)


class _GlooPending:
    def __init__(self, work: Any):
        self.work = work

    def done(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self, timeout_s: float) -> None:
        self.work.wait(datetime.timedelta(seconds=timeout_s))  # raises the broadcast's error


class GlooCommunicator(Communicator):
    """A ProcessGroupGloo of its own (never a default group); CPU buffers, TCP between hosts."""

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup, store: dist.Store):
        super().__init__(torch.device("cpu"))
        self.group = group
        self.store = store  # must outlive its group
        self._posted: list[Any] = []  # broadcasts not yet seen completed

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
        if device.type != "cpu":
            raise ValueError(f"the gloo communicator sends CPU buffers, not {device}")
        group = gloo_group(
            store, rank=rank, world_size=world_size, timeout_s=timeout_s, address=address
        )
        return cls(group, store)

    def broadcast(self, buffer: torch.Tensor) -> _GlooPending:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self.group.broadcast([buffer], options)
        self._posted = [w for w in self._posted if not w.is_completed()] + [work]
        return _GlooPending(work)

    def abort(self) -> None:
        doomed: list[Any] = [self.group, self.store, *self._posted]
        self._posted = []
        del self.group, self.store
        # A broadcast no peer will join keeps the group's destructor waiting for gloo's own
        # timeout (abort/shutdown do not cut it short): let that happen off the caller's path.
        threading.Thread(target=doomed.clear, daemon=True).start()

    def close(self) -> None:
        if any(not w.is_completed() for w in self._posted):
            self.abort()
            return
        self._posted = []
        del self.group, self.store


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


def _check_private(path: str, info: os.stat_result) -> None:
    """A segment is mapped only if it is a regular file of this user that no one else can write."""
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"shm segment {path} is not a private regular file of uid {os.getuid()} (uid "
            f"{info.st_uid}, mode {stat.filemode(info.st_mode)}): vime's segments are 0600"
        )


class ShmHandles(Handles):
    """POSIX shared-memory segments in /dev/shm; the handle is {"shm_name": name}."""

    name = "shm"

    def __init__(
        self, device: torch.device | None = None, *, prefix: str = "vime", shm_dir: str = SHM_DIR
    ):
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir {shm_dir!r} is not a directory")
        if not SEGMENT_PREFIX.fullmatch(prefix):
            raise ValueError(f"shm segment prefix {prefix!r} is not 'vime' or 'vime-pp_K'")
        self.shm_dir = shm_dir
        sweep_stale_segments(shm_dir)
        self.prefix = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._num_segments = 0
        self._linked: set[str] = set()  # names still in shm_dir

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, dict[str, Any]]:
        name = f"{self.prefix}-{self._num_segments}"
        self._num_segments += 1
        path = os.path.join(self.shm_dir, name)
        size = max(nbytes, 1)  # a mapping cannot be empty
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, SEGMENT_MODE)
        try:
            os.fchmod(fd, SEGMENT_MODE)  # whatever the umask
            try:
                # Reserve every page now: writing past a full tmpfs would SIGBUS the trainer.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                stats = os.statvfs(self.shm_dir)
                free = stats.f_bavail * stats.f_frsize
                raise OSError(
                    exc.errno,
                    f"cannot reserve {size} bytes in {self.shm_dir} ({free}"
                    " bytes free; the shm transport keeps about one copy of the weights there): "
                    "enlarge it or use weight_sync.transport=gloo",
                ) from exc
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self._linked.add(name)
        mapping = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return mapping[:nbytes], {"shm_name": name}

    def release(self, handle: dict[str, Any]) -> None:
        """Remove the segment's name (if still there); mappings keep its pages alive."""
        name = handle["shm_name"]
        if name in self._linked:
            self._linked.discard(name)
            try:
                os.unlink(os.path.join(self.shm_dir, name))
            except FileNotFoundError:
                pass

    forget = release

    @staticmethod
    def open(handle: dict[str, Any], nbytes: int, device: torch.device) -> torch.Tensor:
        name = handle.get("shm_name")
        check_segment_name(name if isinstance(name, str) else repr(name))
        path = os.path.join(SHM_DIR, str(name))
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
            return torch.frombuffer(buffer, dtype=torch.uint8)

    @staticmethod
    def key(handle: dict[str, Any]) -> str:
        return str(handle.get("shm_name"))
