"""GRPO: group-normalised advantages and the PPO-clipped policy loss, in plain torch.

Old log-probs are the rollout engine's (the policy that sampled the tokens), so one loss covers both
on-policy steps and stale, asynchronously generated samples. Shapes: `[batch, seq]` over response
tokens, with `mask` 1 on real response tokens and 0 on padding.

    advantages = group_advantages(rewards, group_size=8)
    loss, metrics = grpo_loss(train_logprobs, rollout_logprobs, advantages, mask, config=config)
"""

from __future__ import annotations

import torch

from vime.config import GRPOConfig


def kl_estimate(
    train_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token estimate of KL(train || ref) from the sampled tokens' log-probs."""
    diff = ref_logprobs - train_logprobs
    if estimator == "k1":
        return -diff
    if estimator == "k3":
        return torch.exp(diff) - diff - 1
    raise ValueError(f"kl_estimator {estimator!r}: choose k1 or k3")


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, eps: float = 1e-6, normalize_std: bool = True
) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for consecutive groups of `group_size` samples.

    A group whose samples all scored the same gets advantage 0 (no signal), not a division by 0.
    The std is the population std (unbiased=False), as in the GRPO paper's implementations.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}: "
            "samples of one prompt must be consecutive and every group complete"
        )
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.view(-1)


def _masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    token_level: bool,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
) -> torch.Tensor:
    """Token mean (over `num_tokens` if given), or the mean of per-sequence means (over
    `num_sequences` if given; rows without tokens add 0)."""
    if token_level:
        return (values * mask).sum() / (num_tokens or mask.sum().clamp(min=1))
    per_sequence = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_sequence.sum() / num_sequences if num_sequences else per_sequence.mean()


def grpo_loss(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: GRPOConfig | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    num_batch_tokens: float | None = None,
    num_batch_sequences: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clipped GRPO loss to minimise, and its metrics.

    train_logprobs: [batch, seq] log-probs of the response tokens under the model being trained
        (differentiable); rollout_logprobs: the engine's log-probs of the same tokens;
    advantages: [batch] one per sample; mask: [batch, seq] 1 on response tokens;
    old_logprobs: the trainer's log-probs of the tokens before this step's update (detached). None:
        the rollout log-probs are the old policy, and the clip bounds staleness and engine mismatch;
    ref_logprobs: [batch, seq] under the reference policy, needed when config.kl_coef > 0;
    num_batch_tokens: with token_level_mean, divide by this instead of this call's token count, so
        micro-batches of one step sum to the whole batch's token mean (gradient accumulation);
    num_batch_sequences: likewise without token_level_mean: the whole batch's sample count.

    Per token: ratio = exp(train - old); objective = min(ratio * A, clip(ratio) * A);
    with tis_cap (needs old_logprobs) the objective is weighted by min(exp(old - rollout), tis_cap),
    the truncated importance weight of the trainer's old policy over the engine's sampling policy;
    with kl_coef and kl_estimator k1 each token's advantage is lowered by kl_coef * (train - ref)
    (detached), with k3 kl_coef * (exp(ref - train) - (ref - train) - 1) is added to the loss;
    metric `kl_ref` is the estimate's token mean.
    For one update per batch pass old_logprobs=train_logprobs.detach(): the ratio is then 1 and
    staleness is corrected by the TIS weight alone.
    """
    config = config or GRPOConfig()
    shapes = {"train": train_logprobs.shape, "rollout": rollout_logprobs.shape, "mask": mask.shape}
    for name, other in (("old", old_logprobs), ("ref", ref_logprobs)):
        if other is not None:
            shapes[name] = other.shape
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shapes differ: { ({k: tuple(v) for k, v in shapes.items()}) }")
    if advantages.shape != train_logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [batch] = [{train_logprobs.shape[0]}], "
            f"got {tuple(advantages.shape)}"
        )
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs under the reference policy)")
    if config.tis_cap is not None and old_logprobs is None:
        raise ValueError(
            "tis_cap needs old_logprobs (the trainer's log-probs before the update, e.g. "
            "train_logprobs.detach()); with the rollout log-probs as old policy the weight is 1"
        )
    dtype = train_logprobs.dtype
    mask = mask.to(dtype)
    rollout_logprobs = rollout_logprobs.to(dtype)
    old = rollout_logprobs if old_logprobs is None else old_logprobs.detach().to(dtype)
    token_level = config.token_level_mean

    ratio = torch.exp(train_logprobs - old)
    advantage = advantages.to(dtype).unsqueeze(1)
    kl = None
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs (reference log-probs)")
        kl = kl_estimate(train_logprobs, ref_logprobs.to(dtype), config.kl_estimator)
        if config.kl_estimator == "k1":
            # As a loss, k1's gradient (grad log pi on sampled tokens) averages to zero; as a
            # reward penalty its policy gradient is -kl_coef * grad KL(train || ref).
            advantage = advantage - config.kl_coef * kl.detach()
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high) * advantage
    objective = torch.minimum(unclipped, clipped)
    metrics: dict[str, float] = {}
    if config.tis_cap is not None:
        raw_weight = torch.exp(old - rollout_logprobs)
        objective = objective * torch.clamp(raw_weight, max=config.tis_cap)
        with torch.no_grad():
            metrics["tis_weight_mean"] = _masked_mean(raw_weight, mask, True).item()
            metrics["tis_capped_fraction"] = _masked_mean(
                (raw_weight > config.tis_cap).to(dtype), mask, True
            ).item()
    loss = -_masked_mean(objective, mask, token_level, num_batch_tokens, num_batch_sequences)

    if kl is not None:
        if config.kl_estimator == "k3":
            kl_mean = _masked_mean(kl, mask, token_level, num_batch_tokens, num_batch_sequences)
            loss = loss + config.kl_coef * kl_mean
        metrics["kl_ref"] = _masked_mean(kl.detach(), mask, True).item()

    with torch.no_grad():
        log_diff = train_logprobs - rollout_logprobs
        masked_ratio = ratio.masked_fill(mask == 0, float("-inf"))
        metrics.update(
            loss=loss.item(),
            # The clipped branch is the one min() takes: those tokens pass no gradient.
            clip_fraction=_masked_mean((clipped < unclipped).to(dtype), mask, True).item(),
            # |train - rollout|: engine/trainer mismatch plus staleness, the async-RL health signal.
            logprob_diff=_masked_mean(log_diff.abs(), mask, True).item(),
            # k1 estimate of KL(rollout || train) on the sampled tokens.
            kl_rollout=_masked_mean(-log_diff, mask, True).item(),
            ratio_mean=_masked_mean(ratio, mask, True).item(),
            ratio_max=masked_ratio.max().item() if mask.any() else 1.0,
            # Over the samples only (a micro-batch may end in padding rows without tokens).
            advantage_mean=advantages.float()[mask.sum(dim=1) > 0].mean().item()
            if mask.any()
            else 0.0,
            num_tokens=mask.sum().item(),
        )
    return loss, metrics
