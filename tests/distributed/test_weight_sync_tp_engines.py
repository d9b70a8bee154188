"""Weight sync into vLLM engines with tensor parallelism: real TP=2 CPU engines (one core per
worker), real megatron-core trainer ranks (TP1 and TP2) on gloo, both CPU transports.

Three engines for the module (qwen2-tiny float32): G2 (TP=2, broadcast), S2 (TP=2, colocated)
and G1 (TP=1, broadcast) for a sync into mixed engines (G1 and G2 in one broadcast group: world
1 + 1 + 2, G2's workers at rank offsets 2 and 3). G2's and S2's workers stand on the CPU
stand-in devices cpu:0 and cpu:1 (VIME_DEVICE_IDS), as a TP=2 engine on two GPUs would; the TP2
trainer's ranks on cpu:0 and cpu:1 (a colocated job on two GPUs): S2's worker 1 reads the
buffers of trainer rank 1, which gets each bucket from the sender (rank 0) first.
After every sync each worker's part of every tensor must equal the same slice of the trainer's
exported weights bit for bit (its slice read from the worker itself), and greedy output must equal
HF transformers on those weights.

    pytest -m distributed tests/distributed/test_weight_sync_tp_engines.py
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from weight_sync_harness import (
    HFReference,
    SyncJob,
    SyncStep,
    assert_continues_like_a_fresh_model,
    assert_synced,
    run_sync_job,
    running_engines,
)

from vime.engines.vllm_engine import VLLMEngine
from vime.utils.process_group import group_members, mapped_shm_files

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TWO_DEVICES = {"extra_env": {"VIME_DEVICE_IDS": "0,1"}}


@pytest.fixture(scope="module")
def model_dir(model_builder) -> str:
    return str(model_builder("qwen2-tiny", "float32"))


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """G2: TP=2 gloo, S2: TP=2 shm, G1: TP=1 gloo. Launched at once."""
    specs = {
        "G2": {"weight_transfer_backend": "gloo", "tensor_parallel_size": 2, **TWO_DEVICES},
        "S2": {"weight_transfer_backend": "shm", "tensor_parallel_size": 2, **TWO_DEVICES},
        "G1": {"weight_transfer_backend": "gloo"},
    }
    specs = {name: {"model_path": model_dir, **fields} for name, fields in specs.items()}
    with running_engines(specs, str(tmp_path_factory.mktemp("engine-logs"))) as engines:
        yield engines


@pytest.fixture(scope="module")
def urls(engines) -> dict[str, str]:
    return {name: engine.url for name, engine in engines.items()}


@pytest.fixture(scope="module")
def hf(model_dir, tmp_path_factory) -> HFReference:
    return HFReference(model_dir, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def checkpoint(model_dir) -> dict:
    return load_file(Path(model_dir) / "model.safetensors")


@pytest.fixture(scope="module")
def trainer_tp1_run(urls, model_dir, tmp_path_factory):
    g2, s2, mixed = (urls["G2"],), (urls["S2"],), (urls["G1"], urls["G2"])
    steps = (
        SyncStep("gloo", g2, version=1, inflight=True, clear_cache=True),
        SyncStep("gloo", mixed, version=2),
        SyncStep("nccl", mixed, version=3),
        # The one trainer rank is on the shared host, S2's workers on cpu:0 and cpu:1.
        SyncStep("shm", s2, version=99, expect_error=True),
    )
    job = SyncJob(model_dir=model_dir, steps=steps)
    return run_sync_job(job, 1, tmp_path_factory.mktemp("trainer-tp1"), timeout_s=400)


@pytest.fixture(scope="module")
def trainer_tp2_run(urls, model_dir, tmp_path_factory):
    g2, s2, mixed = (urls["G2"],), (urls["S2"],), (urls["G1"], urls["G2"])
    steps = (
        SyncStep("gloo", g2, version=10),
        SyncStep("shm", s2, version=10),
        SyncStep("gloo", mixed, version=11),
        SyncStep("ipc", s2, version=11),
        # Delta syncs into TP=2 engines: each worker patches whole tensors and loads its slices.
        SyncStep("gloo", g2, version=12, delta=True),
        SyncStep("gloo", g2, version=13, delta=True, changed_fraction=0.01),
        SyncStep("shm", s2, version=12, delta=True),
        SyncStep("shm", s2, version=13, delta=True, changed_fraction=0.01),
        # The sender (rank 0, cpu:0) and G2's worker 0 (cpu:0) in one NCCL group: refused.
        SyncStep("nccl", g2, version=98, expect_error=True),
        # weight_sync.shadow into TP=2 engines: each worker loads its slices beside its served
        # weights on a thread of its own; the swap lands on both workers in one finish.
        SyncStep("gloo", g2, version=14, shadow=True),
        SyncStep("shm", s2, version=14, shadow=True),
    )
    job = SyncJob(model_dir=model_dir, tp=2, device_ids=True, steps=steps)
    return run_sync_job(job, 2, tmp_path_factory.mktemp("trainer-tp2"), timeout_s=400)


@pytest.mark.parametrize("run", ["trainer_tp1_run", "trainer_tp2_run"])
def test_tp2_engines_serve_exact_trainer_slices(request, run, hf, checkpoint):
    records, exported = request.getfixturevalue(run)
    synced = [(r, w) for r, w in zip(records, exported, strict=True) if not r["step"].expect_error]
    for record, weights in synced:
        assert_synced(record, weights, hf, checkpoint)
        for engine in record["engines"]:
            # The TP=2 engines' workers really hold halves: some tensors are sliced.
            sliced = [m for m in engine["metadata"][-1] if m["shard"] is not None]
            assert bool(sliced) == (len(engine["metadata"]) == 2), engine["url"]
    kinds = {record["step"].transport for record, _ in synced}
    if run == "trainer_tp1_run":
        assert kinds == {"gloo", "nccl"}
        assert [len(engine["metadata"]) for engine in records[1]["engines"]] == [1, 2]
    else:
        assert kinds == {"gloo", "shm", "ipc"}
        assert [r["report"].delta for r in records[4:8]] == ["full", "delta"] * 2
        assert all("stage" in r["report"].seconds for r in records[9:11])  # loaded, then paused
        # shm across two devices: one request per bucket, each worker reading its rank's copy.
        assert records[1]["report"].num_buckets > 1


def test_placements_that_cannot_work_are_refused_before_any_byte(trainer_tp1_run, trainer_tp2_run):
    """A colocated engine worker on a device no trainer rank stands on; two members of one
    NCCL group on one device. Both refused at connect, naming who and where, nothing sent."""
    for records, index, expected in (
        (trainer_tp1_run[0], 3, r"engine 0 worker 0 is on device cpu:0, where no trainer rank"),
        (trainer_tp2_run[0], 8, r"trainer rank 0 \(pp stage 0 sender\) and engine 0 worker 0"),
    ):
        record = records[index]
        assert re.search(expected, record["error"]), record["error"]
        assert record["error_s"] < 10
        (engine,) = record["engines"]
        assert engine["is_paused"] is False
        assert engine["weight_version"] != str(record["step"].version)  # nothing synced


def test_clear_cache_switch_on_tp2_engine_continues_like_a_fresh_model(trainer_tp1_run, hf):
    """A weight switch mid-request on a TP=2 engine: a keep pause mid-generation with
    clear_cache=True, a sync, resume; the request's tokens after the switch are what the new
    weights generate from prompt + the tokens before it."""
    records, exported = trainer_tp1_run
    assert_continues_like_a_fresh_model(records[0], exported[0], hf)


def _engine_files(engine: VLLMEngine) -> tuple[set[str], str]:
    """The /dev/shm files the engine's processes map now, and its private TMPDIR (the keeper's)."""
    pgid = engine.server_pid()
    assert pgid is not None
    log = Path(engine.server_log_path()).read_text()
    temp_dir = re.findall(rf"vime keeper {pgid}: .* TMPDIR (\S+)", log)[-1]
    return mapped_shm_files(group_members(pgid)), temp_dir


def test_tp2_engines_leave_nothing_stopped_or_killed(engines, trainer_tp1_run, trainer_tp2_run):
    """A TP=2 engine's files: vLLM's message-queue segments in /dev/shm and its TP rendezvous
    file `vllm_dist_*` in the temp directory. All gone after a normal stop, and after every
    process of the engine but vime's keeper is SIGKILLed."""
    stopped, killed = engines["G2"], engines["S2"]
    files = {name: _engine_files(engines[name]) for name in ("G2", "S2")}
    for name, (segments, temp_dir) in files.items():
        assert segments, name
        assert any(f.startswith("vllm_dist_") for f in os.listdir(temp_dir)), (name, temp_dir)

    def left(name: str) -> list[str]:
        segments, temp_dir = files[name]
        return [p for p in (*segments, temp_dir) if os.path.exists(p)]

    stopped.shutdown()
    assert left("G2") == []

    keeper = killed.server_pid()
    assert keeper is not None
    for pid in group_members(keeper):
        if pid != keeper:
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while left("S2") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left("S2") == []
    killed.shutdown()
    assert group_members(keeper) == []
