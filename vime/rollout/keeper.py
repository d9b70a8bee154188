"""The keeper: a small process that leads an engine's process group and ends all of it.

    python -m vime.rollout.keeper [--grace-s S] -- python -m vllm.entrypoints.openai.api_server ...

`launch_server` starts the keeper in a new session; the keeper starts the vLLM server as its child
in the same process group and watches, every POLL_S:
- its owner (the process that launched it: a Ray engine actor, a test, a trainer rank). When the
  owner dies, however it died, the keeper is re-parented, and ends the group;
- the server. When the api_server dies, vLLM leaves its EngineCore, workers and resource tracker
  running; the keeper ends them.
- SIGTERM / SIGINT / SIGHUP: end the group (what `ServerProcess.stop` sends).

Ending the group: note the /dev/shm files its processes map (vLLM's `psm_*` message queues,
`vllm_dist_*` TP communicators, `sem.mp-*`), SIGTERM them, SIGKILL what is left after the grace,
then unlink those files: a SIGKILLed vLLM never unlinks its own segments.

The keeper is a child subreaper, so processes orphaned inside the group (EngineCore after its
api_server died) are re-parented to it and reaped here, never to init.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

POLL_S = 0.2
SEGMENT_SCAN_EVERY = 5  # polls: the group's mapped /dev/shm files are noted once a second
SHM_DIR = "/dev/shm"
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1


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
    """Paths under shm_dir that these processes map and that still exist (linked)."""
    prefix = shm_dir.rstrip("/") + "/"
    paths: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.read().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(prefix) and "(deleted)" not in parts[5]:
                paths.add(parts[5])
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
    reap: Callable[[], None] = lambda: None,
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
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in others():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while others() and time.monotonic() < deadline:
            segments |= mapped_shm_files(others())  # segments made during shutdown
            time.sleep(0.05)
    return unlink_owned(segments)


def spawn_kept(
    cmd: list[str], *, env: dict[str, str] | None = None, log_file: Any = None, grace_s: float = 5.0
) -> subprocess.Popen:
    """Start `cmd` under a keeper owned by this process, in a new session and process group;
    stdout and stderr of both go to `log_file`. The returned process is the keeper."""
    keeper = [sys.executable, "-m", "vime.rollout.keeper", "--owner", str(os.getpid())]
    return subprocess.Popen(
        [*keeper, "--grace-s", str(grace_s), "--", *cmd],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT if log_file is not None else None,
        start_new_session=True,
    )


def _reap_children() -> None:
    """Reap every exited child (the server, and orphans re-parented to this subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def _kill_with_keeper() -> None:
    """In the server (before exec): die with the keeper if the keeper is SIGKILLed."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def run(cmd: list[str], grace_s: float, owner: int | None = None) -> int:
    """Run `cmd` and watch it and `owner` (default: the parent); the exit code says why."""
    owner = owner if owner is not None else os.getppid()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    server = subprocess.Popen(cmd, preexec_fn=_kill_with_keeper)
    print(f"vime keeper {os.getpid()}: server pid {server.pid}, owner pid {owner}", flush=True)
    code = 0
    seen_segments: set[str] = set()
    polls = 0
    while True:
        if polls % SEGMENT_SCAN_EVERY == 0:
            # Segments of members that die later (a SIGKILLed api_server) stay known.
            seen_segments |= mapped_shm_files(group_members(os.getpgrp()))
        polls += 1
        if stop_signal:
            reason = f"signal {signal.Signals(stop_signal[0]).name}"
            break
        if os.getppid() != owner:
            reason, code = f"owner pid {owner} exited", 1
            break
        if server.poll() is not None:
            reason, code = f"server exited with code {server.returncode}", server.returncode or 1
            break
        time.sleep(POLL_S)
    began = time.monotonic()
    print(f"vime keeper {os.getpid()}: {reason}; ending process group", flush=True)

    def reap() -> None:
        server.poll()
        _reap_children()

    removed = end_group(os.getpgrp(), grace_s, reap, seen_segments)
    print(
        f"vime keeper {os.getpid()}: group ended in {time.monotonic() - began:.1f} s; "
        f"unlinked {len(removed)} /dev/shm files {removed}",
        flush=True,
    )
    return code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grace-s", type=float, default=5.0, help="SIGTERM -> SIGKILL grace")
    parser.add_argument(
        "--owner", type=int, default=None, help="pid whose death ends the group (the launcher)"
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the server's argv")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the server's command after --")
    sys.exit(run(cmd, args.grace_s, args.owner))


if __name__ == "__main__":
    main()
