"""The benchmarks' arithmetic and report formats (the runs themselves: tests/distributed)."""

from __future__ import annotations

import pytest

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
    control = Measurement("control", "float32", 0, [{"pause": 0.025, "total": 0.05}])
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
        ],  # fmt: skip
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
    assert "float32 control plane (no bytes): 50.0 ms" in summary


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
    }


def test_loop_figures_skip_warmup_steps():
    records = [_record(0, 5.0), _record(1, 6.0), _record(2, 6.5), _record(3, 7.0)]
    figures = step_figures(records, skip=2)
    assert figures["step_s"] == pytest.approx(0.5)  # (7.0 - 6.0) / 2 steps
    assert figures["generate_s"] == pytest.approx(0.5)
    assert figures["train_s"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="need at least 4"):
        step_figures(records[:3], skip=2)
    report = format_report({"sync": {**figures, "step_s": 1.0}, "async": figures})
    assert "async step throughput = 2.00x the sync loop's" in report


def test_vime_command_lists_and_rejects_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        vime_main(["--help"])
    assert exit_info.value.code == 0 and "bench-sync" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        vime_main(["bench-sink"])
    assert exit_info.value.code == 2 and "unknown command 'bench-sink'" in capsys.readouterr().err
