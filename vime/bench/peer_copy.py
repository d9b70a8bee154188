"""`vime bench-sync --peer-copy`: the two ways a fleet joiner gets the current weights, measured.

    vime bench-sync --peer-copy                               # Qwen2.5-0.5B shape, bf16, shm
    vime bench-sync --peer-copy --preset qwen2-tiny --delta-steps 2

Two vLLM CPU engines (the live one and the joiner) take delta syncs from a one-rank trainer whose
bf16 parameters follow real AdamW steps on fp32 masters (`vime.bench.delta`, the first of
--delta-lrs). Per step, both ways a join can happen (fleet.first_weights):

- **trainer**: the join step's sync is full, for every engine (every engine is paused for it,
  every byte leaves the trainer);
- **engine**: the live engine copies its weights to the joiner, engine to engine (gloo, the
  trainer untouched; `vime.weight_sync.peer_copy`, its checksum comparison included), then the
  step's sync is a delta for both.

Prints medians over the steps (n stated) of each way's seconds and bytes; writes every step to
--out/bench_peer_copy.json. Both syncs are verified by checksums (not timed).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

import torch
import torch.distributed as dist

from vime.bench.delta import bf16_trainer, masters_step, sync_seconds, write_figures

logger = logging.getLogger("vime.bench")


def bench_peer_copy(args: argparse.Namespace, topology: Any, sync_group: Any) -> dict[str, Any]:
    """Run the benchmark on this rank (world of one); rank 0 writes and prints the figures."""
    from vime.bench.sync_setup import pin_trainer, running_engine, training_batch
    from vime.weight_sync.peer_copy import copy_from_peer

    if dist.get_world_size() != 1:
        raise SystemExit("--peer-copy runs on one trainer rank (--tp 1)")
    dtype = "bfloat16"
    model_dir, trainer = bf16_trainer(args, topology, sync_group)
    (transport,) = args.transports[:1]
    lr = args.delta_lrs[0]
    figures: dict[str, Any] = {
        "preset": args.preset,
        "dtype": dtype,
        "transport": transport,
        "lr": lr,
    }
    with (
        running_engine(args, model_dir, dtype, transport) as live,
        running_engine(args, model_dir, dtype, transport, name="-joiner") as joiner,
    ):
        pin_trainer()
        bucket_bytes = args.bucket_mib * 1024**2
        config = {"kind": transport, "delta": True}
        sync = trainer.updater(config, [live, joiner], bucket_bytes, 0, verify_checksums=True)
        sync.update_weights()  # the first sync is full: both engines' baseline
        masters = [
            p.detach().float().clone().requires_grad_(True) for p in trainer.model.parameters()
        ]
        optimizer = torch.optim.AdamW(masters, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        vocab = trainer.converter.dims.vocab_size
        rows = []
        for step in range(args.delta_steps):
            batch = training_batch(model_dir, vocab, 2 * step)
            masters_step(trainer.model, masters, optimizer, vocab, batch)
            sync.reset_delta()  # fleet.first_weights=trainer: the join step's sync is full for all
            full = sync.update_weights()
            batch = training_batch(model_dir, vocab, 2 * step + 1)
            masters_step(trainer.model, masters, optimizer, vocab, batch)
            copy = copy_from_peer(
                live,
                joiner,
                address="127.0.0.1",
                version=sync.weight_version,
                bucket_bytes=bucket_bytes,
                timeout_s=900,
            )
            delta = (
                sync.update_weights()
            )  # fleet.first_weights=engine: the step's sync stays a delta
            assert (full.delta, delta.delta) == ("full", "delta"), (full.delta, delta.delta)
            rows.append(
                {
                    "step": step,
                    "full_s": sync_seconds(full),
                    "full_bytes": full.num_bytes,
                    "peer_copy_s": copy.seconds,
                    "peer_copy_send_s": copy.send_s,
                    "peer_copy_bytes": copy.bytes,
                    "delta_s": sync_seconds(delta),
                    "delta_bytes": delta.num_bytes,
                    "changed_fraction": delta.changed_fraction,
                    "verified": full.verified and delta.verified,
                }
            )
            logger.info("peer-copy bench step %d: %s", step, rows[-1])
        sync.close()
    figures["steps"] = rows
    write_figures(args, "bench_peer_copy", figures, format_peer_copy(figures))
    return figures


def format_peer_copy(figures: dict[str, Any]) -> str:
    rows = figures["steps"]

    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    n = len(rows)
    return "\n".join(
        [
            f"a joiner's weights, {figures['preset']} {figures['dtype']}, syncs over "
            f"{figures['transport']}, two engines (medians of {n} steps, AdamW lr "
            f"{figures['lr']:g}, {median('changed_fraction'):.2%} of elements changed per step)",
            "| fleet.first_weights | what the join step costs | seconds | bytes from the trainer |",
            "|---|---|---|---|",
            f"| trainer | full sync, both engines paused | {median('full_s'):.3f} | "
            f"{median('full_bytes') / 1e6:.1f} MB |",
            "| engine | peer copy (engine to engine, checksums compared) | "
            f"{median('peer_copy_s'):.3f} "
            f"(the live engine sends for {median('peer_copy_send_s'):.3f}; "
            f"{median('peer_copy_bytes') / 1e6:.1f} MB) | 0 |",
            f"| engine | then the step's delta sync, both engines paused | "
            f"{median('delta_s'):.3f} | {median('delta_bytes') / 1e6:.1f} MB |",
        ]
    )
