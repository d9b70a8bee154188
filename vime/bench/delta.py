"""`vime bench-sync --delta`: full vs delta weight sync after real optimizer steps, side by side.

    vime bench-sync --delta                                   # Qwen2.5-0.5B shape, bf16
    vime bench-sync --delta --preset qwen2-tiny --delta-steps 2 --delta-lrs 1e-5

The trainer holds bf16 parameters with fp32 master weights, as mixed-precision training does:
each step is a real forward and backward on a random token batch (next-token loss), AdamW on the
fp32 masters at the given lr, and the masters rounded into the bf16 parameters. After each step
the same weights go into one vLLM CPU engine three times: a delta sync (only the elements whose
bf16 bits changed), a full sync of the same weights as the delta path sends one (every byte, kept
by both sides as the next delta's baseline), and a sync by the same updater with delta switched
off (what a job without delta pays); all are verified by the engine's checksums (not timed).
Prints per lr: the fraction of elements that changed, bytes on the wire and seconds (first step
to resume, the verification excluded) of each, the engines' pause within them, and the delta's
engine load; writes every step's figures, with each sync's phases, to --out/bench_delta.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("vime.bench")


def masters_step(
    model: torch.nn.Module,
    masters: list[torch.Tensor],
    optimizer: Any,
    vocab_size: int,
    ids: torch.Tensor,
) -> float:
    """One mixed-precision step on the batch `ids`: bf16 grads -> fp32 masters -> AdamW -> bf16
    params."""
    from vime.megatron.forward import token_logprobs

    model.train()
    loss = -token_logprobs(model, ids, vocab_size=vocab_size).mean()
    params = list(model.parameters())
    for param in params:
        param.grad = None
    loss.backward()
    for master, param in zip(masters, params, strict=True):
        master.grad = param.grad.float() if param.grad is not None else torch.zeros_like(master)
    optimizer.step()
    with torch.no_grad():
        for master, param in zip(masters, params, strict=True):
            param.copy_(master)  # rounds to bf16
    return float(loss.detach())


def sync_seconds(report: Any) -> float:
    """Pause to resume, without the checksums (computed on the sender during its send, and
    compared after it): both syncs of a step are verified, neither is timed with it."""
    total = sum(s for phase, s in report.seconds.items() if phase != "verify")
    return total - report.send_seconds.get("checksum", 0.0)


def paused_seconds(report: Any) -> float:
    """The engines' pause (pause request to resume answered), without the verification inside
    it; the trainer's gather, encode and pack before the pause (`prepare`) are not in it."""
    return report.paused_s - report.seconds.get("verify", 0.0)


def bf16_trainer(args: argparse.Namespace, topology: Any, sync_group: Any) -> tuple[Path, Any]:
    """(the bf16 checkpoint of --preset, a one-rank trainer on it) for --delta and --peer-copy."""
    from vime.bench.sync_setup import build_bench_model, build_trainer, unpin

    model_dir = Path(args.model_root) / f"bench-{args.preset}-bfloat16"
    build_bench_model(model_dir, args.preset, "bfloat16")
    unpin()
    return model_dir, build_trainer(model_dir, "bfloat16", topology, sync_group)


def write_figures(args: argparse.Namespace, name: str, figures: dict[str, Any], table: str) -> None:
    """Rank 0: --out/NAME.json and the table on stdout."""
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(figures, indent=2))
        print(table)


