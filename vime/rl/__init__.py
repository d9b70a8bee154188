"""The pieces of vime's async RL loop, independent of weight sync.

- `data`: JSONL prompt files and the built-in digit-repeat task (`vime/data/digit_repeat/`).
- `rewards`: reward functions, loaded by dotted path (`load_reward_fn("vime.rl.rewards:...")`).
- `rollout`: RolloutManager / RolloutThread: groups of samples from the vLLM engines, with
  per-token log-probs and weight versions, staleness, and packing into trainer tensors.
- `loss`: GRPO advantages and the PPO-clipped loss (optional k3 KL, truncated IS), pure torch.
- `metrics`: metrics JSONL, TensorBoard, a PNG of the run's curves and a text summary.
- `evaluate`: `python -m vime.rl.evaluate --model DIR` scores a checkpoint on the task via vLLM.
"""
