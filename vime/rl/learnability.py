"""Check that a task is learnable by a checkpoint, without engines: GRPO with transformers alone.

Samples groups with `model.generate`, scores them with the task's reward, and takes GRPO steps with
vime.rl.loss (on-policy, so the log-prob diff is 0). A reference curve for the real loop, whose
reward should climb at least as fast at the same batch size and learning rate.

    python -m vime.rl.learnability --model models/test-cache/qwen2-tiny-float32-0 --out runs/learn
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

import torch

from vime.rl.data import DIGIT_REPEAT_TEST, DIGIT_REPEAT_TRAIN, PromptRecord, load_prompts
from vime.rl.loss import group_advantages, grpo_loss
from vime.rl.metrics import MetricsWriter, prefixed
from vime.rl.rewards import RewardFn, load_reward_fn

logger = logging.getLogger(__name__)


def sample(model, tokenizer, records: list[PromptRecord], max_tokens: int):
    """Left-padded prompts -> (prompt ids, attention mask, response ids), sampled at T=1."""
    ids = [tokenizer(record.prompt).input_ids for record in records]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(row)) + row for row in ids])
    attention = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids])
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_tokens,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
    return input_ids, attention, output[:, width:]


def score(tokenizer, records, responses, reward_fn: RewardFn) -> torch.Tensor:
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    pairs = zip(records, texts, strict=True)
    return torch.tensor([reward_fn(record.prompt, text, record.metadata) for record, text in pairs])


def run(
    model_dir: str,
    *,
    out: str,
    steps: int,
    lr: float,
    num_prompts: int,
    group_size: int,
    max_tokens: int,
    reward_path: str,
    seed: int,
    train_path: str = str(DIGIT_REPEAT_TRAIN),
    test_path: str = str(DIGIT_REPEAT_TEST),
) -> list[float]:
    """GRPO steps on train_path, the test set scored before and after; returns reward per step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reward_fn = load_reward_fn(reward_path)
    train, test = load_prompts(train_path), load_prompts(test_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    curve = []
    with MetricsWriter(out) as writer:
        model.eval()
        _, _, responses = sample(model, tokenizer, test, max_tokens)
        initial = score(tokenizer, test, responses, reward_fn).mean().item()
        writer.log(0, {"eval/reward_mean": initial})
        logger.info("test reward before training: %.3f", initial)
        start = time.monotonic()
        for step in range(steps):
            records = [r for r in rng.sample(train, num_prompts) for _ in range(group_size)]
            model.eval()
            prompt_ids, attention, responses = sample(model, tokenizer, records, max_tokens)
            rewards = score(tokenizer, records, responses, reward_fn)
            # Response tokens up to and including the first end-of-text.
            is_eos = (responses == eos).long()
            mask = ((is_eos.cumsum(1) - is_eos) == 0).float()
            full = torch.cat([prompt_ids, responses], dim=1)
            model.train()
            logits = model(
                full, attention_mask=torch.cat([attention, torch.ones_like(responses)], 1)
            )
            logits = logits.logits[:, prompt_ids.shape[1] - 1 : -1].float()
            logprobs = torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]
            advantages = group_advantages(rewards, group_size)
            loss, metrics = grpo_loss(logprobs, logprobs.detach(), advantages, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curve.append(rewards.mean().item())
            writer.log(
                step,
                {
                    "rollout/reward_mean": rewards.mean().item(),
                    "time/elapsed_s": time.monotonic() - start,
                    **prefixed(metrics, "train/"),
                },
            )
            if step % 10 == 0 or step == steps - 1:
                logger.info(
                    "step %d reward %.3f (%.0f s)", step, curve[-1], time.monotonic() - start
                )
        model.eval()
        _, _, responses = sample(model, tokenizer, test, max_tokens)
        final = score(tokenizer, test, responses, reward_fn).mean().item()
        writer.log(steps, {"eval/reward_mean": final})
        logger.info("test reward after %d steps: %.3f", steps, final)
    return curve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--out", default="runs/learnability", help="metrics directory")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--reward-fn", default="vime.rl.rewards:digit_match")
    parser.add_argument("--train", default=str(DIGIT_REPEAT_TRAIN), help="JSONL prompts")
    parser.add_argument("--test", default=str(DIGIT_REPEAT_TEST), help="JSONL prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    run(
        args.model,
        out=args.out,
        steps=args.steps,
        lr=args.lr,
        num_prompts=args.num_prompts,
        group_size=args.group_size,
        max_tokens=args.max_tokens,
        reward_path=args.reward_fn,
        seed=args.seed,
        train_path=args.train,
        test_path=args.test,
    )
    print(Path(args.out) / "summary.txt")


if __name__ == "__main__":
    main()
