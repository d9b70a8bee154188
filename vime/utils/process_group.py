"""A process group's members, the /dev/shm files they map, and ending all of it (the keeper's
work, vime.utils.keeper; tests read the same to check that nothing outlived a job)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable

SHM_DIR = "/dev/shm"


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, read from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command: state, ppid, pgrp, ...
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def mapped_shm_files(pids: list[int], shm_dir: str = SHM_DIR) -> set[str]:
    """Paths under shm_dir of the files these processes map, found by inode: a mapping's path can
    be a deleted name of a file that is still linked under another. glibc's sem_open (Python's
    named semaphores, `sem.mp-*`) creates a semaphore under a temporary name, maps it, links it to
    its real name and unlinks the temporary one, so /proc/PID/maps shows "sem.XXXXXX (deleted)"
    for a file that lives on as sem.mp-...; a mapped inode cannot be reused, so the match is
    exact."""
    prefix = shm_dir.rstrip("/") + "/"
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(prefix):
                inodes.add(int(parts[4]))
    if not inodes:
        return set()
    paths: set[str] = set()
    with os.scandir(shm_dir) as entries:
        for entry in entries:
            try:
                if entry.inode() in inodes and entry.is_file(follow_symlinks=False):
                    paths.add(entry.path)
            except OSError:
                continue
    return paths


def unlink_owned(paths: set[str]) -> list[str]:
    """Unlink those of `paths` this user owns; return the ones removed."""
    removed = []
    for path in sorted(paths):
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


def end_group(
    pgid: int,
    grace_s: float,
    reap: Callable[[], object] = lambda: None,
    seen_segments: Iterable[str] = (),
) -> list[str]:
    """SIGTERM every process of group `pgid` but this one, SIGKILL what is left after grace_s,
    then unlink the /dev/shm files they map, and `seen_segments` (mapped earlier by members
    that are gone now). Returns the unlinked paths."""
    me = os.getpid()

    def others() -> list[int]:
        reap()
        return [pid for pid in group_members(pgid) if pid != me]

    segments = set(seen_segments) | mapped_shm_files(others())

    def signal_and_wait(
        sig: int, pids: Callable[[], list[int]], wait_s: float, until: Callable[[], list[int]]
    ) -> None:
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while until() and time.monotonic() < deadline:
            segments.update(mapped_shm_files(others()))  # segments made during shutdown
            time.sleep(0.05)

    def trackers() -> list[int]:
        return [pid for pid in others() if _is_resource_tracker(pid)]

    def served() -> list[int]:
        return [pid for pid in others() if not _is_resource_tracker(pid)]

    # Python's resource tracker ignores SIGTERM and, once every process it serves is gone,
    # unlinks the semaphores and segments they registered and exits: it is waited for, and
    # SIGKILLed, last.
    signal_and_wait(signal.SIGTERM, others, grace_s, until=served)
    signal_and_wait(signal.SIGKILL, served, 5.0, until=served)
    signal_and_wait(signal.SIGCONT, trackers, 3.0, until=trackers)
    signal_and_wait(signal.SIGKILL, others, 5.0, until=others)
    return unlink_owned(segments)


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"multiprocessing.resource_tracker" in cmdline.read()
    except OSError:
        return False
