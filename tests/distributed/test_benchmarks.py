"""The benchmarks run end to end on the tiny model: real vLLM CPU engines, real megatron-core.

They check that every figure is produced and consistent, not how fast anything is.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_token import TOKEN

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed


def _run(args: list[str], timeout: int, **env: str) -> subprocess.CompletedProcess:
    completed = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-6000:]
    return completed


def test_bench_sync_reports_every_method_and_phase(tmp_path, engine_pool):
    """On the session's shared shm and gloo engines, attached by URL (the launch path of the
    benchmark's own engines is the job's, tested with the jobs)."""
    engines = engine_pool.get("shm", "gloo")
    out = tmp_path / "bench"
    shm_before = set(os.listdir("/dev/shm"))
    completed = _run(
        [
            "vime.bench.sync",
            "--preset",
            "qwen2-tiny",
            "--dtypes",
            "float32",
            "--iterations",
            "2",
            "--bucket-mib",
            "1",
            "--probe-tokens",
            "2000",  # the shared engines' max_model_len is 2048
            "--out",
            str(out),
            "--model-root",
            str(tmp_path / "models"),
            "--engine-url",
            *(f"{backend}={engine.url}" for backend, engine in engines.items()),
        ],
        timeout=600,
        VIME_ENGINE_TOKEN=TOKEN,
    )
    assert "x floor" in completed.stdout and "float32 shm:" in completed.stdout
    document = json.loads((out / "bench_sync.json").read_text())
    (result,) = document["results"]
    assert result["num_bytes"] > 0 and result["floor_s"] > 0 and result["floor_pinned_s"] > 0
    by_method = {m["method"]: m for m in result["measurements"]}
    assert set(by_method) == {"shm", "gloo", "naive", "disk", "control"}
    for method in ("shm", "gloo", "naive"):
        m = by_method[method]
        assert len(m["iterations"]) == 2  # --iterations, for every method
        for row, stats in zip(m["iterations"], m["engine_stats"], strict=True):
            # Every byte reached the engine and was loaded, bucket by bucket.
            assert stats["bytes"] == result["num_bytes"] and stats["load"] > 0
            # The engine's own work happens inside the sync the trainer timed.
            assert row["pack"] > 0 and row["engine_receive"] + row["engine_load"] < row["total"]
            # The named columns account for the sync: what no phase claims stays small.
            assert row["other"] < 0.25 * row["total"], row
            # The engines stood still from the pause request to the resume's answer: the sync.
            assert 0 < row["paused"] <= 1.05 * row["total"] + 0.01, row
            # The streamed request's gap at the version switch (NaN: it ended before the sync;
            # how much of the pause it shows depends on how far the client lags its stream,
            # which a loaded machine decides: the figure is the benchmark's, not asserted).
            assert math.isnan(row["stall"]) or row["stall"] >= 0, row
    # Requests as the engine counted them (update_weights calls it served per sync).
    assert by_method["shm"]["num_requests"] > 1  # 1 MiB buckets, one request each
    assert by_method["naive"]["num_requests"] == result["num_tensors"]
    assert by_method["gloo"]["num_requests"] == 1  # the whole stage streams in one request
    assert len(by_method["disk"]["iterations"]) == 2
    assert {"save", "reload", "total"} <= set(by_method["disk"]["iterations"][0])
    assert by_method["control"]["iterations"][0]["total"] > 0
    # Shared-memory segments were unlinked once mapped; the attached engines were left running.
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("vime-")]
    assert all(engine.health() for engine in engines.values())


def test_bench_loop_times_each_staleness_bound(tmp_path, tiny_model_dir, engine_pool):
    """K = 0 and K = 2 on the session's shared shm engine, attached by URL (each job syncs its
    trainer's weights in as version 0 first)."""
    engine = engine_pool.get("shm")["shm"]
    out = tmp_path / "bench"
    completed = _run(
        [
            "vime.bench.loop",
            "--config",
            "configs/tiny_cpu_async.yaml",
            "--steps",
            "4",
            "--skip",
            "1",
            "--staleness",
            "0",
            "2",
            "--out",
            str(out),
            f"engine.model_path={tiny_model_dir}",
            f"engine.external_urls=[{engine.url}]",
            f"engine.auth_token={TOKEN}",
            "model.preset=null",
            "rollout.num_prompts_per_step=4",
            "rollout.num_samples_per_prompt=4",
        ],
        timeout=600,
    )
    assert "K=2: step throughput" in completed.stdout
    document = json.loads((out / "bench_loop.json").read_text())
    for k in ("0", "2"):
        figures = document["figures"][k]
        assert figures["steps_timed"] == 3
        assert 0 < figures["generate_s"] and 0 < figures["train_s"] < figures["step_s"] * 2
        assert 0 < figures["engine_occupied"] <= 1 and figures["dropped_stale"] == 0
        assert (out / f"staleness-{k}" / "metrics.jsonl").exists()
    assert document["speedup_over_0"]["2"] == pytest.approx(
        document["figures"]["0"]["step_s"] / document["figures"]["2"]["step_s"]
    )
    # K = 0 trains on samples of the trainer's own version; K = 2 on some older ones.
    assert document["figures"]["0"]["lag_mean"] == 0
    rows = [json.loads(line) for line in (out / "staleness-2" / "metrics.jsonl").open()]
    assert max(r["staleness/lag_max"] for r in rows) <= 2
