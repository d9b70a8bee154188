"""The forward pass of a vime-built GPTModel chunk on token ids, and log-probs from its logits.

logprobs = token_logprobs(model, input_ids, vocab_size=hf_config.vocab_size)   # PP=1
"""

from __future__ import annotations

from typing import Any

import torch

from vime.megatron.param_names import unwrap


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked. megatron's default causal mask is built on "cuda"."""
    ones = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)[None, None]


def stage_forward(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """This pipeline stage's forward on [batch, seq] token ids.

    The first stage embeds `input_ids`; later stages read the previous stage's activations, set
    by megatron's schedule (`set_input_tensor`). The last stage returns its TP shard of the logits
    [batch, seq, vocab / tp]; the others their hidden states [seq, batch, hidden].
    """
    batch, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
    mask = causal_attention_mask(seq_len, input_ids.device)
    return model(input_ids, position_ids, mask, **kwargs)


def _local_logits(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    gpt = unwrap(model)
    if not (gpt.pre_process and gpt.post_process):
        raise ValueError("forward_logits / token_logprobs need the whole model on this rank (PP=1)")
    return stage_forward(model, input_ids, **kwargs)


def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, *, vocab_size: int
) -> torch.Tensor:
    """[batch, seq, vocab_size] logits, gathered over TP with the vocab padding cut off (PP=1)."""
    logits = _local_logits(model, input_ids, runtime_gather_output=True)
    return logits[..., :vocab_size]


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, *, vocab_size: int
) -> torch.Tensor:
    """[batch, seq - 1] float32 log-probs of input_ids[:, 1:] given their prefixes (PP=1).

    Differentiable. Megatron refuses MoE + TP>1 in training mode unless the config sets
    sequence_parallel; call model.eval() for scoring-only passes.
    """
    logits = _local_logits(model, input_ids[:, :-1])
    return logprobs_from_logits(
        logits,
        input_ids[:, 1:],
        vocab_size=vocab_size,
        tp_group=unwrap(model).output_layer.tp_group,
    )


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_group: Any,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
) -> torch.Tensor:
    """[batch, seq] float32 log-probs of `targets` under this TP rank's logits shard.

    Vocab-parallel: the logits stay split over TP (megatron's vocab_parallel_cross_entropy);
    padded vocab columns are masked to -inf first so they take no probability mass.

    `temperature`, `top_k` and `top_p`: the log-probs of the distribution the engine sampled from,
    as vLLM returns them with `--logprobs-mode processed_logprobs`: logits / temperature (0 means
    greedy: the raw logits), then, with top_k > 0, all but the k largest masked, then, with
    top_p < 1, every token outside the nucleus masked (the smallest set, by descending
    probability, whose mass exceeds top_p; vLLM's rule), and the rest renormalised. The nucleus
    is chosen without gradient; the log-probs stay differentiable. The target itself always stays
    in: the engine sampled it, so it was in the engine's nucleus, and a token on the nucleus's
    edge may fall the other side here by float noise (its log-prob would be -inf, its loss
    infinite)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    local_vocab = logits.shape[-1]
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    start = dist.get_rank(tp_group) * local_vocab if tp_size > 1 else 0
    columns = torch.arange(start, start + local_vocab, device=logits.device)
    logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
    if top_p < 1.0 or top_k > 0:
        threshold = _nucleus_threshold(logits.detach(), targets, top_p, top_k, tp_group, tp_size)
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    # megatron wants [seq, batch, vocab]; it returns -log p(target).
    nll = vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous(), targets.t().contiguous()
    )
    return -nll.t()


def _nucleus_threshold(
    logits: torch.Tensor,
    targets: torch.Tensor,
    top_p: float,
    top_k: int,
    tp_group: Any,
    tp_size: int,
) -> torch.Tensor:
    """[..., 1] the smallest logit each position keeps, as vLLM's `apply_top_k_top_p_pytorch`
    picks it (sorted ascending: all but the top_k largest dropped; then a token is dropped while
    the cumulative probability up to it is <= 1 - top_p; the most likely token always stays), or
    the target's logit where that is lower. Under TP the whole vocabulary is gathered (no gradient:
    [..., vocab] floats for the step)."""
    import torch.distributed as dist

    if tp_size > 1:
        shards = [torch.empty_like(logits) for _ in range(tp_size)]
        dist.all_gather(shards, logits.contiguous(), group=tp_group)
        logits = torch.cat(shards, dim=-1)
    ascending, _ = torch.sort(logits, dim=-1)
    vocab = ascending.shape[-1]
    dropped = torch.zeros_like(ascending, dtype=torch.bool)
    if 0 < top_k < vocab:
        dropped[..., : vocab - top_k] = True
        ascending = ascending.masked_fill(dropped, float("-inf"))
    if top_p < 1.0:
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        dropped |= cumulative <= 1 - top_p
    dropped[..., -1] = False
    first_kept = dropped.sum(dim=-1, keepdim=True)  # dropped tokens are a prefix
    threshold = ascending.gather(-1, first_kept)
    return torch.minimum(threshold, logits.gather(-1, targets.unsqueeze(-1)))
