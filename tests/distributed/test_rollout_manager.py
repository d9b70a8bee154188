"""RolloutManager against a real vLLM CPU server (qwen2-tiny): groups, log-probs, versions, rewards.

One engine for the module. The engine's log-probs are checked against the same checkpoint scored by
transformers, the baseline the trainer's "log-prob diff" metric is read against.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from vime.config import RolloutConfig
from vime.engines.generation import GenerationClient
from vime.rl.data import DIGIT_REPEAT_TRAIN
from vime.rl.rollout import RolloutManager, RolloutThread

pytestmark = pytest.mark.distributed

NUM_PROMPTS = 4
GROUP_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(model_builder):
    return model_builder("qwen2-tiny")


@pytest.fixture(scope="module")
def engine(engine_pool):
    """The session's shared shm engine (reset to the checkpoint): generation needs no more."""
    return engine_pool.get("shm")["shm"]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def rollout_config(**overrides) -> RolloutConfig:
    fields = dict(
        prompts_path=str(DIGIT_REPEAT_TRAIN),
        num_prompts_per_step=NUM_PROMPTS,
        num_samples_per_prompt=GROUP_SIZE,
        max_tokens=16,
    )
    return RolloutConfig(**{**fields, **overrides})


async def generate(engine, tokenizer, step, **overrides):
    async with GenerationClient([engine.url], token=engine.auth_token) as client:
        manager = RolloutManager(rollout_config(**overrides), client=client, tokenizer=tokenizer)
        return await manager.generate_batch(step)


def test_batch_of_groups_from_a_real_engine(engine, tokenizer, model_dir):
    batch = asyncio.run(generate(engine, tokenizer, step=0))
    assert len(batch.samples) == NUM_PROMPTS * GROUP_SIZE
    for position, sample in enumerate(batch.samples):
        group, index = divmod(position, GROUP_SIZE)
        assert (sample.group_index, sample.sample_index) == (group, index)
        assert sample.prompt_id == batch.samples[group * GROUP_SIZE].prompt_id
        assert sample.prompt_token_ids == tokenizer(sample.prompt_text).input_ids
        assert sample.finish_reason in ("stop", "length")
        num_tokens = len(sample.response_token_ids)
        assert 1 <= num_tokens <= 16
        assert num_tokens == 16 or sample.response_token_ids[-1] == tokenizer.eos_token_id
        assert len(sample.rollout_logprobs) == num_tokens
        assert all(logprob <= 0 for logprob in sample.rollout_logprobs)
        # Never-updated engine: every token is on the initial weights ("default" -> version 0).
        assert sample.weight_versions == [0] * num_tokens
        assert sample.version_span == 0 and sample.lag(2) == 2
        assert 0.0 <= sample.reward <= 1.0
        assert sample.start_time <= sample.end_time <= batch.end_time
        assert sample.engine_url == engine.url
    # Sampling at temperature 1: samples of a group differ.
    assert len({tuple(s.response_token_ids) for s in batch.samples[:GROUP_SIZE]}) > 1
    metrics = batch.metrics(trainer_version=0)
    assert 0.0 <= metrics["rollout/reward_mean"] < 0.5
    assert metrics["staleness/lag_max"] == 0

    # The engine's log-probs are those of the checkpoint: score the packed batch with transformers.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    packed = batch.pack(pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(packed.input_ids).logits[:, :-1].float()
    hf_logprobs = torch.log_softmax(logits, -1).gather(-1, packed.input_ids[:, 1:, None])[..., 0]
    mask = packed.loss_mask.bool()
    diff = (hf_logprobs[mask] - packed.rollout_logprobs[mask]).abs()
    assert diff.mean() < 1e-3, f"engine vs transformers log-prob diff {diff.mean():.2e}"


def test_labelled_weight_version_and_lag(engine, tokenizer):
    engine.update_weight_version(3)
    try:
        batch = asyncio.run(generate(engine, tokenizer, step=1))
    finally:
        engine.update_weight_version(0)
    assert all(s.weight_versions == [3] * len(s.response_token_ids) for s in batch.samples)
    metrics = batch.metrics(trainer_version=5)
    assert metrics["staleness/lag_mean"] == 2 and metrics["staleness/version_span_max"] == 0


def test_thread_generates_while_caller_works(engine, tokenizer):
    config = rollout_config(max_tokens=32)
    client = GenerationClient([engine.url], token=engine.auth_token)
    with RolloutThread(RolloutManager(config, client=client, tokenizer=tokenizer)) as rollouts:
        submitted = time.time()
        future = rollouts.submit(step=2)
        assert not future.done()  # submit returns before generation
        busy = torch.zeros(256, 256)
        while not future.done():  # the "trainer" keeps working meanwhile
            busy = busy @ busy.t() * 0
        batch = future.result(timeout=60)
    assert batch.step == 2 and len(batch.samples) == NUM_PROMPTS * GROUP_SIZE
    assert min(s.start_time for s in batch.samples) >= submitted
