"""The trainer's RL log-probs are those of the distribution the engine sampled from.

`logprobs_from_logits(..., temperature, top_p, top_k)` on vocab-parallel shards (TP 1 and 2, gloo
ranks, megatron's vocab_parallel_cross_entropy) against vLLM's own top-p
(`apply_top_k_top_p_pytorch`, what its CPU and GPU samplers run before returning
`processed_logprobs`) on the whole vocabulary: equal log-probs for targets inside the nucleus,
gradients into the nucleus's logits only. A target outside vLLM's nucleus (the engine never
samples one; float noise at the nucleus's edge can put one there) is kept with the nucleus, so
its log-prob is finite, never -inf.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_harness import COLLECTIVE_TIMEOUT, init_gloo_rank, spawn_ranks

pytestmark = pytest.mark.distributed

VOCAB, PADDED = 47, 50  # the last 3 columns are vocab padding (masked)
TEMPERATURE = 0.7


def _case() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, PADDED, generator=generator) * 3
    targets = torch.randint(0, VOCAB, (3, 6), generator=generator)
    return logits, targets


def _worker(rank: int, world_size: int, port: int, top_p: float, top_k: int, out_dir: str) -> None:
    from vime.megatron.forward import logprobs_from_logits
    from vime.megatron.model import initialize_model_parallel

    init_gloo_rank(rank, world_size, port)
    initialize_model_parallel(tp=world_size, pp=1, timeout=COLLECTIVE_TIMEOUT)
    from megatron.core import parallel_state

    logits, targets = _case()
    width = PADDED // world_size
    shard = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    got = logprobs_from_logits(
        shard,
        targets,
        vocab_size=VOCAB,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        temperature=TEMPERATURE,
        top_p=top_p,
        top_k=top_k,
    )
    got.masked_fill(~torch.isfinite(got), 0.0).sum().backward()
    torch.save({"logprobs": got.detach(), "grad": shard.grad}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize(
    ("tp", "top_p", "top_k"),
    [(1, 0.9, -1), (2, 0.9, -1), (2, 0.95, 12)],
    ids=["tp1", "tp2", "tp2-top-k"],
)
def test_logprobs_follow_vllm_temperature_top_k_and_top_p(tp, top_p, top_k, tmp_path):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    args = (top_p, top_k, str(tmp_path))
    spawn_ranks(_worker, tp, args, timeout_s=120, what=f"sampling log-probs tp{tp}")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]
    logits, targets = _case()
    flat = logits[..., :VOCAB].reshape(-1, VOCAB) / TEMPERATURE
    rows = flat.shape[0]
    k = torch.full((rows,), top_k) if top_k > 0 else None
    processed = apply_top_k_top_p_pytorch(flat.clone(), k, torch.full((rows,), top_p))
    processed = processed.log_softmax(dim=-1)
    expected = processed.gather(1, targets.reshape(-1, 1)).reshape(targets.shape)
    outside = torch.isinf(expected)
    assert 0 < int(outside.sum()) < outside.numel(), "the case must have targets on both sides"
    for result in results:
        got = result["logprobs"]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[~outside], expected[~outside], rtol=1e-5, atol=1e-5)
        # Outside: renormalised over the nucleus plus the target, below the nucleus's tokens.
        assert (got[outside] < expected[~outside].min()).all()
    # Gradient only into the nucleus (widened down to an outside target): none elsewhere.
    grad = torch.cat([result["grad"] for result in results], dim=-1)
    nucleus_min = flat.masked_fill(torch.isinf(processed), float("inf")).min(-1, keepdim=True)
    target_logit = flat.gather(1, targets.reshape(-1, 1))
    kept = (flat >= torch.minimum(nucleus_min.values, target_logit)).reshape(*targets.shape, VOCAB)
    assert torch.count_nonzero(grad[..., VOCAB:]) == 0
    assert torch.count_nonzero(grad[..., :VOCAB][~kept]) == 0
    assert torch.count_nonzero(grad[..., :VOCAB][kept]) > 0
