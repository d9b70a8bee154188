"""Rollout manager: prompts from JSONL -> groups of samples from the vLLM engines -> a RolloutBatch.

Every sample keeps what the trainer needs to learn from stale, asynchronously generated tokens:
prompt and response ids, the engine's log-prob of every token, the weight version that produced each
token, its reward, timestamps and finish reason. All requests of a batch are in flight at once
(spread over the engines by GenerationClient), and `generate_batch` is a coroutine, so batch k+1 can
be generated while the trainer works on batch k:

    manager = RolloutManager(config, client=GenerationClient(urls), tokenizer=tokenizer)
    next_batch = asyncio.create_task(manager.generate_batch(step + 1))   # in the rollout loop
    # ... or from a synchronous trainer:
    with RolloutThread(config, client=GenerationClient(urls), tokenizer=tokenizer) as rollouts:
        future = rollouts.submit(step + 1)      # concurrent.futures.Future[RolloutBatch]
        ...train on the previous batch, sync weights...
        batch = future.result()
    packed = batch.pack(pad_token_id=tokenizer.pad_token_id)   # tensors aligned with token_logprobs
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import random
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from vime.config import StrictModel
from vime.rl.data import DIGIT_REPEAT_TRAIN, PromptRecord, load_prompts
from vime.rl.rewards import RewardFn, load_reward_fn
from vime.rollout.generation import GenerationClient, GenerationResult, SamplingConfig

logger = logging.getLogger(__name__)


# vLLM's weight-version label until the first labelled update.
INITIAL_WEIGHT_LABEL = "default"


class RolloutConfig(StrictModel):
    """What to generate each RL step and how."""

    prompts_path: str = Field(
        str(DIGIT_REPEAT_TRAIN),
        description="JSONL prompt file ({'prompt': ..., ...} per line); default: built-in task.",
    )
    reward_fn: str = Field(
        "vime.rl.rewards:digit_match",
        description="Dotted path 'module:function' of fn(prompt, completion, metadata) -> float.",
    )
    # 32 x 8 (lr 2e-3, 8 tokens) lifts qwen2-tiny on the digit task from 0.07 to 0.4 in 110-150
    # steps; 16 x 8 is slower and noisier, and at higher lr collapses onto one string for all.
    num_prompts_per_step: int = Field(32, ge=1, description="Prompts (groups) per batch.")
    num_samples_per_prompt: int = Field(
        8, ge=1, description="Samples per prompt: the GRPO group size."
    )
    max_tokens: int = Field(8, ge=1, description="Most tokens generated per sample.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (1.0: the policy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1.0 samples the policy.")
    top_k: int = Field(-1, description="Top-k sampling; -1 samples the policy.")
    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="Cap on concurrent requests over all engines; None: the whole batch.",
    )
    max_aborted_retries: int = Field(
        3, ge=0, description="Resubmit a request the engine aborted (abort-mode pause) this often."
    )
    shuffle_seed: int = Field(0, description="Seed of the per-epoch prompt order.")
    unlabelled_version: int = Field(
        0,
        description=(
            "Weight version of tokens generated before any labelled weight update (vLLM labels "
            "them 'default' or None), i.e. on the initial weights."
        ),
    )


def parse_weight_version(version: str | int | None, unlabelled_version: int = 0) -> int:
    """The integer weight version of an engine label: "7" -> 7; None, and vLLM's "default" (the
    weights loaded at start-up), -> unlabelled_version.

    A failed sync labels tokens "<version>-failed" (weights possibly half new): that parses to the
    version it was updating to; `RolloutSample.on_failed_sync` records that it happened.
    """
    if version is None or version == INITIAL_WEIGHT_LABEL:
        return unlabelled_version
    if isinstance(version, int):
        return version
    text = version.removesuffix("-failed")
    if not text.lstrip("-").isdigit():
        raise ValueError(
            f"weight version label {version!r} is not an integer (or '<int>-failed'); "
            "the trainer must label weight updates with integer versions"
        )
    return int(text)


@dataclass
class RolloutSample:
    """One completion of one prompt, with everything the loss and the staleness metrics need."""

    prompt_id: str
    group_index: int  # index of the prompt (group) in the batch
    sample_index: int  # index within the group
    prompt_text: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    rollout_logprobs: list[float]
    weight_versions: list[int]  # one per response token
    completion_text: str
    reward: float
    finish_reason: str | None
    start_time: float
    end_time: float
    engine_url: str
    metadata: dict[str, Any] = field(default_factory=dict)
    on_failed_sync: bool = False
    num_aborted_retries: int = 0

    @property
    def oldest_version(self) -> int | None:
        return min(self.weight_versions) if self.weight_versions else None

    @property
    def version_span(self) -> int:
        """Newest minus oldest weight version among the tokens (0: one policy made them all)."""
        if not self.weight_versions:
            return 0
        return max(self.weight_versions) - min(self.weight_versions)

    def lag(self, trainer_version: int) -> int:
        """How many versions the oldest token is behind the trainer's current version."""
        oldest = self.oldest_version
        return 0 if oldest is None else trainer_version - oldest


