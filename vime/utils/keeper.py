"""The keeper: a small process that leads an engine's process group and ends all of it.

    python -m vime.utils.keeper [--grace-s S] -- python -m vllm.entrypoints.openai.api_server ...

`launch_server` starts the keeper in a new session; the keeper starts the vLLM server as its child
in the same process group and watches, every POLL_S:
- its owner (the process that launched it: a Ray engine actor, a test, a trainer rank). When the
  owner dies, however it died, the keeper is re-parented, and ends the group;
- the server. When the api_server dies, vLLM leaves its EngineCore, workers and resource tracker
  running; the keeper ends them.
- SIGINT / SIGHUP: end the group (`ServerProcess.stop` sends SIGINT). SIGTERM too, unless the
  keeper runs with --preempt-grace-s G > 0: then the first SIGTERM is a preemption notice (what a
  scheduler sends before it takes the node). The keeper writes it (vime.utils.preemption) in the
  server's TMPDIR, where the job reads it and drains the engine, and ends the group G s later,
  or at once on SIGINT, SIGHUP or a second SIGTERM.

Ending the group (vime.utils.process_group): note the /dev/shm files its processes map (vLLM's
`psm_*` message queues, `vllm_dist_*` TP communicators, `sem.mp-*`), SIGTERM them, SIGKILL what
is left after the grace, then unlink those files: a SIGKILLed vLLM never unlinks its own segments.

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
from typing import Any

from vime.utils.preemption import write_notice
from vime.utils.process_group import end_group, group_members, mapped_shm_files

POLL_S = 0.2
SPAWN_TIMEOUT_S = 60.0
SEGMENT_SCAN_EVERY = 5  # polls: the group's mapped /dev/shm files are noted once a second
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1


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
    preempt_grace_s: float = 0.0,
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
    if preempt_grace_s > 0:
        keeper += ["--preempt-grace-s", str(preempt_grace_s)]
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
    preempt_grace_s: float = 0.0,
) -> int:
    """Run `cmd`, watch it and `owner` (via `owner_fd`, a pidfd, when given; else as the parent);
    end the group when either ends or on a stop signal (a SIGTERM with `preempt_grace_s` > 0:
    `preempt_grace_s` later, see the module's docstring). The exit code says why.

    `temp_dir`: the server's TMPDIR (made here when None); deleted once the group has ended."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    stop_signal: list[int] = []
    preempted_at: list[float] = []  # monotonic time of the preemption notice

    def on_signal(signum: int, _frame: object) -> None:
        if signum == signal.SIGTERM and preempt_grace_s > 0 and not preempted_at:
            preempted_at.append(time.monotonic())
            return
        stop_signal.append(signum)

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in stop_signals:
        signal.signal(sig, on_signal)
    # A blocked signal is never handled, and the mask is inherited through fork and exec: a
    # keeper spawned from a Ray actor's thread had SIGINT blocked (ServerProcess.stop then waited
    # out its grace and ended the group from outside).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
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
    polls = polls_since_notice = 0
    while True:
        if polls % SEGMENT_SCAN_EVERY == 0:
            # Segments of members that die later (a SIGKILLed api_server) stay known.
            new_segments = mapped_shm_files(group_members(os.getpgrp())) - seen_segments
            if new_segments:
                seen_segments |= new_segments
                print(
                    f"vime keeper {os.getpid()}: will unlink {sorted(new_segments)} at the end",
                    flush=True,
                )
        polls += 1
        if stop_signal:
            reason = f"signal {signal.Signals(stop_signal[0]).name}"
            break
        if preempted_at:
            if polls_since_notice == 0:
                write_notice(temp_dir, preempt_grace_s)
            polls_since_notice += 1
            if time.monotonic() - preempted_at[0] >= preempt_grace_s:
                reason = f"preempted (SIGTERM) {preempt_grace_s:g} s ago"
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
    parser.add_argument(
        "--preempt-grace-s",
        type=float,
        default=0.0,
        help="> 0: a first SIGTERM is a preemption notice; the group ends this many s later",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the server's argv")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the server's command after --")
    owner = args.owner if args.owner is not None else os.getppid()
    owner_fd = detach(owner, args.report_fd) if args.report_fd is not None else None
    sys.exit(
        run(
            cmd, args.grace_s, owner, owner_fd, args.remove_dir, args.temp_dir, args.preempt_grace_s
        )
    )


if __name__ == "__main__":
    main()
