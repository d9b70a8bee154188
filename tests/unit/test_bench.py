"""The benchmarks' arithmetic and report formats (the runs themselves: tests/distributed)."""

from __future__ import annotations

import pytest
import torch

from vime.bench.loop import format_report, step_figures
from vime.bench.sync_results import DtypeResult, Measurement, format_table, summarize
from vime.bench.sync_setup import parse_env
from vime.cli import main as vime_main

pytestmark = pytest.mark.unit


def _result() -> DtypeResult:
    def sync(method: str, total: float, requests: int) -> Measurement:
        rows = [{"pause": 0.02, "pack": total / 4, "engine_load": total / 2, "total": total}] * 2
        return Measurement(method, "float32", 2_000_000_000, rows, num_requests=requests)

    disk = Measurement("disk", "float32", 2_000_000_000, [{"save": 5.0, "total": 8.0}])
    control = Measurement(
        "control",
        "float32",
        0,
        [{"pause": 0.025, "start": 0.01, "engine_start": 0.004, "total": 0.05}],
    )
    return DtypeResult(
        dtype="float32",
        num_tensors=290,
        num_bytes=2_000_000_000,
        floor_s=0.16,
        floor_pinned_s=0.28,
        engine_startup_s={"shm": 60.0},
        measurements=[
            sync("shm", 1.6, 4),
            sync("gloo", 3.2, 1),
            sync("naive", 4.8, 290),
            disk,
            control,
        ],
    )


def test_measurement_mean_averages_every_phase():
    m = Measurement("shm", "float32", 1, [{"a": 1.0, "total": 2.0}, {"a": 3.0, "total": 4.0}])
    assert m.mean() == {"a": 2.0, "total": 3.0}


def test_sync_table_has_floors_ratios_and_bandwidth():
    table = format_table([_result()])
    lines = table.splitlines()
    assert "x floor" in lines[0] and "GB/s" in lines[0] and "eng.load" in lines[0]
    shm = next(line for line in lines if " shm " in line)
    assert shm.split()[-3:] == ["1.600", "1.25", "10.0"]  # total, GB/s, x the 2-core floor
    assert any("memcpy 1 core" in line and line.split()[-1] == "1.8" for line in lines)
    summary = summarize([_result()])
    assert (
        "float32 shm: 1.600 s = 10.0x the memcpy floor (0.800 s = 5.0x without the engine's "
        "own load_weights, 0.800 s); disk takes 5.0x as long; naive takes 3.0x as long"
    ) in summary
    assert (
        "float32 control plane (no bytes): 50.0 ms, median of 1 sessions (quartiles 50.0-50.0 "
        "ms); medians in ms: pause 25.0, start 10.0 (4.0 in the worker)"
    ) in summary


def test_a_sync_packed_before_the_pause_counts_its_pack_once_and_shows_vimes_share_of_the_pause():
    from types import SimpleNamespace

    from vime.bench.sync_methods import sync_phases

    report = SimpleNamespace(
        seconds={"prepare": 0.3, "pause": 0.1, "start": 0.01, "send": 0.5, "finish": 0.05},
        send_seconds={"gather": 0.05, "pack": 0.2, "transfer": 0.45},
        total_s=0.96,
    )
    row = sync_phases(report, {"load": 0.4})
    # prepare (0.3) holds gather and pack; the rest of send beyond "wait" is "other".
    assert row["prepare"] == 0.3 and row["pack"] == 0.2
    assert row["other"] == pytest.approx(0.96 - (0.3 + 0.1 + 0.01 + 0.45 + 0.05))
    rows = [{**row, "paused": 0.62, "engine_finish": 0.05}, {**row, "paused": 0.64}]
    result = _result()
    result.measurements.insert(1, Measurement("shm+pack-in-pause", "float32", 1, rows))
    (line,) = [line for line in summarize([result]) if "shm+pack-in-pause" in line]
    assert (
        "engines paused 0.630 s, of which vime's share (beyond the worker's own start, load "
        "and finish) 0.205 s = 1.3x the floor (medians of 2);"
    ) in line


