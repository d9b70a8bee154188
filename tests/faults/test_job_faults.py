"""Faults injected into the running RL job (real torchrun, trainer ranks, Ray, vLLM CPU engine).

Each test starts the main job's config in the background, waits for a logged step, notes every
process and /dev/shm segment of the job, injects one fault, and asserts: the time bound, the
engine named in the error, no process of the job left, no segment left.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from job_harness import BackgroundJob

pytestmark = pytest.mark.faults

GONE_WITHIN_S = 10.0  # a SIGKILL anywhere ends the whole job within 10 s


@pytest.fixture
def start_job(tmp_path, tiny_model_dir):
    jobs = []

    def start(*overrides: str, nproc: int = 1) -> BackgroundJob:
        job = BackgroundJob(tmp_path, tiny_model_dir, *overrides, nproc=nproc)
        jobs.append(job)
        job.wait_running()
        return job

    yield start
    for job in jobs:
        job.stop()


def _assert_nothing_left(job: BackgroundJob, began: float, what: str) -> float:
    """`began`: time.monotonic() at the fault. Prints how long until the job named the failure
    (run_dir/failure.json, when the watchdog did) and until every process was gone."""
    killed_wall = time.time() - (time.monotonic() - began)
    job.wait_all_gone(GONE_WITHIN_S + 2)
    took = time.monotonic() - began
    assert took <= GONE_WITHIN_S, f"{what}: job ended after {took:.1f} s"
    assert job.left_segments() == [], f"{what}: segments left {job.left_segments()}"
    failure = job.failure()
    named = f"named after {failure['time'] - killed_wall:.1f} s, " if failure else ""
    print(f"{what}: {named}every process gone {took:.1f} s after the fault")
    return took


def test_sigkill_of_the_trainer_rank_ends_everything(start_job):
    job = start_job()
    (rank,) = job.rank_pids()
    began = time.monotonic()
    os.kill(rank, signal.SIGKILL)
    _assert_nothing_left(job, began, "trainer rank SIGKILL")


def test_sigkill_of_torchrun_ends_the_ranks_and_engines(start_job):
    job = start_job()
    began = time.monotonic()
    os.kill(job.process.pid, signal.SIGKILL)
    _assert_nothing_left(job, began, "torchrun SIGKILL")


def test_sigkill_of_one_rank_of_two_ends_the_other(start_job):
    job = start_job(nproc=2)
    ranks = job.rank_pids()
    assert len(ranks) == 2
    began = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    _assert_nothing_left(job, began, "rank 1 SIGKILL")


def test_sigkill_of_the_api_server_fails_the_job_naming_the_engine(start_job):
    job = start_job()
    _, server = job.keeper()
    began = time.monotonic()
    os.kill(server, signal.SIGKILL)
    _assert_nothing_left(job, began, "api_server SIGKILL")
    assert job.process.returncode != 0
    log = job.tail()
    assert "engine 0 at http://127.0.0.1:" in log, log


@pytest.mark.parametrize("phase", ["generation", "sync"])
def test_sigkill_of_engine_core_is_detected_within_10_s(start_job, phase):
    # sync: small buckets and checksums make the sync a longer window; the kill follows the
    # engine's access-log line of the next /start_weight_update (polled every 10 ms).
    overrides = ["weight_sync.update_weight_buffer_size=65536", "weight_sync.verify_checksums=true"]
    job = start_job(*(overrides if phase == "sync" else []))
    core = job.engine_core_pid()
    if phase == "sync":
        job.wait_for_next_sync()
    began = time.monotonic()
    os.kill(core, signal.SIGKILL)
    _assert_nothing_left(job, began, f"EngineCore SIGKILL during {phase}")
    if phase == "sync":
        # The kill landed inside a sync: the engine started an update it never finished.
        assert job.sync_open_at_end(), "the kill missed the sync"
    failure = job.failure()
    assert failure is not None, job.tail()
    # The watchdog ("engine 0 at URL is dead") or the request that failed first names it.
    assert "engine 0 at http://127.0.0.1:" in failure["error"], failure


def test_stalled_engine_core_is_named_after_the_progress_timeout(start_job):
    job = start_job("engine.progress_timeout_s=10")
    core = job.engine_core_pid()
    began = time.monotonic()
    os.kill(core, signal.SIGSTOP)
    # progress timeout 10 s + probe interval 2 s, then the job ends as for a dead engine (a
    # stopped process holds SIGTERM; the keeper's SIGKILL after its grace ends it)
    killed_wall = time.time() - (time.monotonic() - began)
    took = job.wait_all_gone(10 + 2 + GONE_WITHIN_S)
    failure = job.failure()
    assert failure is not None, job.tail()
    assert "engine 0 at http://127.0.0.1:" in failure["error"] and "is stalled" in failure["error"]
    assert job.left_segments() == []
    print(
        f"EngineCore SIGSTOP: named after {failure['time'] - killed_wall:.1f} s, every process "
        f"gone {took:.1f} s after the fault"
    )
    assert time.monotonic() - began <= 10 + 2 + GONE_WITHIN_S
