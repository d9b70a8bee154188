"""The supervised warm start's data: demonstrations, batches and the loss mask's alignment."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from vime.config import SFTConfig
from vime.rl.data import DATA_DIR, digit_repeat_demonstrations, load_demonstrations, load_prompts
from vime.rl.metrics import MetricsWriter
from vime.rl.rewards import digit_match
from vime.rl.sft import sft_batch

pytestmark = pytest.mark.unit

SHIPPED = DATA_DIR / "digit_repeat" / "sft.jsonl"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _decoded(tokenizer, input_ids, mask) -> list[tuple[str, str]]:
    """(prompt, completion) of every row, read back through the mask; checks the EOS target."""
    pairs = []
    for row, row_mask in zip(input_ids.tolist(), mask.tolist(), strict=True):
        # Position t of the mask scores token t + 1: the masked targets are completion + EOS.
        targets = [token for token, on in zip(row[1:], row_mask, strict=True) if on]
        assert targets[-1] == tokenizer.eos_token_id
        prompt_len = row_mask.index(1.0) + 1
        assert all(row_mask[prompt_len - 1 : prompt_len - 1 + len(targets)])
        pairs.append((tokenizer.decode(row[:prompt_len]), tokenizer.decode(targets[:-1])))
    return pairs


def test_mask_covers_exactly_the_completion_and_its_end_token(tokenizer):
    records = load_demonstrations(str(SHIPPED))
    config = SFTConfig(data_path=str(SHIPPED), num_steps=1, batch_size=8)
    input_ids, mask = sft_batch(records, 0, config, tokenizer)
    assert input_ids.shape[0] == 8 and mask.shape == (8, input_ids.shape[1] - 1)
    assert int(mask.sum()) == sum(len(c) + 1 for _, c in _decoded(tokenizer, input_ids, mask))
    shipped = {(r.prompt, r.metadata["completion"]) for r in records}
    assert set(_decoded(tokenizer, input_ids, mask)) <= shipped


def test_batches_visit_every_demonstration_once_per_epoch_in_a_seeded_order(tokenizer):
    records = load_demonstrations(str(SHIPPED))[:40]
    config = SFTConfig(data_path="x", num_steps=1, batch_size=8, seed=3)
    seen: Counter = Counter()
    for step in range(5):  # 40 / 8: one epoch
        seen.update(_decoded(tokenizer, *sft_batch(records, step, config, tokenizer)))
    assert seen == Counter((r.prompt, r.metadata["completion"]) for r in records)
    first, _ = sft_batch(records, 0, config, tokenizer)
    again, _ = sft_batch(records, 0, config, tokenizer)
    next_epoch, _ = sft_batch(records, 5, config, tokenizer)
    assert first.tolist() == again.tolist() and first.tolist() != next_epoch.tolist()


def test_missing_completion_is_named(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt": "Q: 1 A:", "digit": "1"}) + "\n")
    with pytest.raises(ValueError, match="demonstration 'a' needs a non-empty string field"):
        load_demonstrations(str(path))


def test_shipped_demonstrations_are_right_but_often_stop_early():
    """The imperfect demonstrator behind the main job's SFT -> RL margin: every demonstration
    writes the right digit, between 4 and 8 times; digit_match asks for 8."""
    records = load_prompts(SHIPPED)
    assert len(records) == 256
    assert [r.metadata for r in records] == [
        {k: v for k, v in row.items() if k not in ("id", "prompt")}
        for row in digit_repeat_demonstrations(256, seed=2)
    ]
    lengths = Counter(len(r.metadata["completion"]) for r in records)
    assert set(lengths) == {4, 5, 6, 7, 8}
    for record in records:
        completion = record.metadata["completion"]
        assert set(completion) == {record.metadata["digit"]}
        assert digit_match(record.prompt, completion, record.metadata) == len(completion) / 8


def test_sft_is_off_unless_data_and_steps_are_given():
    assert not SFTConfig().enabled
    assert not SFTConfig(data_path="x").enabled
    assert SFTConfig(data_path="x", num_steps=1).enabled


def test_summary_names_the_model_behind_each_evaluation(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(0, {"rollout/reward_mean": 0.5})
        writer.log_eval(0, {"eval/pass_at_1": 0.0}, stage="before")
        writer.log_eval(0, {"eval/pass_at_1": 0.6}, stage="after_sft")
        writer.log_eval(1, {"eval/pass_at_1": 1.0}, stage="after")
    summary = (tmp_path / "summary.txt").read_text()
    assert (
        "held-out greedy pass@1: 0.000 initial model (before step 0), 0.600 after SFT "
        "(before step 0), 1.000 after RL (before step 1)"
    ) in summary
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [row["stage"] for row in rows] == ["before", "after_sft", "after"]


def test_batch_larger_than_the_demonstrations_is_refused(tokenizer):
    records = load_demonstrations(str(SHIPPED))[:10]
    config = SFTConfig(data_path="demos.jsonl", num_steps=1, batch_size=32)
    with pytest.raises(ValueError, match="sft.batch_size=32 exceeds the 10 demonstrations"):
        sft_batch(records, 0, config, tokenizer)


def test_a_resumed_jobs_first_evaluation_is_not_called_the_initial_model(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log_eval(2, {"eval/pass_at_1": 0.5}, stage="resumed")
    assert "0.500 resumed checkpoint (before step 2)" in (tmp_path / "summary.txt").read_text()