def bench_delta(args: argparse.Namespace, topology: Any, sync_group: Any) -> dict[str, Any]:
    """Run the benchmark on this rank (world of one); rank 0 writes and prints the figures."""
    from vime.bench.sync_setup import pin_trainer, running_engine, training_batch

    dtype = "bfloat16"
    model_dir, trainer = bf16_trainer(args, topology, sync_group)
    (transport,) = args.transports[:1]
    figures: dict[str, Any] = {"preset": args.preset, "dtype": dtype, "transport": transport}
    with running_engine(args, model_dir, dtype, transport) as engine:
        pin_trainer()

        transport_config = {"kind": transport, "delta": True}
        bucket_bytes = args.bucket_mib * 1024**2
        sync = trainer.updater(transport_config, engine, bucket_bytes, 0, verify_checksums=True)
        sync.update_weights()  # the first sync is full: the engine's baseline
        # The same weights with delta off (what a job that never sends a delta pays): the same
        # updater, its config's delta switched off for that one sync. (A second updater would
        # replace the first's buffers on the engine: an engine takes one colocated sender.)
        delta_on = sync.config
        delta_off = delta_on.model_copy(
            update={"transport": delta_on.transport.model_copy(update={"delta": False})}
        )
        runs = []
        for lr in args.delta_lrs:
            masters = [
                p.detach().float().clone().requires_grad_(True) for p in trainer.model.parameters()
            ]
            optimizer = torch.optim.AdamW(masters, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
            rows = []
            for step in range(args.delta_steps):
                began = time.perf_counter()
                vocab = trainer.converter.dims.vocab_size
                ids = training_batch(model_dir, vocab, step)
                loss = masters_step(trainer.model, masters, optimizer, vocab, ids)
                step_s = time.perf_counter() - began
                delta = sync.update_weights()
                delta_engine = engine.collective_rpc("vime_weight_update_stats")[0]
                sync.reset_delta()  # the same weights again, every byte of them
                full = sync.resync()
                assert delta.delta == "delta" and full.delta == "full", (delta.delta, full.delta)
                sync.config = delta_off
                try:
                    dense = sync.resync()  # loads what the engine's baseline already holds
                finally:
                    sync.config = delta_on
                assert dense.delta is None, dense.delta
                rows.append(
                    {
                        "step": step,
                        "loss": loss,
                        "train_s": step_s,
                        "changed_fraction": delta.changed_fraction,
                        "delta_bytes": delta.num_bytes,
                        "full_bytes": full.num_bytes,
                        "delta_s": sync_seconds(delta),
                        "full_s": sync_seconds(full),
                        "plain_s": sync_seconds(dense),
                        "delta_paused_s": paused_seconds(delta),
                        "full_paused_s": paused_seconds(full),
                        "plain_paused_s": paused_seconds(dense),
                        "delta_phases": delta.seconds,
                        "delta_send": delta.send_seconds,
                        # Both verified: "verify" (engine read-back and compare) here, and the
                        # sender's digests in the send's "checksum".
                        "full_phases": full.seconds,
                        "full_send": full.send_seconds,
                        "plain_phases": dense.seconds,
                        "plain_send": dense.send_seconds,
                        "engine_stats": delta_engine,  # the delta sync's, on the worker
                        "verified": delta.verified and full.verified and dense.verified,
                    }
                )
                logger.info(
                    "lr %g step %d: %s",
                    lr,
                    step,
                    {
                        k: rows[-1][k]
                        for k in (
                            "changed_fraction",
                            "delta_bytes",
                            "full_bytes",
                            "delta_s",
                            "full_s",
                            "plain_s",
                        )
                    },
                )
            runs.append({"lr": lr, "steps": rows})
        sync.close()
    figures["runs"] = runs
    write_figures(args, "bench_delta", figures, format_delta(figures))
    return figures


def format_delta(figures: dict[str, Any]) -> str:
    """One row per lr: medians over its steps (n stated)."""
    lines = [
        f"delta vs full sync, {figures['preset']} {figures['dtype']} over "
        f"{figures['transport']} (medians of n steps, each a real AdamW step on fp32 masters)",
        "| lr | n | changed elements | delta bytes | full bytes | delta s | full s | "
        "delta off s | engines paused s: delta / full / delta off | engine load s (delta) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in figures["runs"]:
        rows = run["steps"]

        def median(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(row[key] for row in rows)

        load = statistics.median(row["engine_stats"].get("load", 0.0) for row in rows)
        lines.append(
            f"| {run['lr']:g} | {len(rows)} | {median('changed_fraction'):.4%} | "
            f"{median('delta_bytes') / 1e6:.1f} MB | {median('full_bytes') / 1e6:.1f} MB | "
            f"{median('delta_s'):.3f} | {median('full_s'):.3f} | {median('plain_s'):.3f} | "
            f"{median('delta_paused_s'):.3f} / {median('full_paused_s'):.3f} / "
            f"{median('plain_paused_s'):.3f} | {load:.3f} |"
        )
    return "\n".join(lines)
