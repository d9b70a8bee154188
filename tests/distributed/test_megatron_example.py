"""The README's plugin example: a Megatron-core loop that is not vime's trainer, syncing every step.

Runs `examples/megatron_sft_loop.py` on two data-parallel gloo ranks (DDP + Float16Module bf16 +
megatron's distributed optimizer, megatron's schedule) with a real vLLM CPU engine that vime
launches, then checks what it recorded: every sync verified by the engine's checksums, each
step's greedy tokens labelled with that step's weight version, and the engine's greedy output
after the last sync equal to HF transformers on the trainer's final weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.testing.hf import hf_greedy

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def test_own_megatron_loop_syncs_every_step_into_a_real_engine(tiny_model_dir, tmp_path):
    from vime.utils.net import free_port

    out = tmp_path / "example"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO_ROOT / "examples" / "megatron_sft_loop.py"),
        "--hf-dir",
        str(tiny_model_dir),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
    ]
    completed = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=540, env=dict(os.environ)
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["steps"]
    assert summary["world_size"] == 2
    assert [row["weight_version"] for row in rows] == list(range(1, STEPS + 2))
    assert all(row["verified"] for row in rows), "a sync was not checked against the engine"
    # bf16 parameters: every sync sends the model in bfloat16 (2 bytes per element).
    assert len({row["sync_bytes"] for row in rows}) == 1
    losses = [row["loss"] for row in rows[1:]]
    assert losses[-1] < losses[0], losses
    for row in rows:
        for versions in row["token_versions"]:
            assert versions == [str(row["weight_version"])] * len(versions), row["step"]
    # Each sync changed what the engine generates at least once.
    assert len({json.dumps(row["greedy"]) for row in rows}) > 1
    last = rows[-1]
    for prompt, tokens in zip(summary["prompts"], last["greedy"], strict=True):
        assert tokens == hf_greedy(out / "hf", prompt, len(tokens)), prompt
