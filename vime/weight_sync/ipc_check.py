"""Checks the CUDA IPC half of the `ipc` transport without vLLM: a bucket packed on this GPU is
opened from a second process through the same handle the engine would get, and read bit-exactly.

    python -m vime.weight_sync.ipc_check [--mib 256] [--repeats 5]

Prints the figures (pack, export, open+read, checksum agreement) as JSON. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp

from vime.weight_sync.buckets import pack, plan_buckets, tensor_digest, unpack


def _consumer(bucket_dict, ipc_args, queue) -> None:
    """The engine's side: rebuild the tensor from the handle, unpack views, hash them."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from vime.weight_sync.buckets import Bucket

    bucket = Bucket.from_dict(bucket_dict)
    started = time.perf_counter()
    buffer = rebuild_cuda_tensor(*ipc_args)
    # Clone out, as vLLM's packed IPC consumer does before answering, then drop the mapping.
    views = {name: view.clone() for name, view in unpack(buffer[: bucket.nbytes], bucket)}
    torch.cuda.synchronize()
    read_s = time.perf_counter() - started
    del buffer
    queue.put({"read_s": read_s, "digests": {n: tensor_digest(t) for n, t in views.items()}})


def run_check(num_mib: int, repeats: int) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("ipc_check needs CUDA")
    from torch.multiprocessing.reductions import reduce_tensor

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
    (bucket,) = plan_buckets(meta, max_bucket_bytes=2 * num_mib * 1024**2, alignment=1)
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device="cuda")
    expected = {name: tensor_digest(t) for name, t in tensors.items()}
    ctx = mp.get_context("spawn")
    results = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        pack(tensors, bucket, buffer)
        torch.cuda.synchronize()
        pack_s = time.perf_counter() - started
        started = time.perf_counter()
        _, ipc_args = reduce_tensor(buffer)
        export_s = time.perf_counter() - started
        queue = ctx.Queue()
        process = ctx.Process(target=_consumer, args=(bucket.to_dict(), ipc_args, queue))
        process.start()
        answer = queue.get(timeout=120)
        process.join(timeout=60)
        results.append(
            {
                "pack_s": pack_s,
                "pack_GBps": bucket.nbytes / pack_s / 1e9,
                "export_s": export_s,
                "open_and_read_s": answer["read_s"],
                "bit_exact": answer["digests"] == expected,
            }
        )
    torch.cuda.ipc_collect()
    return {
        "device": torch.cuda.get_device_name(),
        "bucket_bytes": bucket.nbytes,
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
