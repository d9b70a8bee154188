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


def test_held_out_evaluations_are_kept_apart_plotted_and_summarised(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log_eval(0, {"eval/pass_at_1": 0.25, "eval/num_prompts": 4})
        writer.log(0, {"rollout/reward_mean": 0.5})
        writer.log_eval(1, {"eval/pass_at_1": 0.75, "eval/num_prompts": 4})
        assert writer.series("eval/pass_at_1") == ([0, 1], [0.25, 0.75])
    # Per-step rows stay one per step; evaluations go to eval.jsonl.
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2
    summary = (tmp_path / "summary.txt").read_text()
    assert "held-out greedy pass@1: 0.250 before step 0, 0.750 before step 1" in summary
    # A resumed job's writer reads both back (a killed run's cut last line is dropped).
    with (tmp_path / "metrics.jsonl").open("a") as out:
        out.write('{"step": 1, "rollout/rew')
    resumed = MetricsWriter(tmp_path, tensorboard=False, resume=True)
    resumed.log(1, {"rollout/reward_mean": 0.6})
    resumed.close()
    assert resumed.series("rollout/reward_mean") == ([0, 1], [0.5, 0.6])
    assert resumed.series("eval/pass_at_1")[1] == [0.25, 0.75]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["rollout/reward_mean"] == 0.6


def test_eval_config_is_one_greedy_pass_over_every_prompt():
    from vime.config import EvalConfig, RolloutConfig

    rollout = RolloutConfig(num_samples_per_prompt=8, temperature=1.0, max_tokens=8)
    config = EvalConfig(prompts_path="target_digit/test.jsonl").rollout_config(rollout, 100)
    assert (config.num_prompts_per_step, config.num_samples_per_prompt) == (100, 1)
    assert (config.temperature, config.max_tokens) == (0.0, 8)


def test_checkpoint_schedule_and_resume_path(tmp_path):
    from vime.config import CheckpointConfig

    every = CheckpointConfig(every_steps=2, at_end=False)
    assert [n for n in range(1, 6) if every.due(n, 5)] == [2, 4]
    assert [n for n in range(1, 6) if CheckpointConfig().due(n, 5)] == [5]
    root = tmp_path / "checkpoints"
    (root / "step_2").mkdir(parents=True)
    (root / "step_2" / "metadata.json").write_text("{}")
    (root / "step_4").mkdir()  # killed mid-save: no metadata.json
    assert CheckpointConfig(resume=True).resume_path(tmp_path) == root / "step_2"
    assert CheckpointConfig().resume_path(tmp_path) is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        CheckpointConfig(resume=str(root / "step_4")).resume_path(tmp_path)
    (root / "step_4" / "metadata.json").write_text("{}")
    with pytest.raises(ValueError, match=r"older than checkpoints \['step_4'\]"):
        CheckpointConfig(resume=str(root / "step_2")).resume_path(tmp_path)


def test_a_resumed_run_drops_the_rows_it_writes_again(tmp_path):
    from vime.rl.metrics import drop_rows_from, read_rows

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "cut')
    drop_rows_from(path, 2)
    assert read_rows(path) == [{"step": 0}, {"step": 1}]
    drop_rows_from(tmp_path / "absent.jsonl", 2)  # nothing to do


def test_a_fresh_run_in_a_used_run_dir_shows_only_its_own_rows(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as first:
        first.log(0, {"rollout/reward_mean": 0.1})
        first.log_eval(0, {"eval/pass_at_1": 0.5})
    second = MetricsWriter(tmp_path, tensorboard=False)
    second.log(0, {"rollout/reward_mean": 0.9})
    second.close()
    assert second.series("rollout/reward_mean") == ([0], [0.9])
    assert second.series("eval/pass_at_1") == ([], [])
    assert "steps logged: 1" in (tmp_path / "summary.txt").read_text()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # appended, as before
