"""A job SIGKILLed after a checkpoint resumes from it: the main job's config, real torchrun,
trainer rank, Ray and vLLM CPU engine.

Both runs sync after every third step (`weight_sync.interval: 3`) and save a checkpoint every 2,
so the checkpoint after step 2 holds weights no engine has served: a version of their own. The
first run is killed (torchrun SIGKILL) once that checkpoint is complete. The second run,
`checkpoint.resume=true` in the same run_dir, loads it before any engine starts, syncs the fresh
engine to the resumed weights (as the checkpoint's weight version) before its first rollout, and
continues at step 2: its metrics carry on from there (one row per step), and every token of its
first batch comes from the resumed weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from job_harness import REPO_ROOT, BackgroundJob, wait_for

from vime.train import torchrun_command

pytestmark = pytest.mark.faults


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
                members.append(int(entry))
    return members


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_job_resumes_from_its_checkpoint(tmp_path, tiny_model_dir):
    checkpoints = tmp_path / "run" / "checkpoints"
    common = [
        "checkpoint.every_steps=2",
        "weight_sync.interval=3",
        "save_rollouts=true",
        "weight_sync.verify_checksums=true",
    ]
    job = BackgroundJob(tmp_path, tiny_model_dir, *common)
    try:
        job.wait_running()
        saved = f"saved checkpoint {checkpoints / 'step_2'} "
        wait_for(lambda: saved in job.tail(100_000), 300, "the step-2 checkpoint")
        os.kill(job.process.pid, signal.SIGKILL)
        # Whether anything outlives the job, not how fast it ends (test_job_faults times that):
        # the keeper's own worst case once it notices is 18 s (5 s SIGTERM grace, 5 s after
        # SIGKILL, 3 s for Python's resource tracker to exit by itself, 5 s after its SIGKILL),
        # and on a loaded CI machine a resource tracker of the job was once still alive at 12 s.
        job.wait_all_gone(30)
        # Nothing of the job's session is left either: megatron's checkpoint writer starts a
        # process during a save, which vime ends with the save (a leak found by an earlier run).
        wait_for(lambda: not _session_members(job.process.pid), 30, "the job's session gone")
    finally:
        job.stop()

    cmd = torchrun_command(
        REPO_ROOT / "configs" / "tiny_cpu_async.yaml",
        f"run_dir={tmp_path / 'run'}",
        f"engine.model_path={tiny_model_dir}",
        "model.preset=null",
        "num_steps=4",
        "rollout.num_prompts_per_step=4",
        "rollout.num_samples_per_prompt=4",
        "rollout.max_tokens=64",
        "eval.prompts_path=null",
        *common,
        "checkpoint.resume=true",
    )
    resumed = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert "resumed from" in resumed.stderr and "step_2" in resumed.stderr

    # One row per step: rows the killed run wrote after its checkpoint were dropped on resume.
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # No sync after steps 0 and 1 (version 0 served); the checkpoint after step 2 holds weight
    # version 1, unsynced in the first run; the resumed run syncs after its steps 2 (the
    # third) and 3 (the last): versions 2 and 3.
    assert [r["sync/weight_version"] for r in rows] == [0, 0, 2, 3]
    assert ["sync/verified" in r for r in rows] == [False, False, True, True]
    assert all(r["sync/verified"] == 1.0 for r in rows[2:])
    samples = _rows(tmp_path / "run" / "rollouts.jsonl")
    assert [s["step"] for s in samples] == [0] * 16 + [1] * 16 + [2] * 16 + [3] * 16
    # Steps 0 and 1 trained on the first weights (version 0) only.
    assert {v for s in samples if s["step"] < 2 for v in s["weight_versions"]} == {0}
    # The engine served the resumed weights (version 1) before the first rollout.
    assert {v for s in samples if s["step"] == 2 for v in s["weight_versions"]} == {1}
    # The newest two complete checkpoints are kept: step_2 and the one at the end, step_4.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_2", "step_4"]

    # `vime export`: the final checkpoint as an HF checkpoint transformers loads; its tensors are
    # the trainer's last weights (the same sum of |w| as the job's last fingerprint; the HF names
    # and fused layouts only reorder elements).
    out = tmp_path / "exported"
    export = [sys.executable, "-m", "vime.cli", "export", str(tmp_path / "run"), str(out)]
    done = subprocess.run(export, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "step_4" in done.stdout and "weight version 3" in done.stdout
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tensors = load_file(out / "model.safetensors")
    total = sum(float(t.double().abs().sum()) for t in tensors.values())
    assert total == pytest.approx(rows[-1]["train/weight_l1"], rel=1e-9)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([[5, 17, 42, 7]])
    generated = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8)
