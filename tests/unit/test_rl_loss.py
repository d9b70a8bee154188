"""GRPO advantages and the clipped policy loss: hand-computed values, clipping, masks, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from vime.config import GRPOConfig
from vime.rl.loss import group_advantages, grpo_loss

pytestmark = pytest.mark.unit


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    advantages = group_advantages(rewards, group_size=4, eps=0.0 + 1e-12)
    # Group 1: mean 0.25, population std sqrt(3)/4.
    std = math.sqrt(3) / 4
    expected = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0, 0, 0, 0]
    assert advantages.tolist() == pytest.approx(expected, rel=1e-5)


def test_group_advantages_without_std_and_bad_groups():
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.4])
    assert group_advantages(rewards, 2, normalize_std=False).tolist() == pytest.approx(
        [0.5, -0.5, -0.1, 0.1]
    )
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        group_advantages(rewards, 3)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(rewards.view(2, 2), 2)


def test_on_policy_loss_value_and_metrics():
    # ratio = 1 everywhere: loss = -(token-weighted mean advantage), nothing clipped.
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.2, 0.2]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    advantages = torch.tensor([1.0, -2.0])
    loss, metrics = grpo_loss(logprobs.clone(), logprobs, advantages, mask)
    assert loss.item() == pytest.approx(-(1 + 1 - 2) / 3)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["logprob_diff"] == pytest.approx(0.0)
    assert metrics["num_tokens"] == 3


def test_sequence_level_mean():
    logprobs = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    config = GRPOConfig(token_level_mean=False)
    loss, _ = grpo_loss(logprobs, logprobs, torch.tensor([1.0, -2.0]), mask, config=config)
    assert loss.item() == pytest.approx(-(1 - 2) / 2)


def test_clipping_hand_computed():
    rollout = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.1, 0.7 with advantage +1: min(r, clip(r)) = 1.2, 0.5, 1.1, 0.7
    train = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]])).requires_grad_()
    mask = torch.ones(1, 4)
    loss, metrics = grpo_loss(train, rollout, torch.tensor([1.0]), mask)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 + 1.1 + 0.7) / 4)
    assert metrics["clip_fraction"] == pytest.approx(0.25)  # only the 1.5 token is clipped
    loss.backward()
    # The clipped token gets no gradient; the others get -ratio / 4 (d ratio / d logprob = ratio).
    assert train.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, -1.1 / 4, -0.7 / 4])

    # Negative advantage: clipping bites below 1 - 0.2.
    train.grad = None
    loss, metrics = grpo_loss(train, rollout, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.1 + 0.8) / 4)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["logprob_diff"] == pytest.approx(
        sum(abs(math.log(r)) for r in (1.5, 0.5, 1.1, 0.7)) / 4, rel=1e-5
    )


def test_gradient_sign_follows_advantage_and_mask():
    train = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, _ = grpo_loss(train, torch.zeros(2, 3), torch.tensor([2.0, -1.0]), mask)
    loss.backward()
    grad = train.grad
    # Gradient descent raises log-probs of positive-advantage tokens (negative grad), lowers others.
    assert (grad[0, :2] < 0).all()
    assert (grad[1] > 0).all()
    assert grad[0, 2] == 0  # masked token


def test_truncated_importance_sampling_weights():
    rollout = torch.zeros(1, 2)
    old = torch.log(torch.tensor([[3.0, 0.5]]))
    train = old.clone().requires_grad_()
    mask = torch.ones(1, 2)
    config = GRPOConfig(off_policy={"level": "token", "cap": 2.0})
    loss, metrics = grpo_loss(
        train, rollout, torch.tensor([1.0]), mask, config=config, old_logprobs=train.detach()
    )
    # ratio train/old = 1; weights min(old/rollout, 2) = 2 and 0.5.
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert metrics["is_capped_fraction"] == pytest.approx(0.5)
    assert metrics["is_weight_mean"] == pytest.approx((3.0 + 0.5) / 2)
    assert metrics["is_weight_max"] == pytest.approx(3.0)
    assert metrics["is_masked_fraction"] == 0.0
    assert metrics["logprob_diff"] == pytest.approx((math.log(3) + math.log(2)) / 2, rel=1e-5)
    # k3 of KL(rollout || train): mean of exp(d) - d - 1 over d = log 3, log 0.5.
    k3 = ((3 - math.log(3) - 1) + (0.5 - math.log(0.5) - 1)) / 2
    assert metrics["mismatch_kl"] == pytest.approx(k3, rel=1e-5)
    loss.backward()
    assert train.grad.tolist()[0] == pytest.approx([-1.0, -0.25])
    with pytest.raises(ValueError, match="off_policy.level=token needs old_logprobs"):
        grpo_loss(train, rollout, torch.tensor([1.0]), mask, config=config)


def _weighted_loss(level: str, **bounds) -> tuple[float, dict[str, float]]:
    """Two samples against rollout log-probs 0: sample 0's tokens have w = 2 and 8 (and a padding
    token), sample 1's w = 0.5; advantages 1 and -1; ratio train/old = 1."""
    old = torch.log(torch.tensor([[2.0, 8.0, 1.0], [0.5, 1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    config = GRPOConfig(off_policy={"level": level, **bounds})
    loss, metrics = grpo_loss(
        old.clone(),
        torch.zeros(2, 3),
        torch.tensor([1.0, -1.0]),
        mask,
        config=config,
        old_logprobs=old,
    )
    return loss.item(), metrics


def test_sequence_and_geometric_weights_are_one_per_sample():
    # Sequence: w0 = 2 * 8 = 16 on both of sample 0's tokens, w1 = 0.5; token mean over 3 tokens.
    loss, metrics = _weighted_loss("sequence")
    assert loss == pytest.approx(-(16 + 16 - 0.5) / 3)
    assert metrics["is_weight_mean"] == pytest.approx((16 + 16 + 0.5) / 3)
    # Geometric: w0 = sqrt(2 * 8) = 4, independent of the sample's length; w1 = 0.5.
    loss, metrics = _weighted_loss("geometric")
    assert loss == pytest.approx(-(4 + 4 - 0.5) / 3)
    assert metrics["is_weight_max"] == pytest.approx(4.0)


def test_masked_importance_sampling_drops_tokens_or_whole_samples():
    # Token level, bounds [0.6, 5]: the w = 8 and w = 0.5 tokens drop, the w = 2 token stays;
    # the denominator still counts all 3 tokens.
    loss, metrics = _weighted_loss("token", mask_below=0.6, mask_above=5.0)
    assert loss == pytest.approx(-2.0 / 3)
    assert metrics["is_masked_fraction"] == pytest.approx(2 / 3)
    # Geometric, bounds [0.6, 5]: sample 0 (w = 4) stays whole, sample 1 (w = 0.5) drops.
    loss, metrics = _weighted_loss("geometric", mask_below=0.6, mask_above=5.0)
    assert loss == pytest.approx(-(4 + 4) / 3)
    assert metrics["is_masked_fraction"] == pytest.approx(1 / 3)
    # Sequence with a cap: w0 = 16 capped at 3, masking above 20 leaves it.
    loss, metrics = _weighted_loss("sequence", cap=3.0, mask_above=20.0)
    assert loss == pytest.approx(-(3 + 3 - 0.5) / 3)
    assert metrics["is_capped_fraction"] == pytest.approx(2 / 3)


def test_off_policy_config_errors_name_the_key():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="off_policy.cap is set but"):
        GRPOConfig(off_policy={"cap": 2.0})
    with pytest.raises(pydantic.ValidationError, match="mask_below=2.0 must be below"):
        GRPOConfig(off_policy={"level": "token", "mask_below": 2.0, "mask_above": 1.5})
    with pytest.raises(pydantic.ValidationError, match="level"):
        GRPOConfig(off_policy={"level": "sample"})


def test_importance_weight_quantiles_cover_every_micro_batch():
    """The step's quantiles come from all its tokens (histograms summed over micro-batches), to
    a bin's width (0.05 in log w)."""
    from vime.trainer.stats import StepStats

    stats = StepStats()
    weights = torch.exp(torch.linspace(-1.0, 1.0, 1001, dtype=torch.float64))
    for chunk in weights.split(100):  # eleven micro-batches, one with a padding column
        values = torch.stack([chunk.log(), torch.zeros_like(chunk)], dim=1)
        mask = torch.stack([torch.ones_like(chunk), torch.zeros_like(chunk)], dim=1)
        stats.add_histogram("is_weight", values, mask)
    metrics = stats.metrics()
    for suffix, q in (("p01", 0.01), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        expected = float(torch.quantile(weights, q))
        assert metrics[f"is_weight_{suffix}"] == pytest.approx(expected, rel=0.03), suffix
    # Beyond the range: the range's edge.
    far = StepStats()
    far.add_histogram("w", torch.tensor([[9.0, -9.0]]), torch.ones(1, 2))
    assert far.metrics()["w_p99"] == pytest.approx(math.exp(4.025))
    assert far.metrics()["w_p01"] == pytest.approx(math.exp(-4.025))
    # A weight of 1 (no staleness, no mismatch) reads as 1: a bin is centred on it.
    ones = StepStats()
    ones.add_histogram("w", torch.full((2, 3), 1e-7), torch.ones(2, 3))
    assert ones.metrics()["w_p50"] == pytest.approx(1.0)
    empty = StepStats()  # a rank whose micro-batches hold no token: no quantiles, no error
    empty.add_histogram("w", torch.zeros(1, 2), torch.zeros(1, 2))
    assert "w_p50" not in empty.metrics()


def test_old_logprobs_set_the_clip_reference():
    rollout = torch.full((1, 2), -5.0)  # far from the trainer: would clip everything
    train = torch.zeros(1, 2, requires_grad=True)
    loss, metrics = grpo_loss(
        train, rollout, torch.tensor([1.0]), torch.ones(1, 2), old_logprobs=train.detach()
    )
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["logprob_diff"] == pytest.approx(5.0)


def test_kl_to_reference_k3():
    train = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[math.log(0.5), 0.0]])
    config = GRPOConfig(kl_coef=0.1)
    loss, metrics = grpo_loss(
        train,
        torch.zeros(1, 2),
        torch.tensor([0.0]),
        torch.ones(1, 2),
        config=config,
        ref_logprobs=ref,
    )
    k3 = (0.5 - math.log(0.5) - 1) / 2  # mean over the two tokens; the second has kl 0
    assert metrics["kl_ref"] == pytest.approx(k3, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-5)
    loss.backward()
    assert train.grad[0, 0] > 0  # kl pulls train log-prob down towards the reference's


def test_kl_to_reference_k1_and_estimators_agree_on_average():
    train = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[math.log(0.5), 0.0]])
    config = GRPOConfig(kl_coef=0.1, kl_estimator="k1")
    loss, metrics = grpo_loss(
        train,
        torch.zeros(1, 2),
        torch.tensor([0.0]),
        torch.ones(1, 2),
        config=config,
        ref_logprobs=ref,
    )
    k1 = (0.0 - math.log(0.5)) / 2
    assert metrics["kl_ref"] == pytest.approx(k1, rel=1e-5)
    # k1 lowers each token's advantage by kl_coef * (train - ref): with advantage 0 and ratio 1
    # the loss is kl_coef * mean k1, and only the token where train > ref is pushed down.
    assert loss.item() == pytest.approx(0.1 * k1, rel=1e-5)
    loss.backward()
    assert train.grad[0].tolist() == pytest.approx([0.1 * -math.log(0.5) / 2, 0.0])
    # Tokens sampled from p: both estimate KL(p || q) (p, q: random distributions over 8 tokens).
    from vime.rl.loss import kl_estimate

    generator = torch.Generator().manual_seed(0)
    logits_p, logits_q = torch.randn(8, generator=generator), torch.randn(8, generator=generator)
    log_p, log_q = logits_p.log_softmax(0), logits_q.log_softmax(0)
    exact = float((log_p.exp() * (log_p - log_q)).sum())
    tokens = torch.multinomial(log_p.exp(), 200_000, replacement=True, generator=generator)
    for estimator in ("k1", "k3"):
        estimate = kl_estimate(log_p[tokens], log_q[tokens], estimator).mean()
        assert float(estimate) == pytest.approx(exact, rel=0.05), estimator


