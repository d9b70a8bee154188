"""engine.fault_tolerance: the job survives its engine's EngineCore being SIGKILLed twice, first
mid-generation, then (restarted engine) mid-sync: each time the engine is restarted, synced
(checksums verified) before it serves again, lost requests are resubmitted, and every step
completes with every sample. One job takes both faults (each job costs a minute of start-up)."""

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


def test_job_survives_engine_core_sigkill_in_generation_then_in_sync(tmp_path, tiny_model_dir):
    job = BackgroundJob(
        tmp_path,
        tiny_model_dir,
        f"num_steps={NUM_STEPS}",
        "engine.fault_tolerance=true",
        "weight_sync.verify_checksums=true",
        "weight_sync.update_weight_buffer_size=65536",  # many buckets: a long sync to land in
        "checkpoint.at_end=false",
    )
    try:
        # 1. Mid-generation: the async loop generates the next batch while it trains on this one.
        job.wait_running(steps=1)
        first_core = job.engine_core_pid()
        os.kill(first_core, signal.SIGKILL)
        kills = [time.time()]

        # 2. Mid-sync, in the restarted engine: once it serves and a whole step (its sync
        # included) has completed after the restart, the next /start_weight_update is a step's
        # sync, not the recovery's own.
        wait_for(lambda: job.engine_core_pid() != first_core, 300, "the restarted engine")
        steps_after_restart = job.steps_done() + 1
        # The next sync may begin before wait_for_next_sync counts: leave a step beyond it.
        assert steps_after_restart <= NUM_STEPS - 2, "no step left to kill a sync in"
        job.wait_running(steps=steps_after_restart)  # notes the restarted engine's processes
        job.wait_for_next_sync()
        os.kill(job.engine_core_pid(), signal.SIGKILL)
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
        assert rows[-1]["fault/engine_restarts"] >= 2
        # The second kill landed in a sync: that sync failed and was redone after the restart
        # (a recovery after a failed generation syncs once and says "reconnected and synced").
        assert re.search(r"engines \[0\] reconnected$", job.tail(1_000_000), re.M), job.tail()
        summary = json.loads((job.run_dir / "summary.json").read_text())
        assert summary["engine_restarts"] >= 2
        print(
            f"EngineCore SIGKILL in generation, then in a sync: {summary['engine_restarts']} "
            f"restarts, serving again {summary['recovery_s']} s after detection, "
            f"{rows[-1]['fault/resubmitted_requests']:.0f} requests resubmitted, "
            f"job done {time.time() - kills[-1]:.0f} s after the second kill"
        )
        job.wait_all_gone(15)
        # The third engine, started after the second kill and never noted: its group is gone too.
        last_keeper, _ = job.keeper()
        wait_for(lambda: not group_members(last_keeper), 15, "the last engine's processes gone")
        assert job.left_segments() == []
    finally:
        job.stop()
