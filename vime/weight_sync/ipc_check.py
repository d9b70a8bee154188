"""Drives the shipped `IpcTransport` on one GPU without vLLM: the transport packs, exports and
posts each bucket exactly as in a sync; the "engine" is a second process that opens the handle
the way vLLM's IPC engine does (the update_info's `ipc_handles_pickled`, keyed by GPU UUID),
reads the tensors bit for bit and answers, so the transport may refill its buffer.

    python -m vime.weight_sync.ipc_check [--mib 256] [--repeats 5]

Prints the figures (pack, transfer incl. the consumer's open + read, agreement) as JSON. Needs
CUDA. (The update goes to the consumer over a local multiprocessing queue, not over HTTP.)
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from vime.weight_sync.buckets import Bucket, plan_buckets, tensor_digest, unpack
from vime.weight_sync.buckets import pack as pack_bucket
from vime.weight_sync.transports.ipc import IpcTransport


def _consumer(requests: Any, answers: Any) -> None:
    """The engine's side, one update_info after another until None."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    while (info := requests.get()) is not None:
        started = time.perf_counter()
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))  # local, trusted
        buffer = rebuild_cuda_tensor(*handles[uuid])
        offsets = [sum(info["tensor_sizes"][:i]) for i in range(len(info["tensor_sizes"]))]
        described = {
            "index": 0,
            "offsets": offsets,  # dense: vLLM's IPC engine reads the tensors back to back
            "nbytes": sum(info["tensor_sizes"]),
            "names": info["names"],
            "dtype_names": info["dtype_names"],
            "shapes": info["shapes"],
        }
        bucket = Bucket.from_dict(described)
        # Clone out, as vLLM's packed IPC consumer does before answering, then drop the mapping.
        views = {name: view.clone() for name, view in unpack(buffer[: bucket.nbytes], bucket)}
        torch.cuda.synchronize()
        read_s = time.perf_counter() - started
        del buffer
        answers.put({"read_s": read_s, "digests": {n: tensor_digest(t) for n, t in views.items()}})


def run_check(num_mib: int, repeats: int) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("ipc_check needs CUDA")
    generator = torch.Generator(device="cuda").manual_seed(0)
    numel = num_mib * 1024**2 // 2 // 4
    tensors = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(
            numel, device="cuda", dtype=torch.bfloat16, generator=generator
        ),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(
            numel // 2, device="cuda", dtype=torch.float32, generator=generator
        ),
        "model.norm.weight": torch.randn(4096, device="cuda", dtype=torch.float32),
    }
    meta = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    # Two buckets: the transport reuses its one staging buffer across them.
    buckets = plan_buckets(meta, max_bucket_bytes=num_mib * 1024**2 // 2, alignment=1)
    expected = {name: tensor_digest(t) for name, t in tensors.items()}
    ctx = mp.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_consumer, args=(requests, answers))
    consumer.start()
    seen: dict[str, str] = {}
    timer = {"pack": 0.0}

    def update_weights(info: dict) -> None:  # what VLLMEngine.update_weights would POST
        requests.put(info)
        answer = answers.get(timeout=120)
        seen.update(answer["digests"])
        timer["read"] = timer.get("read", 0.0) + answer["read_s"]

    def fill(bucket: Bucket, buffer: torch.Tensor) -> None:
        began = time.perf_counter()
        pack_bucket(tensors, bucket, buffer)
        torch.cuda.synchronize()
        timer["pack"] += time.perf_counter() - began

    results = []
    transport = IpcTransport(timeout_s=120)
    try:
        transport.connect([lambda info: None])
        for _ in range(repeats):
            seen.clear()
            timer.clear()
            timer["pack"] = 0.0
            started = time.perf_counter()
            transport.send_buckets(buckets, fill, [update_weights])
            total_s = time.perf_counter() - started
            results.append(
                {
                    "buckets": len(buckets),
                    "total_s": total_s,
                    "pack_s": timer["pack"],
                    "consumer_open_read_s": timer.get("read", 0.0),
                    "GBps": sum(b.nbytes for b in buckets) / total_s / 1e9,
                    "bit_exact": seen == expected,
                }
            )
    finally:
        requests.put(None)
        consumer.join(timeout=60)
        transport.close()
    return {
        "device": torch.cuda.get_device_name(),
        "bytes": sum(b.nbytes for b in buckets),
        "runs": results,
        "all_bit_exact": all(r["bit_exact"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="approximate bucket size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    report = run_check(args.mib, args.repeats)
    print(json.dumps(report, indent=2))
    if not report["all_bit_exact"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
