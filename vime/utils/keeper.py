"""The keeper: a small process that leads an engine's process group and ends all of it.

    python -m vime.utils.keeper [--grace-s S] -- python -m vllm.entrypoints.openai.api_server ...

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

The server runs with a private TMPDIR that the keeper makes and deletes when the group has ended:
vLLM leaves a `vllm_dist_*` rendezvous file in the temp directory at every start (its
torch.distributed file:// init method), which no one removes otherwise.

The keeper is a child subreaper, so processes orphaned inside the group (EngineCore after its
api_server died) are re-parented to it and reaped here, never to init.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

POLL_S = 0.2
SPAWN_TIMEOUT_S = 60.0
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


class KeptProcess:
    """A keeper this process started (not its child: the keeper detaches itself). Waits use a
    pidfd, so a reused pid is never mistaken for the keeper. Popen-like: pid, poll(), wait()."""

    def __init__(self, pid: int, temp_dir: str | None = None):
        self.pid = pid
        self.temp_dir = temp_dir  # the server's TMPDIR, deleted by the keeper (or by stop())
        self._pidfd = os.pidfd_open(pid)
        self.returncode: int | None = None  # 0 once gone (a non-child's exit code is not known)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            self.returncode = 0
            os.close(self._pidfd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"keeper {self.pid}", timeout or 0.0)
            select.select([self._pidfd], [], [], left)
        assert self.returncode is not None  # poll() set it
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            signal.pidfd_send_signal(self._pidfd, sig)


def spawn_kept(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    log_file: Any = None,
    grace_s: float = 5.0,
    remove_dir: str | None = None,
) -> KeptProcess:
    """Start `cmd` under a keeper owned by this process; stdout and stderr go to `log_file`.

    The keeper detaches (forks, its first process exits, it calls setsid): it leads a session and
    process group of its own, and is no child of this process, so whoever cleans up this process's
    children (Ray SIGKILLs an actor's child processes when the actor exits) cannot take the keeper
    before it has ended the group. It watches this process through a pidfd instead.
    """
    read_end, write_end = os.pipe()
    temp_dir = tempfile.mkdtemp(prefix="vime-engine-tmp-")
    keeper = [sys.executable, "-m", "vime.utils.keeper", "--owner", str(os.getpid())]
    keeper += ["--temp-dir", temp_dir]
    if remove_dir:
        keeper += ["--remove-dir", remove_dir]
    try:
        first = subprocess.Popen(
            [*keeper, "--report-fd", str(write_end), "--grace-s", str(grace_s), "--", *cmd],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT if log_file is not None else None,
            pass_fds=(write_end,),
        )
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    with os.fdopen(read_end) as report:
        if not select.select([report], [], [], SPAWN_TIMEOUT_S)[0]:
            first.kill()
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise RuntimeError(f"keeper for {cmd[:3]} did not start within {SPAWN_TIMEOUT_S} s")
        reported = report.read().strip()
    first.wait(timeout=SPAWN_TIMEOUT_S)
    if not reported.isdigit():
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise RuntimeError(f"keeper for {cmd[:3]} failed to start (exit code {first.returncode})")
    return KeptProcess(int(reported), temp_dir)


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


def _default_inductor_cache() -> str:
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry (some containers)
        user = str(os.getuid())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def detach(owner: int, report_fd: int) -> int:
    """Leave the launcher's process tree: fork, let the first process exit, setsid. Returns a pidfd
    of `owner`, opened while the owner still waits for the report (so it is the right process);
    the keeper's pid goes to report_fd."""
    owner_fd = os.pidfd_open(owner)
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    os.write(report_fd, str(os.getpid()).encode())
    os.close(report_fd)
    return owner_fd


def run(
    cmd: list[str],
    grace_s: float,
    owner: int,
    owner_fd: int | None = None,
    remove_dir: str | None = None,
    temp_dir: str | None = None,
) -> int:
    """Run `cmd`, watch it and `owner` (via `owner_fd`, a pidfd, when given; else as the parent);
    end the group when either ends or on SIGTERM. The exit code says why.

    `temp_dir`: the server's TMPDIR (made here when None); deleted once the group has ended."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    temp_dir = temp_dir or tempfile.mkdtemp(prefix="vime-engine-tmp-")
    env = {**os.environ, "TMPDIR": temp_dir}
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        # torch.compile's cache stays where it would be without the private TMPDIR (shared).
        env["TORCHINDUCTOR_CACHE_DIR"] = _default_inductor_cache()
    server = subprocess.Popen(cmd, preexec_fn=_kill_with_keeper, env=env)
    print(
        f"vime keeper {os.getpid()}: server pid {server.pid}, owner pid {owner}, TMPDIR {temp_dir}",
        flush=True,
    )
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
        owner_gone = (
            select.select([owner_fd], [], [], 0)[0]
            if owner_fd is not None
            else os.getppid() != owner
        )
        if owner_gone:
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
    shutil.rmtree(temp_dir, ignore_errors=True)
    if remove_dir and not reason.startswith("server exited"):
        shutil.rmtree(remove_dir, ignore_errors=True)  # kept, with its logs, when cmd failed
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
    parser.add_argument(
        "--report-fd", type=int, default=None, help="detach, then write the keeper's pid here"
    )
    parser.add_argument(
        "--remove-dir", default=None, help="a directory to delete at the end, unless cmd failed"
    )
    parser.add_argument(
        "--temp-dir", default=None, help="the server's TMPDIR, deleted at the end (default: new)"
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the server's argv")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the server's command after --")
    owner = args.owner if args.owner is not None else os.getppid()
    owner_fd = detach(owner, args.report_fd) if args.report_fd is not None else None
    sys.exit(run(cmd, args.grace_s, owner, owner_fd, args.remove_dir, args.temp_dir))


if __name__ == "__main__":
    main()
