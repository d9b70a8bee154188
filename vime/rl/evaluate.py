"""Held-out evaluation: score a policy on a prompt set by sampling it with vLLM.

In the RL job (`eval.prompts_path`): greedy pass@1 on every held-out prompt through the job's own
engines, before the first rollout and after the last sync (`EvalConfig`, `eval_metrics`). As a
command, a checkpoint on its own: mean reward and a few completions.

    python -m vime.rl.evaluate --model models/test-cache/qwen2-tiny-float32-0
    python -m vime.rl.evaluate --model DIR --url http://127.0.0.1:8000 --samples 8

Launches one CPU vLLM server for the model (or uses --url) and ends it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math

from vime.config import EngineConfig, RolloutConfig
from vime.engines.generation import GenerationClient
from vime.engines.vllm_engine import VLLMEngine
from vime.rl.data import DIGIT_REPEAT_TEST, load_prompts
from vime.rl.rollout import RolloutManager
from vime.rl.samples import RolloutBatch


def eval_metrics(batch: RolloutBatch) -> dict[str, float]:
    """pass@1 (share of prompts whose greedy completion scores >= 1) and the mean reward."""
    rewards = batch.rewards
    return {
        "eval/pass_at_1": sum(r >= 1.0 for r in rewards) / len(rewards),
        "eval/reward_mean": sum(rewards) / len(rewards),
        "eval/num_prompts": float(len(rewards)),
    }


async def evaluate(
    config: RolloutConfig, url: str, tokenizer, token: str | None = None
) -> RolloutBatch:
    async with GenerationClient([url], token=token) as client:
        manager = RolloutManager(config, client=client, tokenizer=tokenizer)
        return await manager.generate_batch(step=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--prompts", default=str(DIGIT_REPEAT_TEST))
    parser.add_argument("--reward-fn", default="vime.rl.rewards:digit_match")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--url", help="an already running server; none is launched")
    parser.add_argument("--token", help="that server's token ($VIME_ENGINE_TOKEN), if it has one")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = RolloutConfig(
        prompts_path=args.prompts,
        reward_fn=args.reward_fn,
        num_prompts_per_step=len(load_prompts(args.prompts)),
        num_samples_per_prompt=args.samples,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
    )
    engine = VLLMEngine(
        EngineConfig(
            model_path=args.model,
            max_model_len=512,
            worker_extension_cls=None,
            auth_token=args.token,
        ),
        url=args.url,
    )
    engine.init()
    try:
        batch = asyncio.run(evaluate(config, engine.url, tokenizer, engine.auth_token))
    finally:
        engine.shutdown()
    rewards = batch.rewards
    mean = sum(rewards) / len(rewards)
    stderr = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards) / len(rewards))
    examples = [
        {"prompt": s.prompt_text, "completion": s.completion_text, "reward": s.reward}
        for s in batch.samples[:: args.samples][:5]
    ]
    print(
        json.dumps(
            {
                "reward_mean": mean,
                "reward_stderr": stderr,
                "num_samples": len(rewards),
                **{k: v for k, v in batch.metrics().items() if k.startswith("rollout/")},
                "examples": examples,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
