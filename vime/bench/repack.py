"""`python -m vime.bench.repack MODEL_DIR`: vLLM's CPU kernel repack of a checkpoint's weights
alone, the part of every sync into a vLLM CPU engine that no copy avoidance removes.

A vLLM CPU engine serves each linear layer from a oneDNN-packed copy of its weight
(`dispatch_cpu_unquantized_gemm` -> `create_onednn_mm`), rebuilt after every weight update. This
repacks every linear weight of the checkpoint (the 2-D tensors but the input embedding, which is a
lookup; the embedding too when the head is tied, since vLLM repacks it as the output layer), each
round replacing the last one's kernels as a sync does, on 1 and on N threads pinned to a core
each with one OpenMP thread (as the engine's load threads), and prints the median and fastest
round against one memcpy of the same bytes. Run it alone: it is a probe, not a benchmark row
(inside another busy process its rounds were up to 2x slower than the engine's whole load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch


def linear_weights(weights: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a vLLM CPU engine repacks: 2-D, the embedding only when the head is tied."""
    tied = "lm_head.weight" not in weights
    return [
        t
        for name, t in weights.items()
        if t.ndim == 2 and (tied or not name.endswith("embed_tokens.weight"))
    ]


def repack_rounds(linear: list[torch.Tensor], threads: int, rounds: int) -> list[float]:
    """Seconds of each of `rounds` timed repacks of `linear` (after one untimed warm-up)."""
    from vllm import _custom_ops as ops

    kernels: list[Any] = [None] * len(linear)
    cores = iter(sorted(os.sched_getaffinity(0)))
    lock = threading.Lock()

    def one_core_each() -> None:
        with lock:
            core = next(cores, None)
        if core is not None:
            os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)

    def repack(part: int) -> None:
        for index in range(part, len(linear), threads):
            kernels[index] = ops.create_onednn_mm(linear[index].t(), 32)

    seconds = []
    with ThreadPoolExecutor(max_workers=threads, initializer=one_core_each) as pool:
        for round_ in range(rounds + 1):
            began = time.perf_counter()
            list(pool.map(repack, range(threads)))
            if round_:
                seconds.append(time.perf_counter() - began)
    return seconds


def memcpy_rounds(linear: list[torch.Tensor], rounds: int) -> list[float]:
    """Seconds of each of `rounds` copies of the same tensors into memory already touched."""
    targets = [torch.empty_like(t).copy_(t) for t in linear]
    seconds = []
    for _ in range(rounds):
        began = time.perf_counter()
        for target, source in zip(targets, linear, strict=True):
            target.copy_(source)
        seconds.append(time.perf_counter() - began)
    return seconds


def main(argv: list[str] | None = None) -> None:
    from safetensors.torch import load_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="HF checkpoint dir (model.safetensors)")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds per thread count")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and N")
    args = parser.parse_args(argv)
    counts = args.threads or sorted({1, len(os.sched_getaffinity(0))})
    weights = load_file(args.model_dir / "model.safetensors")
    linear = [t.clone() for t in linear_weights(weights)]  # in memory, not the file's pages
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "model": args.model_dir.name,
        "tensors": len(linear),
        "GB": sum(t.nbytes for t in linear) / 1e9,
        "rounds": args.rounds,
    }
    copies = memcpy_rounds(linear, args.rounds)
    report["memcpy_1_thread_s"] = {"median": statistics.median(copies), "min": min(copies)}
    for threads in counts:
        seconds = repack_rounds(linear, threads, args.rounds)
        report[f"repack_{threads}_threads_s"] = {
            "median": statistics.median(seconds),
            "min": min(seconds),
            "all": [round(s, 4) for s in seconds],
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
