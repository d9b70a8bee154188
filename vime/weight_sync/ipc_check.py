"""Drives the shipped colocated transport with its CUDA IPC plug-in on one GPU without vLLM: the
transport packs, exports and posts each bucket exactly as in a sync; the "engine" is a second
process that opens each bucket's handle with the receiver's own plug-in code (`IpcHandles.open`,
the handle of its GPU's device id), reads the tensors bit for bit and answers.

    python -m vime.weight_sync.ipc_check [--mib 256] [--repeats 5]

Prints the figures (pack, transfer incl. the consumer's open + read, agreement) as JSON. Needs
CUDA. (The update goes to the consumer over a local multiprocessing queue, not over HTTP.)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.multiprocessing as mp

from vime.weight_sync.buckets import Bucket, plan_buckets, tensor_digest, unpack
from vime.weight_sync.buckets import pack as pack_bucket
from vime.weight_sync.devices import device_id
from vime.weight_sync.devices.cuda import IpcHandles
from vime.weight_sync.transports.colocated import ColocatedTransport


def _consumer(requests: Any, answers: Any) -> None:
    """The engine's side, one update_info after another until None, as vime's colocated receiver
    does it: the handle of this worker's device id, opened once and kept while it repeats; each
    tensor cloned out before the answer (the check's copy, not the receiver's)."""
    device = torch.device("cuda", torch.cuda.current_device())
    mine = device_id(device)
    opened: dict[str, torch.Tensor] = {}
    while (info := requests.get()) is not None:
        started = time.perf_counter()
        (described,) = info["buckets"]
        bucket = Bucket.from_dict(described)
        handle = described["handles"].get(mine)
        if handle is None:
            answers.put({"error": f"no handle for device {mine}: {sorted(described['handles'])}"})
            continue
        key = IpcHandles.key(handle)
        if key not in opened:
            opened[key] = IpcHandles.open(handle, bucket.nbytes, device)
        views = {n: v.clone() for n, v in unpack(opened[key][: bucket.nbytes], bucket)}
        torch.cuda.synchronize()
        read_s = time.perf_counter() - started
        digests = {n: tensor_digest(t) for n, t in views.items()}  # the check's own cost
        digest_s = time.perf_counter() - started - read_s
        answers.put({"read_s": read_s, "digest_s": digest_s, "digests": digests})
    opened.clear()


def send_through_ipc(
    tensors: Mapping[str, torch.Tensor], bucket_bytes: int, repeats: int = 1
) -> list[dict[str, Any]]:
    """Send `tensors` (on this GPU) through the shipped colocated transport to a consumer process,
    `repeats` times; per run: timings and whether the consumer read every tensor bit for bit."""
    meta = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    buckets = plan_buckets(
        meta, max_bucket_bytes=bucket_bytes, alignment=ColocatedTransport.alignment
    )
    num_bytes = sum(b.nbytes for b in buckets)
    expected = {name: tensor_digest(t) for name, t in tensors.items()}
    ctx = mp.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_consumer, args=(requests, answers), daemon=True)
    consumer.start()
    seen: dict[str, str] = {}
    timer: dict[str, float] = {}

    def update_weights(info: dict) -> None:  # what VLLMEngine.update_weights would POST
        requests.put(info)
        answer = answers.get(timeout=120)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        seen.update(answer["digests"])
        timer["read"] += answer["read_s"]
        timer["digest"] += answer["digest_s"]

    def fill(bucket: Bucket, buffer: torch.Tensor) -> None:
        began = time.perf_counter()
        pack_bucket(tensors, bucket, buffer)
        torch.cuda.synchronize()
        timer["pack"] += time.perf_counter() - began

    results = []
    device = torch.device("cuda", torch.cuda.current_device())
    transport = ColocatedTransport(
        handles=IpcHandles(device), device_id=device_id(device), device=device, timeout_s=120
    )
    try:
        transport.connect([lambda info: None])
        for _ in range(repeats):
            seen.clear()
            timer.update(pack=0.0, read=0.0, digest=0.0)
            started = time.perf_counter()
            transport.send_buckets(buckets, fill, [update_weights])
            # The consumer's digest of what it read (on the CPU) is the check, not the transfer.
            total_s = time.perf_counter() - started - timer["digest"]
            results.append(
                {
                    "buckets": len(buckets),
                    "bytes": num_bytes,
                    "total_s": total_s,
                    "pack_s": timer["pack"],
                    "consumer_open_read_s": timer["read"],
                    "check_digest_s": timer["digest"],
                    "GBps": num_bytes / total_s / 1e9,
                    "bit_exact": seen == expected,
                    "mismatched": sorted(n for n in expected if seen.get(n) != expected[n])[:5],
                }
            )
    finally:
        requests.put(None)
        consumer.join(timeout=60)
        if consumer.is_alive():
            consumer.kill()
        transport.close()
    return results


def qwen2_7b_shapes() -> dict[str, tuple[int, ...]]:
    """Qwen2.5-7B's HF tensors (28 layers, hidden 3584, GQA 28/4 heads, MLP 18944, vocab
    152064, untied head): 7.6 B parameters, the model of the GPU projection
    (docs/benchmarks.md)."""
    hidden, mlp, kv, vocab = 3584, 18944, 512, 152064
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(28):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (mlp, hidden),
            p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp),
        }
    return shapes | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}


def run_check(num_mib: int, repeats: int, shape: str | None = None) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("ipc_check needs CUDA")
    generator = torch.Generator(device="cuda").manual_seed(0)
    if shape == "qwen2.5-7b":
        # bf16 weights in buckets of `num_mib` MiB, as a sync of that model would send them.
        tensors = {
            name: torch.randn(dims, device="cuda", dtype=torch.bfloat16, generator=generator)
            for name, dims in qwen2_7b_shapes().items()
        }
        bucket_bytes = num_mib * 1024**2
    else:
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
        # Two buckets, each in a buffer of its own, refilled by the later repeats.
        bucket_bytes = num_mib * 1024**2 // 2
    results = send_through_ipc(tensors, bucket_bytes, repeats)
    return {
        "device": torch.cuda.get_device_name(),
        "shape": shape or f"3 tensors, {num_mib} MiB",
        "bytes": results[0]["bytes"],
        "runs": results,
        "all_bit_exact": all(r["bit_exact"] for r in results),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="approximate bucket size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--shape",
        choices=["qwen2.5-7b"],
        help="send a whole model's tensors (random bf16) in --mib buckets instead of 3 tensors",
    )
    args = parser.parse_args(argv)
    report = run_check(args.mib, args.repeats, args.shape)
    print(json.dumps(report, indent=2))
    if not report["all_bit_exact"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
