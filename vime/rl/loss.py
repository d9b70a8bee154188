"""GRPO: group-normalised advantages and the PPO-clipped policy loss, in plain torch.

Old log-probs are the rollout engine's (the policy that sampled the tokens), so one loss covers both
on-policy steps and stale, asynchronously generated samples. Shapes: `[batch, seq]` over response
tokens, with `mask` 1 on real response tokens and 0 on padding.

    advantages = group_advantages(rewards, group_size=8)
    loss, metrics = grpo_loss(train_logprobs, rollout_logprobs, advantages, mask, config=config)
"""

from __future__ import annotations

import torch

from vime.config import GRPOConfig, OffPolicyConfig

# exp() of a sequence-level log-weight overflows float32 past ~88; weights past e^20 are masked or
# capped in any sensible configuration, and their metrics say so.
MAX_LOG_WEIGHT = 20.0


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


def importance_log_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """[batch, seq] log w of `level` (OffPolicyConfig): per token, or one per sample (its sum,
    `sequence`, or mean, `geometric`, over the sample's tokens) on each of its tokens; 0 where
    mask is 0."""
    mask = mask.to(old_logprobs.dtype)
    log_ratio = (old_logprobs - rollout_logprobs.to(old_logprobs.dtype)) * mask
    if level == "token":
        return log_ratio
    if level == "sequence":
        per_sample = log_ratio.sum(dim=1, keepdim=True)
    elif level == "geometric":
        per_sample = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    else:
        raise ValueError(f"importance-weight level {level!r}: choose token, sequence or geometric")
    return per_sample * mask


def off_policy_weights(
    log_weights: torch.Tensor, mask: torch.Tensor, config: OffPolicyConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The factor each token's objective is multiplied by (detached): w capped at `cap`, 0 where
    w leaves [mask_below, mask_above]; and its metrics over the tokens of `mask`."""
    mask = mask.to(log_weights.dtype)
    weight = torch.exp(log_weights.clamp(max=MAX_LOG_WEIGHT)).detach()
    keep = torch.ones_like(weight, dtype=torch.bool)
    if config.mask_below is not None:
        keep &= weight >= config.mask_below
    if config.mask_above is not None:
        keep &= weight <= config.mask_above
    factor = weight if config.cap is None else torch.clamp(weight, max=config.cap)
    factor = factor * keep.to(weight.dtype)
    metrics = {
        "is_weight_mean": _masked_mean(weight, mask, True).item(),
        "is_weight_max": weight.masked_fill(mask == 0, 0.0).max().item() if mask.any() else 1.0,
        "is_masked_fraction": _masked_mean((~keep).to(weight.dtype), mask, True).item(),
    }
    if config.cap is not None:
        metrics["is_capped_fraction"] = _masked_mean(
            (weight > config.cap).to(weight.dtype), mask, True
        ).item()
    return factor, metrics


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
    with config.off_policy.level (needs old_logprobs) the objective is weighted by the importance
    weight of the trainer's old policy over the engine's sampling policy, capped and masked as
    configured (`off_policy_weights`);
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
    off_policy = config.off_policy
    if off_policy.level != "off" and old_logprobs is None:
        raise ValueError(
            f"off_policy.level={off_policy.level} needs old_logprobs (the trainer's log-probs "
            "before the update, e.g. train_logprobs.detach()); with the rollout log-probs as old "
            "policy every weight is 1"
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
    if off_policy.level != "off":
        log_weights = importance_log_weights(old, rollout_logprobs, mask, off_policy.level)
        factor, weight_metrics = off_policy_weights(log_weights, mask, off_policy)
        objective = objective * factor
        metrics.update(weight_metrics)
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
            # k3 estimate of the same (non-negative, lower variance): the mismatch metric.
            mismatch_kl=_masked_mean(torch.exp(log_diff) - log_diff - 1, mask, True).item(),
            ratio_mean=_masked_mean(ratio, mask, True).item(),
            ratio_max=masked_ratio.max().item() if mask.any() else 1.0,
            # Over the samples only (a micro-batch may end in padding rows without tokens).
            advantage_mean=advantages.float()[mask.sum(dim=1) > 0].mean().item()
            if mask.any()
            else 0.0,
            num_tokens=mask.sum().item(),
        )
    return loss, metrics
