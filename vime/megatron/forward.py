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
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, tp_group: Any
) -> torch.Tensor:
    """[batch, seq] float32 log-probs of `targets` under this TP rank's logits shard.

    Vocab-parallel: the logits stay split over TP (megatron's vocab_parallel_cross_entropy);
    padded vocab columns are masked to -inf first so they take no probability mass.
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float()
    local_vocab = logits.shape[-1]
    start = dist.get_rank(tp_group) * local_vocab if dist.get_world_size(tp_group) > 1 else 0
    columns = torch.arange(start, start + local_vocab, device=logits.device)
    logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
    # megatron wants [seq, batch, vocab]; it returns -log p(target).
    nll = vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous(), targets.t().contiguous()
    )
    return -nll.t()
