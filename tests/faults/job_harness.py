"""Run the RL job in the background, inject a fault, and time how the job and its processes end.

Every process of the job is found before the fault, from the job itself: torchrun's descendant
tree (trainer ranks, the Ray cluster rank 0 started, Ray workers) and each engine's keeper group
(the keeper names itself and the server pid in the engine log; the group holds api_server,
EngineCore, workers and the resource tracker). Nothing is found by name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from vime.train import torchrun_command
from vime.utils.process_group import group_members, mapped_shm_files

REPO_ROOT = Path(__file__).resolve().parents[2]
KEEPER_LINE = re.compile(r"vime keeper (\d+): server pid (\d+)")


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except OSError:
        return []


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot); None once it has exited (or a zombie).
    A pid with another start time is another process: pids are reused."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.1) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)
    return time.monotonic() - start


class BackgroundJob:
    """`torchrun -m vime.train` on configs/tiny_cpu_async.yaml, started in its own session (no
    held-out evaluation: the main-job test covers it; an override can bring it back)."""

    def __init__(self, tmp_path: Path, model_dir: Path, *overrides: str, nproc: int = 1):
        self.run_dir = tmp_path / "run"
        self.log_path = tmp_path / "job.log"
        cmd = torchrun_command(
            REPO_ROOT / "configs" / "tiny_cpu_async.yaml",
            f"run_dir={self.run_dir}",
            f"engine.model_path={model_dir}",
            "model.preset=null",
            "num_steps=500",
            "rollout.num_prompts_per_step=4",
            "rollout.num_samples_per_prompt=4",
            "rollout.max_tokens=64",
            "eval.prompts_path=null",
            *overrides,
            nproc=nproc,
        )
        self.shm_before = set(os.listdir("/dev/shm"))
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.pids: dict[int, int] = {}  # pid -> start time
        self.segments: set[str] = set()

    # ---- what the job is made of -------------------------------------------------------------

    def engine_log(self, rank: int = 0) -> str:
        path = self.run_dir / "engines" / f"vllm-engine-{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def engine_ranks(self) -> list[int]:
        """The engines that have a log (launched so far)."""
        logs = (self.run_dir / "engines").glob("vllm-engine-*.log")
        return sorted(int(path.stem.rsplit("-", 1)[1]) for path in logs)

    # A restarted engine appends to the same log: the last line naming a pid is the live one.

    def keeper(self, rank: int = 0) -> tuple[int, int]:
        matches = KEEPER_LINE.findall(self.engine_log(rank))
        assert matches, "the engine log names no keeper"
        return int(matches[-1][0]), int(matches[-1][1])

    def engine_core_pid(self, rank: int = 0) -> int:
        matches = re.findall(r"\(EngineCore pid=(\d+)\)", self.engine_log(rank))
        assert matches, "the engine log names no EngineCore"
        return int(matches[-1])

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def rank_pids(self) -> list[int]:
        return children(self.process.pid)

    def wait_running(self, steps: int = 1, timeout_s: float = 400) -> None:
        """Until `steps` steps are logged; then note every process and segment of the job (added
        to those noted before: a restarted engine's processes join its predecessor's)."""

        def ready() -> bool:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise AssertionError(f"job exited early ({code}):\n{self.tail()}")
            return self.steps_done() >= steps

        wait_for(ready, timeout_s, "job running", poll_s=0.5)
        pids = {self.process.pid} | descendants(self.process.pid)
        for rank in self.engine_ranks():
            keeper, _ = self.keeper(rank)
            pids |= set(group_members(keeper))
        self.pids.update({pid: start_time(pid) for pid in pids if start_time(pid) is not None})
        self.segments |= mapped_shm_files(sorted(pids))
        assert len(self.pids) >= 6, {pid: cmdline(pid) for pid in self.pids}

    def wait_for_next_sync(self, timeout_s: float = 120) -> None:
        """Until the engine has answered the next /start_weight_update (its access log, polled
        every 10 ms): a fault injected now lands in that sync."""
        starts = self.engine_log().count("/start_weight_update")
        wait_for(
            lambda: self.engine_log().count("/start_weight_update") > starts,
            timeout_s,
            "the next sync",
            poll_s=0.01,
        )

    # ---- how it ended --------------------------------------------------------------------------

    def sync_open_at_end(self, rank: int = 0) -> bool:
        """Whether the engine's last weight update was still open when its log ended: it
        answered a /start_weight_update and no /finish_weight_update after it."""
        log = self.engine_log(rank)
        return log.rfind("/start_weight_update") > log.rfind("/finish_weight_update")

    def left_alive(self) -> dict[int, str]:
        return {pid: cmdline(pid) for pid, began in self.pids.items() if start_time(pid) == began}

    def left_segments(self) -> list[str]:
        """Segments the job's processes mapped, and any file that appeared in /dev/shm while the
        job ran, that are still there (the suite runs one job at a time)."""
        appeared = {f"/dev/shm/{name}" for name in set(os.listdir("/dev/shm")) - self.shm_before}
        return sorted(path for path in self.segments | appeared if os.path.exists(path))

    def wait_all_gone(self, timeout_s: float) -> float:
        """Seconds until every noted process is gone (AssertionError naming the rest)."""
        try:
            return wait_for(lambda: not self.left_alive(), timeout_s, "job processes gone")
        except AssertionError:
            left = self.left_alive()
            raise AssertionError(f"left running after {timeout_s:g} s: {left}") from None

    def failure(self) -> dict | None:
        path = self.run_dir / "failure.json"
        return json.loads(path.read_text()) if path.exists() else None

    def tail(self, chars: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """End whatever is left of the job (its noted pids only), whatever the test's outcome."""
        for pid in self.left_alive():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        self._log.close()
