"""A fixed packed GRPO batch for tests that compare trainer layouts or devices step by step."""

from __future__ import annotations

import torch

from vime.rl.samples import PackedBatch


def synthetic_batch(groups: int, group_size: int, seq: int, seed: int = 0) -> PackedBatch:
    """`groups` x `group_size` rows of random token ids below 500, responses of 3-7 tokens after
    a 5-token prompt, rollout log-probs in (-6, 0] on the response, rewards 0 or 1."""
    generator = torch.Generator().manual_seed(seed)
    num = groups * group_size
    input_ids = torch.randint(0, 500, (num, seq), generator=generator)
    mask = torch.zeros(num, seq - 1)
    for row in range(num):
        mask[row, 4 : 4 + 3 + row % 5] = 1.0
    logprobs = -torch.rand(num, seq - 1, generator=generator) * 6 * mask
    rewards = torch.rand(num, generator=generator).round()
    return PackedBatch(input_ids, mask, logprobs, rewards, group_size)