def test_shape_and_config_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shapes differ"):
        grpo_loss(x, torch.zeros(2, 4), torch.zeros(2), x)
    with pytest.raises(ValueError, match="'old': \\(2, 2\\)"):
        grpo_loss(x, x, torch.zeros(2), x, old_logprobs=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(x, x, torch.zeros(3), x)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(x, x, torch.zeros(2), x, config=GRPOConfig(kl_coef=0.1))


def test_micro_batches_sum_to_the_batch_loss():
    torch.manual_seed(0)
    train = torch.randn(4, 5) * 0.1
    rollout = torch.randn(4, 5) * 0.1
    mask = (torch.rand(4, 5) > 0.3).float()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    whole, _ = grpo_loss(train, rollout, advantages, mask)
    total = mask.sum().item()
    parts = [
        grpo_loss(
            train[i : i + 2],
            rollout[i : i + 2],
            advantages[i : i + 2],
            mask[i : i + 2],
            num_batch_tokens=total,
        )[0]
        for i in (0, 2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-5)


def test_micro_batches_sum_to_the_batch_loss_per_sequence_with_padding_rows():
    """token_level_mean=False: per-sequence means over the whole batch's samples; a padding row
    (no tokens, as the trainer adds to fill the last micro-batch) adds nothing."""
    torch.manual_seed(0)
    config = GRPOConfig(token_level_mean=False, kl_coef=0.1, kl_estimator="k3")
    train = torch.randn(4, 5) * 0.1
    rollout = torch.randn(4, 5) * 0.1
    ref = torch.randn(4, 5) * 0.1
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1.0
    advantages = torch.tensor([1.0, -1.0, 0.5, 0.3])
    whole, _ = grpo_loss(train, rollout, advantages, mask, config=config, ref_logprobs=ref)
    padded = [torch.cat([t[2:], torch.zeros(1, *t.shape[1:])]) for t in (train, rollout, ref)]
    second = grpo_loss(
        padded[0],
        padded[1],
        torch.cat([advantages[2:], torch.zeros(1)]),
        torch.cat([mask[2:], torch.zeros(1, 5)]),
        config=config,
        ref_logprobs=padded[2],
        num_batch_sequences=4.0,
    )
    first = grpo_loss(
        train[:2],
        rollout[:2],
        advantages[:2],
        mask[:2],
        config=config,
        ref_logprobs=ref[:2],
        num_batch_sequences=4.0,
    )
    assert (first[0] + second[0]).item() == pytest.approx(whole.item(), rel=1e-5)
    # The padding row is not a sample: the mean advantage is over the two real ones.
    assert second[1]["advantage_mean"] == pytest.approx(0.4)
