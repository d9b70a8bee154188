"""MetricsWriter writes JSONL, TensorBoard events, a PNG and a summary."""

from __future__ import annotations

import json

import pytest

from vime.rl.metrics import MetricsWriter, prefixed

pytestmark = pytest.mark.unit


def test_writer_produces_all_files(tmp_path):
    with MetricsWriter(tmp_path / "run") as writer:
        for step in range(4):
            writer.log(
                step,
                {
                    "rollout/reward_mean": 0.1 * step,
                    "sync/time_s": 0.5,
                    "staleness/lag_mean": step % 2,
                    **prefixed({"logprob_diff": 0.01}, "train/"),
                },
            )
        writer.log(4, {"rollout/reward_mean": 0.5})  # not every key every step
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert rows[2]["rollout/reward_mean"] == pytest.approx(0.2)
    assert "train/logprob_diff" in rows[0] and "sync/time_s" not in rows[4]
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = list((run / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    summary = (run / "summary.txt").read_text()
    assert "steps logged: 5" in summary
    assert "reward: 0.000 -> 0.500" in summary
    assert "weight sync time (s): mean 0.5" in summary


def test_tensorboard_scalars_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path) as writer:
        writer.log(0, {"rollout/reward_mean": 0.25})
        writer.log(1, {"rollout/reward_mean": 0.75})
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    values = [event.value for event in accumulator.Scalars("rollout/reward_mean")]
    assert values == pytest.approx([0.25, 0.75])


def test_plot_with_missing_panels_and_bad_values(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="must be numbers"):
        writer.log(0, {"rollout/reward_mean": "high"})
    writer.log(0, {"other/value": 1.0})
    writer.close()
    assert (tmp_path / "metrics.png").exists()
    assert (tmp_path / "summary.txt").read_text().startswith("steps logged: 1")
    assert not (tmp_path / "tb").exists()
