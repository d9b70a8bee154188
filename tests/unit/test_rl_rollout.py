"""Rollout manager without engines: prompt files, grouping, staleness, packing, the thread API."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import pytest
import torch

from vime.config import RolloutConfig
from vime.engines.generate_api import GenerationResult
from vime.rl.data import (
    DIGIT_REPEAT_TEST,
    DIGIT_REPEAT_TRAIN,
    PromptRecord,
    load_prompts,
    make_digit_repeat,
)
from vime.rl.rewards import digit_match
from vime.rl.rollout import RolloutManager, RolloutThread
from vime.rl.samples import RolloutSample, parse_weight_version, staleness_metrics

pytestmark = pytest.mark.unit


class CharTokenizer:
    """ids are code points; 0 is the end-of-text token."""

    pad_token_id = 0

    def __call__(self, text):
        class Encoded:
            input_ids = [ord(char) for char in text]

        return Encoded()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


class FakeClient:
    """Answers each request after a short sleep; counts concurrency; can abort first attempts."""

    def __init__(self, *, versions=("3", "4"), num_aborts=0, num_cached_tokens=None):
        self.versions = versions
        self.num_cached_tokens = num_cached_tokens
        self.num_aborts = num_aborts
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls = 0
        self.counter = itertools.count()
        self.closed = False
        self.salts: list[str | None] = []
        self.affinities: list[str | None] = []
        self.released: list[str] = []

    async def generate(self, prompt_token_ids, sampling, cache_salt=None, affinity=None):
        self.salts.append(cache_salt)
        self.affinities.append(affinity)
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        start = time.time()
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        index = next(self.counter)
        if self.calls <= self.num_aborts:
            return GenerationResult(
                "r",
                "fake",
                list(prompt_token_ids),
                [ord("7")],
                [-0.1],
                ["3"],
                "abort",
                start,
                time.time(),
            )
        # The target digit is the prompt's last digit character; every other sample hits it.
        digit = next(chr(i) for i in reversed(prompt_token_ids) if chr(i).isdigit())
        text = digit * 4 if index % 2 == 0 else "x" * 4
        tokens = [ord(char) for char in text] + [0]
        versions = [self.versions[0]] * 2 + [self.versions[1]] * 3
        return GenerationResult(
            f"r{index}",
            "http://fake",
            list(prompt_token_ids),
            tokens,
            [-0.5] * 5,
            versions,
            "stop",
            start,
            time.time(),
            num_cached_tokens=self.num_cached_tokens,
        )

    def release(self, affinity):
        self.released.append(affinity)

    def occupied_seconds(self):
        return 0.0

    def serving(self):
        return [0]

    async def close(self):
        self.closed = True


PROMPTS = [
    PromptRecord(id=f"p{d}", prompt=f"Q: write {d} A:", metadata={"digit": str(d)})
    for d in range(5)
]


def make_manager(client, **overrides):
    config = RolloutConfig(
        prompts_path="unused.jsonl", num_prompts_per_step=3, num_samples_per_prompt=4, **overrides
    )
    return RolloutManager(config, client=client, tokenizer=CharTokenizer(), prompts=PROMPTS)


def test_built_in_task_files_load():
    train, test = load_prompts(DIGIT_REPEAT_TRAIN), load_prompts(DIGIT_REPEAT_TEST)
    assert len(train) == 500 and len(test) == 100
    for record in train[:20]:
        assert record.metadata["digit"] in record.prompt
        assert digit_match(record.prompt, record.metadata["digit"] * 8, record.metadata) == 1.0
    assert make_digit_repeat(10, seed=0) == make_digit_repeat(10, seed=0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a"}\n{"prompt": \n', "bad.jsonl:2: not valid JSON"),
        ('["a"]\n', "bad.jsonl:1: expected a JSON object, got list"),
        ('{"text": "a"}\n', "bad.jsonl:1: needs a non-empty string field 'prompt'"),
        ('{"prompt": ""}\n', "bad.jsonl:1: needs a non-empty string field 'prompt'"),
        ('{"id": 1, "prompt": "a"}\n\n{"id": "1", "prompt": "b"}\n', "bad.jsonl:3: id '1' already"),
        ("\n\n", "has no prompts"),
    ],
)
def test_load_prompts_errors(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    assert message in str(info.value)


def test_load_prompts_metadata_and_missing_file(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps({"prompt": "Q", "digit": "3", "extra": [1]}) + "\n")
    (record,) = load_prompts(path)
    assert record == PromptRecord(id="1", prompt="Q", metadata={"digit": "3", "extra": [1]})
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")


def test_parse_weight_version():
    assert parse_weight_version(None) == 0
    assert parse_weight_version("default") == 0
    assert parse_weight_version(None, unlabelled_version=5) == 5
    assert parse_weight_version("12") == 12
    assert parse_weight_version("12-failed") == 12
    with pytest.raises(ValueError, match="'v2' is not an integer"):
        parse_weight_version("v2")


def sample_with_versions(versions):
    return RolloutSample(
        prompt_id="p",
        group_index=0,
        sample_index=0,
        prompt_text="",
        prompt_token_ids=[1],
        response_token_ids=[2] * len(versions),
        rollout_logprobs=[0.0] * len(versions),
        weight_versions=list(versions),
        completion_text="",
        reward=0.0,
        finish_reason="stop",
        start_time=0.0,
        end_time=1.0,
        engine_url="",
    )


def test_staleness_hand_computed():
    samples = [sample_with_versions(v) for v in ([3, 3, 4, 5], [5, 5], [2], [])]
    assert [s.version_span for s in samples] == [2, 0, 0, 0]
    assert [s.lag(6) for s in samples] == [3, 1, 4, 0]
    metrics = staleness_metrics(samples, trainer_version=6)
    assert metrics["staleness/version_span_mean"] == pytest.approx(0.5)
    assert metrics["staleness/version_span_max"] == 2
    assert metrics["staleness/mixed_version_fraction"] == pytest.approx(0.25)
    assert metrics["staleness/lag_mean"] == pytest.approx((3 + 1 + 4) / 3)  # empty sample skipped
    assert metrics["staleness/lag_max"] == 4
    assert metrics["staleness/token_lag_mean"] == pytest.approx((3 + 3 + 2 + 1 + 1 + 1 + 4) / 7)
    # The histogram: one sample each 1, 3 and 4 versions behind.
    lags = {k: v for k, v in metrics.items() if k.startswith("staleness/samples_lag_")}
    assert lags == {f"staleness/samples_lag_{k}": 1.0 for k in (1, 3, 4)}


def test_samples_beyond_the_staleness_bound_stay_in_their_group_but_not_in_the_loss():
    from vime.rl.samples import RolloutBatch

    samples = [sample_with_versions(v) for v in ([3, 3, 4, 5], [5, 5], [2], [6])]
    for index, sample in enumerate(samples):
        sample.reward = float(index)
    batch = RolloutBatch(step=0, samples=samples, group_size=4, start_time=0.0, end_time=1.0)
    assert batch.too_stale(trainer_version=6, max_lag=2) == [0, 2]  # 3 and 4 behind
    packed = batch.pack(pad_token_id=0, leave_out=batch.too_stale(trainer_version=6, max_lag=2))
    assert packed.loss_mask.sum(dim=1).tolist() == [0.0, 2.0, 0.0, 1.0]
    assert packed.rewards.tolist() == [0.0, 1.0, 2.0, 3.0]  # the group's baseline keeps them
    assert batch.pack(pad_token_id=0).loss_mask.sum().item() == 4 + 2 + 1 + 1


def test_generate_batch_groups_rewards_and_records():
    client = FakeClient()
    manager = make_manager(client)
    batch = asyncio.run(manager.generate_batch(step=0))
    assert len(batch.samples) == 12 and batch.group_size == 4
    assert client.max_in_flight == 12  # the whole batch in flight at once
    for position, sample in enumerate(batch.samples):
        assert (sample.group_index, sample.sample_index) == divmod(position, 4)
        group_prompt = batch.samples[sample.group_index * 4].prompt_id
        assert sample.prompt_id == group_prompt
        assert sample.prompt_token_ids == CharTokenizer()(sample.prompt_text).input_ids
        assert len(sample.response_token_ids) == len(sample.rollout_logprobs) == 5
        assert sample.weight_versions == [3, 3, 4, 4, 4]
        assert sample.version_span == 1 and sample.lag(4) == 1
        assert sample.reward in (0.0, 0.5)  # "dddd" -> 4/8, "xxxx" -> 0
        assert sample.end_time >= sample.start_time
    metrics = batch.metrics(trainer_version=5)
    assert metrics["rollout/reward_mean"] == pytest.approx(0.25)
    assert metrics["staleness/lag_mean"] == 2
    assert metrics["rollout/truncated_fraction"] == 0


def test_a_group_is_routed_as_one_and_released_when_done():
    """routing: group gives each group's samples (and their retries) one affinity key, a new key
    per group and batch, released once the group is done; routing: sample gives none."""
    client = FakeClient(num_aborts=2)
    asyncio.run(make_manager(client, max_in_flight=1).generate_batch(0))  # first two aborted
    keys = list(client.affinities)
    assert keys[0] == keys[1] == keys[2]  # a sample's retries keep its group's key
    assert None not in keys and len(keys) == 12 + 2  # two retries of aborted samples
    assert len(set(keys)) == 3 and sorted(client.released) == sorted(set(keys))
    asyncio.run(make_manager(client).generate_batch(0))
    assert not set(client.affinities[14:]) & set(keys)  # another batch, other keys
    client = FakeClient()
    asyncio.run(make_manager(client, routing="sample").generate_batch(0))
    assert client.affinities == [None] * 12 and client.released == []


def test_prompt_cache_hit_rate_is_cached_over_prompt_tokens():
    prompt_len = len(CharTokenizer()(PROMPTS[0].prompt).input_ids)
    client = FakeClient(num_cached_tokens=prompt_len // 2)
    metrics = asyncio.run(make_manager(client).generate_batch(0)).metrics()
    assert metrics["rollout/prompt_cache_hit_rate"] == pytest.approx(
        (prompt_len // 2) / prompt_len, rel=0.2
    )
    unknown = asyncio.run(make_manager(FakeClient()).generate_batch(0)).metrics()
    assert "rollout/prompt_cache_hit_rate" not in unknown


def test_prompt_order_is_per_epoch_shuffle_and_deterministic():
    manager = make_manager(FakeClient())
    first_epoch = manager.prompt_indices(0) + manager.prompt_indices(1)[:2]
    assert sorted(first_epoch) == list(range(5))  # 5 prompts, 3 per step: epoch ends mid-step 1
    assert manager.prompt_indices(7) == make_manager(FakeClient()).prompt_indices(7)


def test_max_in_flight_and_aborted_retries():
    client = FakeClient(num_aborts=2)
    batch = asyncio.run(make_manager(client, max_in_flight=2).generate_batch(step=0))
    assert client.max_in_flight == 2
    assert client.calls == 14
    assert sum(s.num_aborted_retries for s in batch.samples) == 2
    assert all(s.finish_reason == "stop" for s in batch.samples)


def test_aborted_after_retries_is_kept_and_marked():
    client = FakeClient(num_aborts=100)
    batch = asyncio.run(make_manager(client, max_aborted_retries=1).generate_batch(step=0))
    assert client.calls == 24
    assert all(s.finish_reason == "abort" and s.num_aborted_retries == 1 for s in batch.samples)


def test_failed_sync_label_and_bad_reward():
    batch = asyncio.run(make_manager(FakeClient(versions=("3", "4-failed"))).generate_batch(0))
    assert all(s.on_failed_sync and s.weight_versions[-1] == 4 for s in batch.samples)

    manager = make_manager(FakeClient())
    manager.reward_fn = lambda prompt, completion, metadata: float("nan")
    with pytest.raises(ValueError, match="returned nan for prompt"):
        asyncio.run(manager.generate_batch(0))


def test_write_jsonl(tmp_path):
    batch = asyncio.run(make_manager(FakeClient()).generate_batch(step=3))
    batch.write_jsonl(tmp_path / "rollouts.jsonl", trainer_version=6)
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and rows[0]["step"] == 3 and rows[0]["lag"] == 3
    assert rows[0]["weight_versions"] == [3, 3, 4, 4, 4]


def test_pack_aligns_with_token_logprobs():
    batch = asyncio.run(make_manager(FakeClient()).generate_batch(step=0))
    packed = batch.pack(pad_token_id=0)
    first = batch.samples[0]
    num_prompt = len(first.prompt_token_ids)
    assert packed.input_ids.shape[0] == 12
    row = packed.input_ids[0].tolist()
    assert row[: num_prompt + 5] == first.prompt_token_ids + first.response_token_ids
    # Position t scores token t + 1: the mask covers exactly the response tokens.
    mask = packed.loss_mask[0]
    assert mask.sum() == 5
    assert mask[num_prompt - 1 : num_prompt + 4].tolist() == [1.0] * 5
    assert packed.rollout_logprobs[0][mask.bool()].tolist() == pytest.approx([-0.5] * 5)
    assert packed.rewards.shape == (12,) and packed.group_size == 4
    assert packed.rewards.dtype == torch.float32


def test_rollout_thread_overlaps_with_caller():
    client = FakeClient()
    config = RolloutConfig(prompts_path="unused", num_prompts_per_step=2, num_samples_per_prompt=2)
    with RolloutThread(
        RolloutManager(config, client=client, tokenizer=CharTokenizer(), prompts=PROMPTS)
    ) as thread:
        futures = [thread.submit(step) for step in range(3)]  # returns at once
        batches = [future.result(timeout=30) for future in futures]
    assert [batch.step for batch in batches] == [0, 1, 2]
    assert client.closed


def test_requests_are_salted_with_the_served_version_and_stale_prefixes_are_set_apart():
    client = FakeClient(versions=("4", "4"))
    batch = asyncio.run(make_manager(client).generate_batch(0, weight_version=4))
    assert set(client.salts) == {"vime-weights-4"}
    assert not any(s.stale_prefix for s in batch.samples)
    assert batch.metrics()["rollout/stale_prefix_fraction"] == 0.0
    # Submitted while version 3 was served, first scheduled after the sync to 4, and its prompt
    # KV partly from the cache (blocks only version-3-salted requests computed) or unknown.
    for cached in (16, None):
        client = FakeClient(versions=("4", "4"), num_cached_tokens=cached)
        batch = asyncio.run(make_manager(client).generate_batch(0, weight_version=3))
        assert all(s.stale_prefix for s in batch.samples)
        packed = batch.pack(pad_token_id=0)
        assert set(packed.token_versions[packed.loss_mask > 0].tolist()) == {-2}
        assert batch.metrics()["rollout/stale_prefix_fraction"] == 1.0
    # The same with no cached prompt token: its prompt was computed by version 4 alone.
    client = FakeClient(versions=("4", "4"), num_cached_tokens=0)
    batch = asyncio.run(make_manager(client).generate_batch(0, weight_version=3))
    assert not any(s.stale_prefix for s in batch.samples)
    assert batch.metrics()["rollout/stale_prefix_fraction"] == 0.0


def test_prompts_go_as_text_or_as_a_chat_turn(tiny_model_dir):
    from transformers import AutoTokenizer

    from vime.rl.rollout import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert prompt_ids(tokenizer, "Q: 1 A:", chat=False) == tokenizer("Q: 1 A:").input_ids
    with pytest.raises(ValueError, match="no chat template"):
        prompt_ids(tokenizer, "Q: 1 A:", chat=True)
    tokenizer.chat_template = (
        "{% for m in messages %}user: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    expected = tokenizer("user: Q: 1 A:\nassistant:", add_special_tokens=False).input_ids
    assert prompt_ids(tokenizer, "Q: 1 A:", chat=True) == expected
