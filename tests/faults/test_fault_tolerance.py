"""engine.fault_tolerance: the job survives its engine's EngineCore being SIGKILLed, mid-generation
and mid-sync: the engine is restarted, synced (checksums verified) before it serves again, lost
requests are resubmitted, every step completes with every sample."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from job_harness import BackgroundJob

pytestmark = pytest.mark.faults

NUM_STEPS = 5
SAMPLES_PER_STEP = 16  # 4 prompts x 4 samples (job_harness)


@pytest.mark.parametrize("phase", ["generation", "sync"])
def test_job_survives_engine_core_sigkill(tmp_path, tiny_model_dir, phase):
    overrides = [
        f"num_steps={NUM_STEPS}",
        "engine.fault_tolerance=true",
        "weight_sync.verify_checksums=true",
    ]
    if phase == "sync":
        overrides.append("weight_sync.update_weight_buffer_size=65536")
    job = BackgroundJob(tmp_path, tiny_model_dir, *overrides)
    try:
        job.wait_running(steps=1)
        core = job.engine_core_pid()
        if phase == "sync":
            job.wait_for_next_sync()
        killed_at = time.time()
        os.kill(core, signal.SIGKILL)
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
        assert rows[-1]["fault/engine_restarts"] >= 1
        summary = json.loads((job.run_dir / "summary.json").read_text())
        assert summary["engine_restarts"] >= 1
        print(
            f"EngineCore SIGKILL during {phase}: {summary['engine_restarts']} restart(s), "
            f"serving again {summary['recovery_s']} s after detection, "
            f"{rows[-1]['fault/resubmitted_requests']:.0f} requests resubmitted, "
            f"job done {time.time() - killed_at:.0f} s after the kill"
        )
        job.wait_all_gone(15)
        assert job.left_segments() == []
    finally:
        job.stop()
