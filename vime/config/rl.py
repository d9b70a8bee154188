"""The RL sections: `rollout:` (what to generate), `grpo:` (the loss), `sft:` (a supervised warm
start) and `eval:` (held-out greedy evaluation)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vime.config.base import StrictModel

DEFAULT_PROMPTS = "digit_repeat/train.jsonl"  # vime's built-in task (package data)


class RolloutConfig(StrictModel):
    """What to generate each RL step and how."""

    prompts_path: str = Field(
        DEFAULT_PROMPTS,
        description="JSONL prompt file ({'prompt': ..., ...} per line); default: built-in task.",
    )
    reward_fn: str = Field(
        "vime.rl.rewards:digit_match",
        description="Dotted path 'module:function' of fn(prompt, completion, metadata) -> float.",
    )
    # 32 x 8 (lr 2e-3, 8 tokens) lifts qwen2-tiny on the digit task from 0.07 to 0.4 in 110-150
    # steps; 16 x 8 is slower and noisier, and at higher lr collapses onto one string for all.
    num_prompts_per_step: int = Field(32, ge=1, description="Prompts (groups) per batch.")
    num_samples_per_prompt: int = Field(
        8, ge=1, description="Samples per prompt: the GRPO group size."
    )
    max_tokens: int = Field(8, ge=1, description="Most tokens generated per sample.")
    chat_template: bool = Field(
        False,
        description=(
            "Send each prompt as one user turn of the tokenizer's chat template, the assistant's "
            "turn opened (an instruct model); False: the prompt's text as it is."
        ),
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (1.0: the policy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1.0 samples the policy.")
    top_k: int = Field(-1, description="Top-k sampling; -1 samples the policy.")
    max_staleness: int = Field(
        1,
        ge=0,
        description=(
            "How far generation runs ahead of training, in steps, and so how many weight versions "
            "a sample's oldest token may be behind the trainer that trains on it. 0: generate, "
            "train, sync in turn (synchronous). 1: batch k+1 generates while batch k trains. K: "
            "up to K batches generate ahead, their requests running through each sync (keep "
            "pause, every token labelled with its version). A sample that is more versions "
            "behind (none is, unless it waited out syncs) keeps its place in its group's "
            "baseline but adds no token to the loss (rollout/dropped_stale)."
        ),
    )
    routing: Literal["group", "sample"] = Field(
        "group",
        description=(
            "How requests are spread over the engines. 'group': a GRPO group's samples go to one "
            "engine (least requests in flight when the group starts; its retries too), so the "
            "prompt's KV is computed once and reused from that engine's prefix cache. 'sample': "
            "each sample to the engine with the fewest requests in flight."
        ),
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="Cap on concurrent requests over all engines; None: the whole batch.",
    )
    max_aborted_retries: int = Field(
        3, ge=0, description="Resubmit a request the engine aborted (abort-mode pause) this often."
    )
    shuffle_seed: int = Field(0, description="Seed of the per-epoch prompt order.")
    salt_by_version: bool = Field(
        True,
        description=(
            "Give each request vLLM's cache_salt for the weight version the engines serve when "
            "it is submitted, so no new request starts from prefix KV another version computed "
            "(without clear_cache_on_pause the prefix cache cannot be flushed while kept "
            "requests hold blocks). A request submitted before a sync but first scheduled "
            "after it still carries the old salt: its sample is then not counted as one "
            "version's (see RolloutSample.salt_version)."
        ),
    )
    unlabelled_version: int = Field(
        0,
        description=(
            "Weight version of tokens generated before any labelled weight update (vLLM labels "
            "them 'default' or None), i.e. on the initial weights."
        ),
    )


class OffPolicyConfig(StrictModel):
    """Importance weights w = pi_old / pi_rollout: the trainer's policy before the step (old) over
    the engine's sampling policy (rollout, its log-probs returned with each token). They correct
    the loss for staleness (tokens sampled by older versions) and for trainer/engine mismatch
    (kernels, precision). Each token's objective is multiplied by its w (detached), after `cap`
    and the masks.

    level: `token` w_t = exp(old_t - rollout_t) (TIS with a cap); `sequence` one w per sample,
    exp(sum_t (old_t - rollout_t)); `geometric` one per sample, exp(mean_t (old_t - rollout_t))
    (length-independent); `off` no weights (the PPO clip alone bounds the update).
    Masked IS: a token (`token`) or a whole sample (`sequence`, `geometric`) whose w is below
    `mask_below` or above `mask_above` contributes nothing (the loss's denominator keeps it, so
    a step with many masked tokens does not grow its update). `train/is_*` metrics say how many.
    """

    level: Literal["off", "token", "sequence", "geometric"] = Field(
        "off", description="Importance-weight level: off, token, sequence or geometric."
    )
    cap: float | None = Field(
        None, gt=0, description="Truncate w at this value (truncated IS); None: no truncation."
    )
    mask_below: float | None = Field(
        None, gt=0, description="Mask tokens (samples) whose w is below this; None: none."
    )
    mask_above: float | None = Field(
        None, gt=0, description="Mask tokens (samples) whose w is above this; None: none."
    )

    @model_validator(mode="after")
    def _consistent(self) -> OffPolicyConfig:
        bounds = {"cap": self.cap, "mask_below": self.mask_below, "mask_above": self.mask_above}
        given = [name for name, value in bounds.items() if value is not None]
        if self.level == "off" and given:
            raise ValueError(
                f"grpo.off_policy.{given[0]} is set but grpo.off_policy.level is 'off': set "
                "level to token, sequence or geometric (or remove it)"
            )
        if (
            self.mask_below is not None
            and self.mask_above is not None
            and self.mask_below >= self.mask_above
        ):
            raise ValueError(
                f"grpo.off_policy.mask_below={self.mask_below} must be below "
                f"mask_above={self.mask_above}: no weight would pass"
            )
        return self


class GRPOConfig(StrictModel):
    """Policy-loss settings."""

    clip_low: float = Field(0.2, ge=0, description="PPO clip: ratio is kept >= 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="PPO clip: ratio is kept <= 1 + clip_high.")
    kl_coef: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of the KL penalty to the reference policy (the initial or SFT weights, frozen "
            "by the trainer); 0 disables it and builds no reference model."
        ),
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k3",
        description=(
            "How the KL to the reference enters, with d = ref - train log-prob per sampled token. "
            "k1: a per-token penalty -kl_coef * (train - ref) on the advantage (detached; the "
            "KL-in-reward form, whose policy gradient descends KL(train || ref)). k3: a loss term "
            "kl_coef * (exp(d) - d - 1) (non-negative, low variance; its gradient is that of "
            "KL(ref || train)). kl_ref logs the estimate's token mean."
        ),
    )
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    advantage_eps: float = Field(1e-6, gt=0, description="eps in (r - mean) / (std + eps).")
    normalize_std: bool = Field(
        True, description="Divide group-centred rewards by the group std (False: Dr. GRPO style)."
    )
    token_level_mean: bool = Field(
        True,
        description=(
            "Average the loss over all response tokens of the batch (True) or per sequence first, "
            "then over sequences (False)."
        ),
    )


class SFTConfig(StrictModel):
    """The supervised stage before RL; off unless `data_path` is set and `num_steps` > 0."""

    data_path: str | None = Field(
        None, description="JSONL of demonstrations: prompt and completion per line."
    )
    num_steps: int = Field(0, ge=0, description="Supervised optimizer steps before RL.")
    batch_size: int = Field(32, ge=1, description="Demonstrations per step (all ranks together).")
    lr: float | None = Field(None, gt=0, description="AdamW learning rate; None: trainer.lr.")
    seed: int = Field(0, description="Shuffle seed of the demonstrations (one order per epoch).")

    @property
    def enabled(self) -> bool:
        return self.data_path is not None and self.num_steps > 0


class EvalConfig(StrictModel):
    """Held-out evaluation in the RL job: greedy, one sample per prompt, the rollout's reward."""

    prompts_path: str | None = Field(
        None,
        description=(
            "JSONL of held-out prompts (e.g. the task's test.jsonl); None: no evaluation. Run "
            "before the first rollout and after the last sync, through the job's engines."
        ),
    )
    max_tokens: int | None = Field(None, ge=1, description="None: rollout.max_tokens.")
    timeout_s: float = Field(
        300.0,
        gt=0,
        description=(
            "Longest one evaluation may take (the other trainer ranks wait meanwhile, so it must "
            "stay below weight_sync.barrier_timeout_s)."
        ),
    )

    def rollout_config(self, rollout: RolloutConfig, num_prompts: int) -> RolloutConfig:
        """The rollout settings for one greedy pass over every one of the `num_prompts`
        held-out prompts."""
        assert self.prompts_path is not None
        return rollout.model_copy(
            update={
                "prompts_path": self.prompts_path,
                "num_prompts_per_step": num_prompts,
                "num_samples_per_prompt": 1,
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": -1,
                "max_tokens": self.max_tokens or rollout.max_tokens,
                "shuffle_seed": 0,
            }
        )
