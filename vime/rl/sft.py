"""Supervised warm start before RL: next-token cross-entropy on a task's demonstrations.

Real post-training starts RL from an SFT model. The job's `sft:` section runs `num_steps`
supervised steps on the trainer (the same megatron schedule, every TP x PP x DP layout), then
syncs the SFT weights into the engines before the first rollout; with a KL penalty the reference
becomes the SFT model, and RL starts with a fresh optimizer.

Demonstrations are JSONL: `{"prompt": "...", "completion": "..."}` (`python -m vime.rl.data`
writes the digit task's). The loss covers the completion's tokens and the end-of-sequence token,
tokenized as the engines see them (the prompt as `tokenizer(prompt)`, the completion after it).

    records = vime.rl.data.load_demonstrations(config.data_path)
    input_ids, loss_mask = sft_batch(records, step, config, tokenizer)
    metrics = trainer.sft_step(input_ids, loss_mask)
"""

from __future__ import annotations

import random
from typing import Any

import torch

from vime.config import SFTConfig
from vime.rl.data import PromptRecord


def sft_batch(
    records: list[PromptRecord], step: int, config: SFTConfig, tokenizer: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s demonstrations as ([batch, seq] token ids, [batch, seq - 1] loss mask).

    An epoch is len(records) // batch_size disjoint batches in an order fixed by (seed, epoch)
    (the remainder, different each epoch, waits for another); a step's batch depends only on its
    index, so a run is reproducible. The mask is aligned with `token_logprobs` (position t
    scores token t + 1): 1 on the completion and its end token.
    """
    if len(records) < config.batch_size:
        raise ValueError(
            f"sft.batch_size={config.batch_size} exceeds the {len(records)} demonstrations in "
            f"{config.data_path}: lower it, or give more demonstrations"
        )
    per_epoch = len(records) // config.batch_size
    epoch, index = divmod(step, per_epoch)
    order = list(range(len(records)))
    random.Random(f"{config.seed}-{epoch}").shuffle(order)
    chosen = [records[i] for i in order[index * config.batch_size :][: config.batch_size]]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    rows = []
    for record in chosen:
        prompt = tokenizer(record.prompt).input_ids
        completion = tokenizer(record.metadata["completion"], add_special_tokens=False).input_ids
        rows.append((prompt, [*completion, eos]))
    seq_len = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((len(rows), seq_len), pad, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), seq_len - 1)
    for i, (prompt, completion) in enumerate(rows):
        input_ids[i, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        loss_mask[i, len(prompt) - 1 : len(prompt) + len(completion) - 1] = 1.0
    return input_ids, loss_mask
