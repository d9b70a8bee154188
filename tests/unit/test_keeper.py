"""The keeper ends an engine's whole process group and its /dev/shm files, however it is left.

A fake server stands in for vLLM here (the keeper is generic): it maps a /dev/shm file, as vLLM's
message queues do, and has a child that ignores SIGTERM, as a stuck worker would. The faults tier
(tests/faults) checks the same against real vLLM servers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from vime.engines.server import ServerProcess
from vime.utils.keeper import spawn_kept
from vime.utils.process_group import group_members, mapped_shm_files

pytestmark = pytest.mark.unit

FAKE_SERVER = """
import mmap, os, subprocess, sys, tempfile, time
print("fake server temp dir", tempfile.mkdtemp(), flush=True)  # as vLLM's vllm_dist_* file
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
mapping = mmap.mmap(fd, 4096)
stuck = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
subprocess.Popen([sys.executable, "-c", stuck])
time.sleep(300)
"""

OWNER = """
import sys, time
from vime.utils.keeper import spawn_kept
keeper = spawn_kept([sys.executable, "-c", sys.argv[1], sys.argv[2]], grace_s=1.0)
print("keeper pid", keeper.pid, flush=True)
time.sleep(300)
"""


@pytest.fixture
def shm_path():
    path = f"/dev/shm/vime-test-keeper-{uuid.uuid4().hex[:8]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def _wait(predicate, timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - start


def _temp_dir(log_path) -> str:
    """The temp directory the fake server made its file in (inside the keeper's TMPDIR)."""
    line = next(x for x in log_path.read_text().splitlines() if "fake server temp dir" in x)
    return line.split()[-1]


def _started(pgid: int, shm_path: str, log_path) -> None:
    # keeper, fake server, its stuck child; the segment mapped, and noted by the keeper (its log
    # says so): only a noted segment is unlinked when the group ends.
    _wait(lambda: len(group_members(pgid)) == 3 and mapped_shm_files(group_members(pgid)), 30)
    assert mapped_shm_files(group_members(pgid)) == {shm_path}
    _wait(lambda: f"will unlink ['{shm_path}']" in log_path.read_text(), 30)


def _fake_server(shm_path: str, tmp_path, **kwargs) -> tuple:
    """The fake server under a keeper (grace 1 s, `kwargs` to spawn_kept), and its ServerProcess."""
    with open(tmp_path / "log", "wb") as log:
        keeper = spawn_kept(
            [sys.executable, "-c", FAKE_SERVER, shm_path], log_file=log, grace_s=1, **kwargs
        )
    return keeper, ServerProcess(process=keeper, url="http://unused", log_path=tmp_path / "log")


def test_owner_sigkill_ends_group_and_unlinks_segments(shm_path, tmp_path):
    log_path = tmp_path / "owner.log"
    with open(log_path, "w") as log:  # the owner's and its keeper's output
        owner = subprocess.Popen([sys.executable, "-c", OWNER, FAKE_SERVER, shm_path], stdout=log)
    try:
        _wait(lambda: "keeper pid" in log_path.read_text(), 30)
        pgid = int(log_path.read_text().split("keeper pid ", 1)[1].split()[0])
        _started(pgid, shm_path, log_path)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        # grace 1 s, then SIGKILL for the child that ignores SIGTERM
        took = _wait(lambda: not group_members(pgid), 10)
        assert not os.path.exists(shm_path)
        print(f"owner SIGKILL -> group ended in {took:.2f} s")
    finally:
        owner.kill()


def test_server_sigkill_ends_its_orphans(shm_path, tmp_path):
    keeper, server = _fake_server(shm_path, tmp_path)
    try:
        _started(keeper.pid, shm_path, tmp_path / "log")
        os.kill(server.server_pid(), signal.SIGKILL)
        took = _wait(lambda: keeper.poll() is not None, 10)
        assert group_members(keeper.pid) == []
        assert not os.path.exists(shm_path)
        assert "server exited with code -9" in (tmp_path / "log").read_text()
        made = _temp_dir(tmp_path / "log")
        assert os.path.dirname(made) == keeper.temp_dir
        assert not os.path.exists(os.path.dirname(made)), "the server's TMPDIR outlived it"
        print(f"server SIGKILL -> group ended in {took:.2f} s")
    finally:
        server.stop(grace_s=1)


def test_stop_ends_group_and_unlinks_segments(shm_path, tmp_path):
    keeper, server = _fake_server(shm_path, tmp_path)
    _started(keeper.pid, shm_path, tmp_path / "log")
    server.stop(grace_s=1)
    assert group_members(keeper.pid) == []
    assert not os.path.exists(shm_path)
    assert not os.path.exists(os.path.dirname(_temp_dir(tmp_path / "log")))


SEMAPHORE_SERVER = """
import multiprocessing, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck: only SIGKILL ends it (and its tracker)
lock = multiprocessing.get_context("spawn").Lock()  # named, linked until its owner cleans up
print("semaphore", lock._semlock.name, flush=True)
time.sleep(300)
"""


def test_stop_unlinks_a_named_semaphore_whose_owner_and_tracker_are_sigkilled(tmp_path):
    """A Python named semaphore (what vLLM's processes make: /dev/shm/sem.mp-*) is mapped under
    the temporary name it was created with, now deleted; the keeper finds the file it became by
    inode. Its owner ignores SIGTERM, so the owner and multiprocessing's resource tracker (which
    would unlink it once the owner is gone) are both SIGKILLed after the grace."""
    log_path = tmp_path / "log"
    with open(log_path, "wb") as log:
        keeper = spawn_kept([sys.executable, "-c", SEMAPHORE_SERVER], log_file=log, grace_s=1)
    server = ServerProcess(process=keeper, url="http://unused", log_path=log_path)
    try:
        _wait(lambda: "semaphore" in log_path.read_text(), 30)
        name = log_path.read_text().split("semaphore", 1)[1].split()[0]
        path = f"/dev/shm/sem.{name.lstrip('/')}"
        assert os.path.exists(path)
        assert path in mapped_shm_files(group_members(keeper.pid))
        _wait(lambda: f"'{path}'" in log_path.read_text(), 30)  # noted by the keeper
    finally:
        server.stop(grace_s=1)
    assert group_members(keeper.pid) == []
    assert not os.path.exists(path)


def test_keeper_sigkill_takes_the_server_with_it(shm_path, tmp_path):
    keeper, server = _fake_server(shm_path, tmp_path)
    _started(keeper.pid, shm_path, tmp_path / "log")
    server_pid = server.server_pid()
    os.kill(keeper.pid, signal.SIGKILL)
    keeper.wait()
    _wait(lambda: server_pid not in group_members(keeper.pid), 5)  # PR_SET_PDEATHSIG
    assert os.path.isdir(keeper.temp_dir)  # the keeper died before it could delete it
    server.stop(grace_s=1)  # the orphaned stuck child is still the group's: stop ends it
    assert group_members(keeper.pid) == []
    assert not os.path.exists(keeper.temp_dir)  # stop deletes it instead
    # (The segment stays: only the dead server mapped it, and only the keeper had noted it.)


def test_sigterm_with_preempt_grace_is_a_notice_then_the_group_ends(shm_path, tmp_path):
    """engine.preemption_drain_s: the first SIGTERM keeps the server up for the grace and leaves
    a notice the job reads; the group ends when the grace is over."""
    keeper, server = _fake_server(shm_path, tmp_path, preempt_grace_s=3)
    try:
        _started(keeper.pid, shm_path, tmp_path / "log")
        assert server.preemption_notice() is None
        os.kill(keeper.pid, signal.SIGTERM)
        _wait(lambda: server.preemption_notice() is not None, 5)
        notice = server.preemption_notice()
        assert notice is not None and 1.5 < notice["left_s"] <= 3.0, notice
        assert len(group_members(keeper.pid)) == 3  # all still running
        took = _wait(lambda: keeper.poll() is not None, 10)
        assert group_members(keeper.pid) == []
        assert not os.path.exists(shm_path)
        assert "preempted (SIGTERM) 3 s ago" in (tmp_path / "log").read_text()
        print(f"preemption notice -> group ended {took:.2f} s after the notice was read")
    finally:
        server.stop(grace_s=1)


def test_stop_ends_a_preemptible_group_at_once(shm_path, tmp_path):
    """vime's own stop (SIGINT) is never taken for a preemption notice."""
    keeper, server = _fake_server(shm_path, tmp_path, preempt_grace_s=300)
    _started(keeper.pid, shm_path, tmp_path / "log")
    began = time.monotonic()
    server.stop(grace_s=1)
    assert time.monotonic() - began < 10
    assert group_members(keeper.pid) == []
    assert server.preemption_notice() is None
