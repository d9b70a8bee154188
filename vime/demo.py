"""Live demo of the engine control plane: start a vLLM CPU engine, stream requests, pause mid-stream
with mode=keep, show that nothing advances while paused, resume, and show every request finished.

    python -m vime.demo [--model-dir models/qwen2-small] [--num-requests 8] [--max-tokens 200]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from vime.config import EngineConfig
from vime.rollout.generation import GenerationClient, GenerationResult, SamplingConfig
from vime.rollout.vllm_engine import VLLMEngine
from vime.testing.tiny_model import build_tiny_model


async def wait_until(predicate, timeout_s: float, poll_s: float = 0.005) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(poll_s)


async def pause_resume_demo(engine: VLLMEngine, num_requests: int, max_tokens: int) -> None:
    progress: dict[str, int] = {}

    def on_tokens(result: GenerationResult) -> None:
        progress[result.request_id] = len(result.token_ids)

    sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    async with GenerationClient([engine.url], token=engine.auth_token) as client:
        tasks = [
            asyncio.create_task(client.generate([11, 22, 33, i], sampling, on_tokens=on_tokens))
            for i in range(num_requests)
        ]
        await wait_until(
            lambda: len(progress) == num_requests and min(progress.values()) >= 8, timeout_s=120
        )
        start = time.monotonic()
        await asyncio.to_thread(engine.pause_generation, "keep", False)
        pause_ms = (time.monotonic() - start) * 1e3
        at_pause = dict(progress)
        await asyncio.sleep(1.0)
        print(f"paused (keep) in {pause_ms:.0f} ms; is_paused={engine.is_paused()}")
        print(f"  tokens per request at pause: {sorted(at_pause.values())}")
        print(f"  tokens per request 1 s later: {sorted(progress.values())}")
        print(f"  advanced while paused: {progress != at_pause}")
        engine.update_weight_version("demo-v2")  # tokens after resume carry this label
        engine.continue_generation()
        results = await asyncio.gather(*tasks)
    print("resumed; results:")
    for result in results:
        versions = [
            v
            for i, v in enumerate(result.weight_versions)
            if i == 0 or v != result.weight_versions[i - 1]
        ]
        print(
            f"  {result.request_id}: {len(result.token_ids)}/{max_tokens} tokens, "
            f"finish={result.finish_reason}, versions={versions}, "
            f"mean logprob={sum(result.logprobs) / len(result.logprobs):.3f}"
        )
    num_complete = sum(len(r.token_ids) == max_tokens and not r.aborted for r in results)
    print(
        f"{num_complete}/{num_requests} requests complete, none aborted: "
        f"{num_complete == num_requests}"
    )
    if num_complete != num_requests:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="models/qwen2-small")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = build_tiny_model(args.model_dir, "qwen2-small")
    engine = VLLMEngine(EngineConfig(model_path=str(model_dir)), log_dir="runs/demo")
    try:
        engine.init()
        print(
            f"engine up at {engine.url} in {engine.startup_s:.1f} s "
            f"(log {engine.server_log_path()})"
        )
        asyncio.run(pause_resume_demo(engine, args.num_requests, args.max_tokens))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
