"""Per-version KV isolation: after a sync that left the prefix cache as it was, a new request
salted with the new weight version starts from no block the old weights computed.

On the session's shared shm engine (reset to the checkpoint): a request caches the blocks of a
long prompt prefix (vLLM CPU caches whole 128-token blocks); the sync pauses with keep and no
clear_cache, as the RL job's does while requests are in flight (their KV blocks make a flush
impossible, see test_engine_control), so those blocks stay cached; new weights go in. A request
sharing that prefix, salted with the new version (what the job sends), must generate what the
engine generates from scratch on the new weights (the same request under a salt no block has:
nothing cached, as on a fresh engine); the same request unsalted reuses the old weights' blocks
(the engine's own cached-token count says so: the check is not vacuous) and does not (the leak
the salt closes). The log-prob gap between the engine and HF transformers on the new weights,
over the same tokens (all labelled with the new version), is printed for both: the figure
behind docs/weight-sync.md's isolation row.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from vime.engines.generate_api import SamplingConfig
from vime.engines.generation import GenerationClient
from vime.testing.hf import load_hf_model
from vime.testing.tiny_model import build_tiny_model

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

PREFIX = 300  # tokens: two whole 128-token blocks of shared prompt
NUM_TOKENS = 12


def _prompt(suffix: int) -> list[int]:
    generator = torch.Generator().manual_seed(7)
    prefix = torch.randint(10, 400, (PREFIX,), generator=generator).tolist()
    return [*prefix, 401 + suffix, 402 + suffix]


def _greedy(url: str, token: str, prompt: list[int], salt: str | None) -> list[int]:
    return _generate(url, token, prompt, salt).token_ids


def _generate(url: str, token: str, prompt: list[int], salt: str | None):
    async def run():
        async with GenerationClient([url], token=token, timeout_s=300) as client:
            sampling = SamplingConfig(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
            return await client.generate(prompt, sampling, cache_salt=salt)

    return asyncio.run(run())


def _logprob_gap(model, prompt: list[int], result) -> float:
    """Mean |engine log-prob - HF log-prob| of the engine's tokens, HF on the new weights."""
    ids = torch.tensor([[*prompt, *result.token_ids]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    reference = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
    return float((reference - torch.tensor(result.logprobs)).abs().mean())


def test_new_version_salt_reads_no_kv_of_the_old_weights(engine_pool, tmp_path):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from vime.weight_sync.trainer_engines import ColocatedTrainerInitInfo

    engine = engine_pool.get("shm")["shm"]
    url, token = engine.url, engine.auth_token
    assert token is not None
    new_dir = build_tiny_model(tmp_path / "new", "qwen2-tiny", seed=1)
    new_model = load_hf_model(new_dir)

    _greedy(url, token, _prompt(0), None)  # caches the prefix's blocks, old weights
    engine.pause_generation("keep", clear_cache=False)
    sender = WeightTransferTrainerFactory.trainer_init(
        ColocatedTrainerInitInfo(rank=0, bucket_bytes=1 << 20),
        client=engine,
        source=ModuleSource(new_model),
    )
    try:
        sender.send_weights()
        engine.update_weight_version("1")
    finally:
        sender.shutdown()
        engine.continue_generation()
    fresh = _greedy(url, token, _prompt(1), "never-used-before")
    salted = _generate(url, token, _prompt(1), "vime-weights-1")
    assert salted.token_ids == fresh
    assert set(salted.weight_versions) == {"1"}
    unsalted = _generate(url, token, _prompt(1), None)
    assert unsalted.token_ids != fresh, "the old KV was not reused"
    assert set(unsalted.weight_versions) == {"1"}  # labelled new, computed partly by old
    # The engine says so itself: the unsalted prompt reused the cached blocks.
    assert salted.num_cached_tokens == 0
    assert unsalted.num_cached_tokens is not None and unsalted.num_cached_tokens >= 256
    gaps = {
        "salted": _logprob_gap(new_model, _prompt(1), salted),
        "unsalted": _logprob_gap(new_model, _prompt(1), unsalted),
    }
    print(f"same-version log-prob gap to HF over {NUM_TOKENS} tokens: {gaps}")
    assert gaps["salted"] < 1e-3 < gaps["unsalted"], gaps
