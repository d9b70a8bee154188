"""engine.fault_tolerance with two engines: engine 0's EngineCore is SIGKILLed mid-generation
while engine 1 serves; then, once engine 0 serves again, both EngineCores are SIGKILLed in one
sync (a delta sync). Each time the engines are restarted, synced (checksums verified) before
they serve again, lost requests are resubmitted, and every step completes with every sample. One
job takes all the faults (each job costs a minute of start-up)."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
from job_harness import BackgroundJob, wait_for

from vime.utils.process_group import group_members

pytestmark = pytest.mark.faults

NUM_STEPS = 8
SAMPLES_PER_STEP = 16  # 4 prompts x 4 samples (job_harness)


def test_job_survives_one_engine_dying_while_another_serves_then_both_in_one_sync(
    tmp_path, tiny_model_dir
):
    job = BackgroundJob(
        tmp_path,
        tiny_model_dir,
        f"num_steps={NUM_STEPS}",
        "engine.num_engines=2",
        "engine.fault_tolerance=true",
        "weight_sync.verify_checksums=true",
        "weight_sync.update_weight_buffer_size=65536",  # many buckets: a long sync to land in
        # Delta syncs: the sync the second kill lands in is a delta, whose repair (a full sync of
        # the same version) fails on the dead engines and must hand over to fault tolerance.
        "weight_sync.transport={kind: shm, delta: true}",
        "checkpoint.at_end=false",
    )
    try:
        # 1. Mid-generation (the async loop generates the next batch while it trains on this
        # one), engine 0 alone: engine 1 goes on serving, and takes the resubmitted requests.
        job.wait_running(steps=1)
        first_core = job.engine_core_pid(0)
        os.kill(first_core, signal.SIGKILL)
        kills = [time.time()]

        # 2. Both engines in one sync, once engine 0 serves again and a whole step (its sync
        # included) has completed after the restart: the next /start_weight_update is a step's
        # sync, not the recovery's own.
        wait_for(lambda: job.engine_core_pid(0) != first_core, 300, "the restarted engine")
        steps_after_restart = job.steps_done() + 1
        # The next sync may begin before wait_for_next_sync counts: leave a step beyond it.
        assert steps_after_restart <= NUM_STEPS - 2, "no step left to kill a sync in"
        job.wait_running(steps=steps_after_restart)  # notes the restarted engine's processes
        job.wait_for_next_sync()
        cores = [job.engine_core_pid(0), job.engine_core_pid(1)]
        for core in cores:
            os.kill(core, signal.SIGKILL)
        kills.append(time.time())

        job.process.wait(timeout=600)
        assert job.process.returncode == 0, job.tail()
        rows = [
            json.loads(line)
            for line in (job.run_dir / "metrics.jsonl").read_text().split("\n")
            if line
        ]
        assert [row["step"] for row in rows] == list(range(NUM_STEPS))
        assert all(row["rollout/num_samples"] == SAMPLES_PER_STEP for row in rows), "samples lost"
        assert all(row["sync/verified"] == 1.0 for row in rows)
        assert [row["sync/weight_version"] for row in rows] == list(range(1, NUM_STEPS + 1))
        assert rows[-1]["fault/engine_restarts"] >= 3
        log = job.tail(1_000_000)
        # The first kill: engine 0 alone was recovered, while engine 1 served (after the failed
        # generation, or after the sync it failed, whichever found it first).
        assert re.search(r"engines \[0\] reconnected( and synced)?$", log, re.M), job.tail()
        # The second kill landed in a sync: that sync failed and was redone once both engines
        # were back (a recovery after a failed generation syncs once: "reconnected and synced").
        assert re.search(r"engines \[0, 1\] reconnected$", log, re.M), job.tail()
        assert "delta sync failed" in log, job.tail()
        summary = json.loads((job.run_dir / "summary.json").read_text())
        assert summary["engine_restarts"] >= 3
        print(
            f"engine 0 SIGKILLed, then engines 0 and 1 in one sync: {summary['engine_restarts']} "
            f"restarts, serving again {summary['recovery_s']} s after detection, "
            f"{rows[-1]['fault/resubmitted_requests']:.0f} requests resubmitted, "
            f"job done {time.time() - kills[-1]:.0f} s after the second kill"
        )
        job.wait_all_gone(15)
        # The engines started after the second kill, never noted: their groups are gone too.
        for rank in (0, 1):
            last_keeper, _ = job.keeper(rank)
            wait_for(lambda k=last_keeper: not group_members(k), 15, f"engine {rank} gone")
        assert job.left_segments() == []
    finally:
        job.stop()