def test_quartiles():
    from vime.bench.sync_results import quartiles

    assert quartiles([4.0, 1.0, 3.0, 2.0, 5.0]) == (2.0, 4.0)
    assert quartiles([1.0, 2.0]) == (1.25, 1.75)
    assert quartiles([3.0]) == (3.0, 3.0)


def test_engine_env_pairs_are_checked():
    assert parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_env(["novalue"])


def _record(step: int, end: float) -> dict:
    return {
        "step": step,
        "time/step_end": end,
        "time/gen_start": end - 1.0,
        "time/gen_end": end - 0.5,
        "time/train_start": end - 0.4,
        "time/train_end": end - 0.1,
        "sync/time_s": 0.1,
        "rollout/reward_mean": 0.5,
        "rollout/num_samples": 16,
        "time/batch_wait_s": 0.2,
    }


def test_loop_figures_skip_warmup_steps():
    records = [_record(0, 5.0), _record(1, 6.0), _record(2, 6.5), _record(3, 7.0)]
    figures = step_figures(records, skip=2)
    assert figures["step_s"] == pytest.approx(0.5)  # (7.0 - 6.0) / 2 steps
    assert figures["generate_s"] == pytest.approx(0.5)
    assert figures["train_s"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="need at least 4"):
        step_figures(records[:3], skip=2)
    report = format_report({0: {**figures, "step_s": 1.0}, 2: figures})
    assert "K=2: step throughput 2.00x K=0's" in report
    assert figures["samples_per_s"] == pytest.approx(16 / 0.5)
    assert figures["batch_wait_s"] == pytest.approx(0.2)


def test_vime_command_lists_and_rejects_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        vime_main(["--help"])
    assert exit_info.value.code == 0 and "bench-sync" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        vime_main(["bench-sink"])
    assert exit_info.value.code == 2 and "unknown command 'bench-sink'" in capsys.readouterr().err


def _sized(preset: str, gb: float, shm_s: float) -> DtypeResult:
    shm = Measurement("shm", "bfloat16", int(gb * 1e9), [{"total": shm_s}, {"total": 9 * shm_s}])
    shm.iterations.append({"total": shm_s * 0.5})  # median of three: shm_s
    return DtypeResult(
        dtype="bfloat16",
        num_tensors=1,
        num_bytes=int(gb * 1e9),
        floor_s=gb / 10.0,
        floor_pinned_s=gb / 8.0,
        engine_startup_s={},
        measurements=[shm],
        preset=preset,
    )


def test_size_fit_recovers_slope_and_intercept(tmp_path):
    from vime.bench.sizes import fit_line, fit_sizes, format_sizes, plot_sizes

    per_gb, intercept = fit_line([(1.0, 1.5), (2.0, 2.5), (4.0, 4.5)])
    assert per_gb == pytest.approx(1.0) and intercept == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least two sizes"):
        fit_line([(1.0, 1.0)])
    # shm: 0.2 s + GB / 2 GB/s; the floor: GB / 10 GB/s, no fixed cost.
    results = [_sized(p, gb, 0.2 + gb / 2.0) for p, gb in (("a", 0.3), ("b", 1.0), ("c", 3.0))]
    fits = {fit.method: fit for fit in fit_sizes(results)}
    assert set(fits) == {"floor", "shm"}  # gloo and disk were not run
    assert fits["shm"].slope_gbps == pytest.approx(2.0)
    assert fits["shm"].intercept_s == pytest.approx(0.2)
    assert fits["floor"].slope_gbps == pytest.approx(10.0)
    assert fits["floor"].intercept_s == pytest.approx(0.0, abs=1e-9)
    table = format_sizes(results, list(fits.values()))
    assert "shm    slope   2.00 GB/s  intercept +0.200 s  (3 sizes)" in table
    assert plot_sizes(list(fits.values()), tmp_path / "sizes.png", "t").stat().st_size > 1000


def test_bench_sync_sizes_need_two_presets():
    from vime.bench.sync import parse_args

    assert parse_args(["--sizes", "qwen2-0.16b", "qwen2.5-0.5b"]).sizes == [
        "qwen2-0.16b",
        "qwen2.5-0.5b",
    ]
    with pytest.raises(SystemExit):
        parse_args(["--sizes", "qwen2.5-0.5b"])