def staleness_metrics(samples: Sequence[RolloutSample], trainer_version: int) -> dict[str, float]:
    """Mean/max version span within samples, and their lag behind `trainer_version`."""
    spans = [sample.version_span for sample in samples]
    lags = [sample.lag(trainer_version) for sample in samples if sample.weight_versions]
    token_lags = [trainer_version - v for sample in samples for v in sample.weight_versions]
    return {
        "staleness/version_span_mean": statistics.fmean(spans) if spans else 0.0,
        "staleness/version_span_max": float(max(spans, default=0)),
        "staleness/mixed_version_fraction": (
            sum(span > 0 for span in spans) / len(spans) if spans else 0.0
        ),
        "staleness/lag_mean": statistics.fmean(lags) if lags else 0.0,
        "staleness/lag_max": float(max(lags, default=0)),
        "staleness/token_lag_mean": statistics.fmean(token_lags) if token_lags else 0.0,
    }


@dataclass
class PackedBatch:
    """A batch as tensors aligned with `token_logprobs(model, input_ids)` ([batch, seq - 1]).

    Row i is prompt + response + padding; position t of the [batch, seq - 1] tensors scores
    input_ids[i, t + 1], so the mask is 1 exactly on response tokens.
    """

    input_ids: torch.Tensor  # [batch, seq] int64
    loss_mask: torch.Tensor  # [batch, seq - 1] float32
    rollout_logprobs: torch.Tensor  # [batch, seq - 1] float32, 0 where mask is 0
    rewards: torch.Tensor  # [batch] float32
    group_size: int
    token_versions: torch.Tensor | None = None  # [batch, seq - 1] int64, -1 where mask is 0


