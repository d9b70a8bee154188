"""Rollout manager: prompts from JSONL -> groups of samples from the vLLM engines -> a RolloutBatch.

Every sample keeps what the trainer needs to learn from stale, asynchronously generated tokens:
prompt and response ids, the engine's log-prob of every token, the weight version that produced each
token, its reward, timestamps and finish reason. All requests of a batch are in flight at once
(spread over the engines by GenerationClient), and `generate_batch` is a coroutine, so batch k+1 can
be generated while the trainer works on batch k:

    manager = RolloutManager(config, client=GenerationClient(urls), tokenizer=tokenizer)
    next_batch = asyncio.create_task(manager.generate_batch(step + 1))   # in the rollout loop
    # ... or from a synchronous trainer, the manager on a thread of its own:
    with RolloutThread(manager) as rollouts:
        future = rollouts.submit(step + 1)      # concurrent.futures.Future[RolloutBatch]
        ...train on the previous batch, sync weights...
        batch = future.result()
    packed = batch.pack(pad_token_id=tokenizer.pad_token_id)   # tensors aligned with token_logprobs

The sample and batch types live in `vime.rl.samples`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from vime.config import RolloutConfig
from vime.engines.generate_api import GenerationResult, SamplingConfig
from vime.engines.generation import GenerationClient
from vime.rl.data import PromptRecord, load_prompts, resolve_data_path
from vime.rl.rewards import RewardFn, load_reward_fn
from vime.rl.samples import (
    RolloutBatch,
    RolloutSample,
    parse_weight_version,
)

logger = logging.getLogger(__name__)


def prompt_ids(tokenizer: Any, prompt: str, *, chat: bool) -> list[int]:
    """The token ids an engine is sent for `prompt`: as text, or as one user turn of the
    tokenizer's chat template with the assistant's turn opened."""
    if not chat:
        return list(tokenizer(prompt).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "rollout.chat_template is true but the tokenizer has no chat template: set it false "
            "or give a checkpoint whose tokenizer_config/chat_template.jinja has one"
        )
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


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
        if prompts is None:
            prompts = load_prompts(resolve_data_path(config.prompts_path))
        self.prompts = list(prompts)
        self.reward_fn = reward_fn or load_reward_fn(config.reward_fn)
        self._prompt_ids = [
            prompt_ids(tokenizer, p.prompt, chat=config.chat_template) for p in self.prompts
        ]
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

    async def generate_batch(self, step: int, weight_version: int | None = None) -> RolloutBatch:
        """Generate num_prompts_per_step groups of num_samples_per_prompt samples, all in flight.
        `weight_version`: what the engines serve now (each request's cache salt)."""
        start_time = time.time()
        batch_key = uuid.uuid4().hex[:12]
        groups = [
            self._group(prompt_index, group_index, weight_version, f"{batch_key}-{group_index}")
            for group_index, prompt_index in enumerate(self.prompt_indices(step))
        ]
        samples = [sample for group in await asyncio.gather(*groups) for sample in group]
        group_size = self.config.num_samples_per_prompt
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

    async def _group(
        self, prompt_index: int, group_index: int, version: int | None, key: str
    ) -> list[RolloutSample]:
        """One group's samples, all in flight; with `routing: group` on one engine (`key`)."""
        affinity = key if self.config.routing == "group" else None
        try:
            return list(
                await asyncio.gather(
                    *(
                        self._sample(prompt_index, group_index, sample_index, version, affinity)
                        for sample_index in range(self.config.num_samples_per_prompt)
                    )
                )
            )
        finally:
            if affinity is not None:
                self.client.release(affinity)

    async def _generate(
        self, prompt_ids: list[int], salt: str | None, affinity: str | None
    ) -> tuple[GenerationResult, int]:
        """Generate, resubmitting aborted requests; after max_aborted_retries the aborted (possibly
        empty) result is kept: its finish_reason says "abort" and it adds no tokens to the loss."""
        retries = 0
        while True:
            if self._limit is None:
                result = await self.client.generate(
                    prompt_ids, self.sampling, cache_salt=salt, affinity=affinity
                )
            else:
                async with self._limit:
                    result = await self.client.generate(
                        prompt_ids, self.sampling, cache_salt=salt, affinity=affinity
                    )
            if not result.aborted or retries >= self.config.max_aborted_retries:
                return result, retries
            retries += 1

    async def _sample(
        self,
        prompt_index: int,
        group_index: int,
        sample_index: int,
        version: int | None,
        affinity: str | None = None,
    ) -> RolloutSample:
        record = self.prompts[prompt_index]
        salt = None
        if self.config.salt_by_version and version is not None:
            salt = f"vime-weights-{version}"
        result, retries = await self._generate(self._prompt_ids[prompt_index], salt, affinity)
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
            salt_version=version if salt is not None else None,
            num_cached_tokens=result.num_cached_tokens,
            routed_experts=result.routed_experts,
        )


class RolloutThread:
    """A RolloutManager on its own event loop thread, for a synchronous (torch.distributed) trainer.

    `submit(step)` returns a concurrent.futures.Future at once; generation proceeds while the
    caller trains. `close()` (or leaving the `with` block) cancels pending batches and closes the
    client.
    """

    def __init__(self, manager: RolloutManager):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vime-rollout", daemon=True
        )
        self._thread.start()
        # Only this thread's loop uses the manager from now on: its client creates its HTTP
        # session on first use, so inside this loop.
        self.manager = manager
        self.client = manager.client
        self._pending: set[concurrent.futures.Future] = set()
        self._occupancy_mark = (time.monotonic(), self.client.occupied_seconds())

    def submit(
        self, step: int, weight_version: int | None = None
    ) -> concurrent.futures.Future[RolloutBatch]:
        """Start generating step `step`'s batch; `weight_version`: what the engines serve now."""
        batch = self.manager.generate_batch(step, weight_version)
        future = asyncio.run_coroutine_threadsafe(batch, self._loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def occupancy(self) -> dict[str, float]:
        """Since the last call: the share of the time the engines had requests in flight (summed
        over engines, divided by their number), `rollout/engine_occupied_fraction`."""
        now, occupied = time.monotonic(), self.client.occupied_seconds()
        began, before = self._occupancy_mark
        self._occupancy_mark = (now, occupied)
        engines = max(len(self.client.serving()), 1)
        fraction = (occupied - before) / max(now - began, 1e-9) / engines
        return {"rollout/engine_occupied_fraction": min(fraction, 1.0)}

    def evaluate(
        self, config: RolloutConfig, weight_version: int | None = None
    ) -> concurrent.futures.Future[RolloutBatch]:
        """Every prompt of `config` once (its own prompts, sampling and reward), on this thread's
        loop and client: a held-out evaluation between steps."""

        async def run() -> RolloutBatch:
            manager = RolloutManager(config, client=self.client, tokenizer=self.manager.tokenizer)
            return await manager.generate_batch(step=0, weight_version=weight_version)

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
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