def test_repack_probe_repacks_the_weights_vllm_repacks(monkeypatch):
    from vllm import _custom_ops as ops

    from vime.bench.repack import linear_weights, repack_rounds

    repacked = []
    real = ops.create_onednn_mm

    def counting(weight, m_hint):
        repacked.append(tuple(weight.t().shape))
        return real(weight, m_hint)

    monkeypatch.setattr(ops, "create_onednn_mm", counting)
    weights = {
        "model.embed_tokens.weight": torch.randn(64, 32),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 48),
        "model.layers.0.input_layernorm.weight": torch.randn(32),
    }
    # Tied head: the embedding is repacked as the output layer; norms never.
    linear = linear_weights(weights)
    assert sorted(tuple(t.shape) for t in linear) == [(32, 32), (32, 48), (64, 32)]
    seconds = repack_rounds(linear, threads=2, rounds=2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert sorted(repacked) == sorted([(32, 32), (32, 48), (64, 32)] * 3)  # warm-up + 2 rounds
    untied = linear_weights({**weights, "lm_head.weight": torch.randn(64, 32)})
    assert not any(t is weights["model.embed_tokens.weight"] for t in untied)
    assert len(untied) == 3  # the head, not the embedding


def test_delta_table_gives_medians_per_lr():
    """`vime bench-sync --delta`'s table: one row per lr, medians over its steps, n stated."""
    from vime.bench.delta import format_delta

    def step(changed: float, delta_s: float, load: float) -> dict:
        return dict(
            changed_fraction=changed,
            delta_bytes=changed * 1e8,
            full_bytes=1e8,
            delta_s=delta_s,
            full_s=0.5,
            plain_s=0.45,
            delta_paused_s=delta_s / 2,
            full_paused_s=0.4,
            plain_paused_s=0.35,
            engine_stats={"load": load},
        )

    figures = {
        "preset": "p",
        "dtype": "bfloat16",
        "transport": "shm",
        "runs": [
            {"lr": 1e-6, "steps": [step(0.01, 0.2, 0.1), step(0.03, 0.4, 0.3), step(0.02, 9, 9)]},
            {"lr": 1e-5, "steps": [step(0.5, 1.0, 0.7)]},
        ],
    }
    header, _, _, first, second = format_delta(figures).splitlines()
    assert "p bfloat16 over shm" in header
    assert first == (
        "| 1e-06 | 3 | 2.0000% | 2.0 MB | 100.0 MB | 0.400 | 0.500 | 0.450 | "
        "0.200 / 0.400 / 0.350 | 0.300 |"
    )
    assert second == (
        "| 1e-05 | 1 | 50.0000% | 50.0 MB | 100.0 MB | 1.000 | 0.500 | 0.450 | "
        "0.500 / 0.400 / 0.350 | 0.700 |"
    )


def test_peer_copy_table_gives_medians_of_the_join_steps():
    """`vime bench-sync --peer-copy`'s table: the trainer's full sync against the engine's peer copy
    and the delta after it, medians of n steps."""
    from vime.bench.peer_copy import format_peer_copy

    def step(scale: float) -> dict:
        return dict(
            changed_fraction=0.01 * scale,
            full_s=1.0 * scale,
            full_bytes=2e8,
            peer_copy_s=0.3 * scale,
            peer_copy_send_s=0.1 * scale,
            peer_copy_bytes=2e8,
            delta_s=0.2 * scale,
            delta_bytes=4e6,
        )

    figures = {"preset": "p", "dtype": "bfloat16", "transport": "shm", "lr": 1e-6}
    table = format_peer_copy({**figures, "steps": [step(1), step(2), step(30)]}).splitlines()
    assert "medians of 3 steps" in table[0] and "2.00% of elements changed" in table[0]
    assert table[3] == "| trainer | full sync, both engines paused | 2.000 | 200.0 MB |"
    assert table[4].startswith(
        "| engine | peer copy (engine to engine, checksums compared) | 0.600 "
    )
    assert "sends for 0.200; 200.0 MB) | 0 |" in table[4]
    assert table[5].endswith("| 0.400 | 4.0 MB |")