@dataclass
class RolloutBatch:
    """All samples of one step; group g is samples[g * group_size : (g + 1) * group_size]."""

    step: int
    samples: list[RolloutSample]
    group_size: int
    start_time: float
    end_time: float

    @property
    def rewards(self) -> list[float]:
        return [sample.reward for sample in self.samples]

    def write_jsonl(self, path: str | Path, trainer_version: int | None = None) -> None:
        """Append one line per sample (ids, log-probs, versions, reward, text) for inspection."""
        with Path(path).open("a") as out:
            for sample in self.samples:
                row = {"step": self.step, **asdict(sample)}
                if trainer_version is not None:
                    row["lag"] = sample.lag(trainer_version)
                out.write(json.dumps(row) + "\n")

    def pack(self, pad_token_id: int) -> PackedBatch:
        rows = [s.prompt_token_ids + s.response_token_ids for s in self.samples]
        seq_len = max(len(row) for row in rows)
        batch = len(rows)
        input_ids = torch.full((batch, seq_len), pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(batch, seq_len - 1)
        rollout_logprobs = torch.zeros(batch, seq_len - 1)
        token_versions = torch.full((batch, seq_len - 1), -1, dtype=torch.long)
        for i, (row, sample) in enumerate(zip(rows, self.samples, strict=True)):
            input_ids[i, : len(row)] = torch.tensor(row)
            start = len(sample.prompt_token_ids) - 1
            end = start + len(sample.response_token_ids)
            loss_mask[i, start:end] = 1.0
            rollout_logprobs[i, start:end] = torch.tensor(sample.rollout_logprobs)
            token_versions[i, start:end] = torch.tensor(sample.weight_versions, dtype=torch.long)
        return PackedBatch(
            input_ids=input_ids,
            loss_mask=loss_mask,
            rollout_logprobs=rollout_logprobs,
            rewards=torch.tensor(self.rewards, dtype=torch.float32),
            group_size=self.group_size,
            token_versions=token_versions,
        )

    def metrics(self, trainer_version: int | None = None) -> dict[str, float]:
        """Reward, length, throughput and (given the trainer's version) staleness metrics."""
        rewards = self.rewards
        lengths = [len(s.response_token_ids) for s in self.samples]
        groups = [
            rewards[start : start + self.group_size]
            for start in range(0, len(rewards), self.group_size)
        ]
        duration = max(self.end_time - self.start_time, 1e-9)
        metrics = {
            "rollout/reward_mean": statistics.fmean(rewards),
            "rollout/reward_std": statistics.pstdev(rewards),
            "rollout/reward_max": max(rewards),
            "rollout/solved_fraction": sum(r >= 1.0 for r in rewards) / len(rewards),
            "rollout/zero_variance_groups": sum(max(g) == min(g) for g in groups) / len(groups),
            "rollout/response_len_mean": statistics.fmean(lengths),
            "rollout/truncated_fraction": (
                sum(s.finish_reason == "length" for s in self.samples) / len(self.samples)
            ),
            "rollout/aborted_retries": float(sum(s.num_aborted_retries for s in self.samples)),
            "rollout/time_s": duration,
            "rollout/tokens_per_s": sum(lengths) / duration,
        }
        if trainer_version is not None:
            metrics.update(staleness_metrics(self.samples, trainer_version))
        return metrics


class RolloutManager:
    """Turns steps into RolloutBatches: picks prompts, samples groups, scores them.

    Use it from one event loop (the GenerationClient's HTTP session belongs to it).
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        client: GenerationClient,
        tokenizer: Any,
        prompts: Sequence[PromptRecord] | None = None,
        reward_fn: RewardFn | None = None,
    ):
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.prompts = list(prompts) if prompts is not None else load_prompts(config.prompts_path)
        self.reward_fn = reward_fn or load_reward_fn(config.reward_fn)
        self._prompt_ids = [tokenizer(p.prompt).input_ids for p in self.prompts]
        self.sampling = SamplingConfig(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
        )
        self._limit = asyncio.Semaphore(config.max_in_flight) if config.max_in_flight else None
        self._order: list[int] = []
        self._order_epoch = -1

    def prompt_indices(self, step: int) -> list[int]:
        """Prompts of `step`: a slice of a per-epoch shuffle (a step always gets the same ones)."""
        count = self.config.num_prompts_per_step
        indices = []
        for position in range(step * count, (step + 1) * count):
            epoch, offset = divmod(position, len(self.prompts))
            indices.append(self._epoch_order(epoch)[offset])
        return indices

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self.prompts)))
            random.Random(self.config.shuffle_seed * 1_000_003 + epoch).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    async def generate_batch(self, step: int) -> RolloutBatch:
        """Generate num_prompts_per_step groups of num_samples_per_prompt samples, all in flight."""
        group_size = self.config.num_samples_per_prompt
        start_time = time.time()
        coroutines = [
            self._sample(prompt_index, group_index, sample_index)
            for group_index, prompt_index in enumerate(self.prompt_indices(step))
            for sample_index in range(group_size)
        ]
        samples = list(await asyncio.gather(*coroutines))
        batch = RolloutBatch(
            step=step,
            samples=samples,
            group_size=group_size,
            start_time=start_time,
            end_time=time.time(),
        )
        logger.info(
            "step %d: %d samples in %.1f s, reward %.3f",
            step,
            len(samples),
            batch.end_time - start_time,
            batch.metrics()["rollout/reward_mean"],
        )
        return batch

    async def _generate(self, prompt_ids: list[int]) -> tuple[GenerationResult, int]:
        """Generate, resubmitting aborted requests; after max_aborted_retries the aborted (possibly
        empty) result is kept: its finish_reason says "abort" and it adds no tokens to the loss."""
        retries = 0
        while True:
            if self._limit is None:
                result = await self.client.generate(prompt_ids, self.sampling)
            else:
                async with self._limit:
                    result = await self.client.generate(prompt_ids, self.sampling)
            if not result.aborted or retries >= self.config.max_aborted_retries:
                return result, retries
            retries += 1

    async def _sample(
        self, prompt_index: int, group_index: int, sample_index: int
    ) -> RolloutSample:
        record = self.prompts[prompt_index]
        result, retries = await self._generate(self._prompt_ids[prompt_index])
        completion = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        reward = self.reward_fn(record.prompt, completion, record.metadata)
        if (
            isinstance(reward, bool)
            or not isinstance(reward, (int, float))
            or not math.isfinite(reward)
        ):
            raise ValueError(
                f"reward function {self.config.reward_fn} returned {reward!r} for prompt "
                f"{record.id!r}; it must return a finite float"
            )
        return RolloutSample(
            prompt_id=record.id,
            group_index=group_index,
            sample_index=sample_index,
            prompt_text=record.prompt,
            prompt_token_ids=list(result.prompt_token_ids),
            response_token_ids=list(result.token_ids),
            rollout_logprobs=list(result.logprobs),
            weight_versions=[
                parse_weight_version(v, self.config.unlabelled_version)
                for v in result.weight_versions
            ],
            completion_text=completion,
            reward=float(reward),
            finish_reason=result.finish_reason,
            start_time=result.start_time,
            end_time=result.end_time,
            engine_url=result.engine_url,
            metadata=dict(record.metadata),
            on_failed_sync=any(
                isinstance(v, str) and v.endswith("-failed") for v in result.weight_versions
            ),
            num_aborted_retries=retries,
        )


class RolloutThread:
    """A RolloutManager on its own event loop thread, for a synchronous (torch.distributed) trainer.

    `submit(step)` returns a concurrent.futures.Future at once; generation proceeds while the
    caller trains. `close()` (or leaving the `with` block) cancels pending batches and closes the
    client.
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        client: GenerationClient,
        tokenizer: Any,
        prompts: Sequence[PromptRecord] | None = None,
        reward_fn: RewardFn | None = None,
    ):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vime-rollout", daemon=True
        )
        self._thread.start()
        # The client's HTTP session is created on first use, so inside this thread's loop.
        self.client = client

        async def build() -> RolloutManager:
            return RolloutManager(
                config,
                client=self.client,
                tokenizer=tokenizer,
                prompts=prompts,
                reward_fn=reward_fn,
            )

        self.manager = asyncio.run_coroutine_threadsafe(build(), self._loop).result()
        self._pending: set[concurrent.futures.Future] = set()

    def submit(self, step: int) -> concurrent.futures.Future[RolloutBatch]:
        future = asyncio.run_coroutine_threadsafe(self.manager.generate_batch(step), self._loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        for future in list(self._pending):
            future.cancel()
        asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> RolloutThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
