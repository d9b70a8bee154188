"""`vime bench-sync`: a weight sync into real vLLM engines, phase by phase, against its floor.

    vime bench-sync                                        # Qwen2.5-0.5B shape, fp32 and bf16
    vime bench-sync --preset qwen2-small --dtypes float32 --iterations 2
    torchrun --nproc-per-node 2 -m vime.bench.sync --tp 2  # TP-sharded trainer ranks

Per dtype: builds the random checkpoint (no download), starts one vLLM CPU engine per transport
(shm, gloo), each on its own cores, loads the same weights into a megatron-core GPTModel on the
trainer rank(s), and then measures, for the same bytes:

- floor:   one memcpy of all the model's bytes into memory already touched;
- shm/gloo: vime's session (pause keep, flush, start, gather, convert, pack, transfer, engine
  load, finish, resume), `--iterations` times after one warm-up sync;
- naive:   the shm session with one update_weights request (and one segment) per tensor;
- disk:    pause, save safetensors, vLLM `reload_weights` from that directory, resume;
- control: a session that moves no bytes: every HTTP round trip and barrier of one sync.
Through each timed sync of shm, gloo and naive a greedy request streams (`--probe-tokens`): its
gap at the version switch is the sync's stall as a client sees it (`vime.bench.stall`). With
`--shadow on|both`, rows TRANSPORT+shadow sync with weight_sync.shadow (load beside the served
weights; both: on the same engine after the plain rows). shm packs its buckets before the
engines pause (weight_sync.pack_before_pause); `--pack in|both` adds rows shm+pack-in-pause.

Prints a table (seconds per phase of the median sync) and writes every figure, iteration by
iteration, to `--out`/bench_sync.json. Each iteration flips the sign of every weight first, so
every sync moves new bytes.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from vime.bench.sync_methods import bench_control, bench_disk, bench_updater, memcpy_floor
from vime.bench.sync_report import report
from vime.bench.sync_results import (
    BENCH_TRANSPORTS,
    PACK_MODES,
    SHADOW_MODES,
    DtypeResult,
    Measurement,
)
from vime.bench.sync_setup import (
    Trainer,
    all_cores,
    build_bench_model,
    build_trainer,
    pin_trainer,
    running_engine,
    unpin,
)
from vime.utils.dist_env import default_to_single_process

logger = logging.getLogger("vime.bench")

# ---- one dtype ---------------------------------------------------------------------------------


def bench_dtype(
    args: argparse.Namespace, preset: str, dtype: str, topology: Any, sync_group: Any
) -> Any:
    from vime.megatron.gather import GatherPlan

    rank = dist.get_rank()
    model_dir = Path(args.model_root) / f"bench-{preset}-{dtype}"
    if rank == 0:
        build_bench_model(model_dir, preset, dtype)
    dist.barrier()
    unpin()
    trainer = build_trainer(model_dir, dtype, topology, sync_group)
    plan = GatherPlan(trainer.model, converter=trainer.converter, topology=trainer.topology)
    metadata = plan.stage_metadata()  # the benchmark's trainer is one stage
    num_bytes = sum(m.dtype.itemsize * math.prod(m.shape) for m in metadata)
    # The machine's floor: every core copying; then the trainer's, on its pinned core(s).
    floor_s = memcpy_floor(num_bytes) if rank == 0 else 0.0
    cores = pin_trainer()
    floor_pinned_s = memcpy_floor(num_bytes) if rank == 0 else 0.0
    logger.info(
        "memcpy floor: %.3f s on all cores, %.3f s on the trainer's %s",
        floor_s,
        floor_pinned_s,
        cores,
    )
    measurements: list[Measurement] = []
    startup: dict[str, float] = {}
    version = 0
    bucket_bytes = args.bucket_mib * 1024**2
    for position, transport in enumerate(args.transports):
        with running_engine(args, model_dir, dtype, transport) as engine:
            pin_trainer()
            startup[transport] = engine.startup_s or 0.0
            for shadow in SHADOW_MODES[args.shadow]:
                # pack_before_pause applies to a colocated sync that pauses for its load.
                aheads = PACK_MODES[args.pack] if transport == "shm" and not shadow else (True,)
                for ahead in aheads:
                    updater = trainer.updater(
                        transport, engine, bucket_bytes, version, shadow=shadow, ahead=ahead
                    )
                    method = transport + ("+shadow" if shadow else "")
                    method += "" if ahead else "+pack-in-pause"
                    measurement, version = bench_and_close(
                        args, method, trainer, updater, engine, dtype, num_bytes
                    )
                    measurements.append(measurement)
            if position == 0:  # the baselines run on the first engine
                version, baselines = bench_baselines(
                    args, trainer, engine, transport, dtype, num_bytes, version
                )
                measurements.extend(baselines)
    return DtypeResult(
        dtype=dtype,
        num_tensors=len(metadata),
        num_bytes=num_bytes,
        floor_s=floor_s,
        floor_pinned_s=floor_pinned_s,
        engine_startup_s=startup,
        measurements=measurements,
        num_cores=len(all_cores()),
        preset=preset,
    )


def bench_and_close(
    args: argparse.Namespace,
    method: str,
    trainer: Trainer,
    updater: Any,
    engine: Any,
    dtype: str,
    num_bytes: int,
) -> tuple[Measurement, int]:
    """`bench_updater` with the command's settings; the updater is closed after. Returns the
    measurement and the engine's weight version after it."""
    measurement = bench_updater(
        method,
        trainer,
        updater,
        engine,
        dtype=dtype,
        num_bytes=num_bytes,
        iterations=args.iterations,
        warmup=args.warmup,
        probe_tokens=args.probe_tokens,
    )
    version = updater.weight_version
    updater.close()
    return measurement, version


def bench_baselines(
    args: argparse.Namespace,
    trainer: Trainer,
    engine: Any,
    transport: str,
    dtype: str,
    num_bytes: int,
    version: int,
) -> tuple[int, list[Measurement]]:
    """naive (shm engines only), disk and control on `engine`; also the engine's version after."""
    measurements = []
    if "naive" in args.baselines and transport == "shm":
        updater = trainer.updater("shm", engine, 1, version)  # 1 byte cap: a bucket per tensor
        measurement, version = bench_and_close(
            args, "naive", trainer, updater, engine, dtype, num_bytes
        )
        measurements.append(measurement)
    elif "naive" in args.baselines:
        logger.warning(
            "naive baseline skipped: it runs over shm; the first transport is %s", transport
        )
    if "disk" in args.baselines:
        measurements.append(
            bench_disk(
                trainer,
                engine,
                dtype=dtype,
                num_bytes=num_bytes,
                ckpt_dir=Path(args.out) / f"disk-{dtype}",
                iterations=args.iterations,
            )
        )
    measurements.append(
        bench_control(
            trainer, engine, dtype=dtype, iterations=args.control_iterations, version=version
        )
    )
    return version + args.control_iterations + 1, measurements


# ---- entry point -------------------------------------------------------------------------------


def _init_distributed() -> None:
    """torchrun's environment, or a one-rank gloo world of our own."""
    default_to_single_process()
    dist.init_process_group("gloo", timeout=timedelta(minutes=15))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vime bench-sync", description=__doc__.splitlines()[0].strip("`: ")
    )
    parser.add_argument(
        "--preset",
        default="qwen2.5-0.5b",
        help="vime.testing.tiny_model preset (random weights), or a vime.pretrained model "
        "(real weights, e.g. smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        metavar="PRESET",
        help="run every method on each of these presets (>= 2) and fit seconds against bytes "
        "(e.g. qwen2-0.16b qwen2.5-0.5b qwen2.5-1.5b); replaces --preset",
    )
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    parser.add_argument(
        "--transports", nargs="+", default=["shm", "gloo"], choices=BENCH_TRANSPORTS
    )
    parser.add_argument(
        "--baselines", nargs="*", default=["disk", "naive"], choices=["disk", "naive"]
    )
    parser.add_argument("--iterations", type=int, default=5, help="timed syncs per method")
    parser.add_argument(
        "--control-iterations",
        type=int,
        default=20,
        help="timed sessions that move no bytes (the control plane's median and spread)",
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed syncs first (the heap reaches steady size)"
    )
    parser.add_argument(
        "--probe-tokens",
        type=int,
        default=400,
        help="a greedy request of this many tokens streams through each timed sync: its gap at "
        "the version switch is the stall a client sees (0: no probe; keep it under the "
        "engine's max_model_len, 512 for the engines this command starts)",
    )
    parser.add_argument(
        "--shadow",
        choices=sorted(SHADOW_MODES),
        default="off",
        help="weight_sync.shadow per transport: off, on (rows TRANSPORT+shadow), or both",
    )
    parser.add_argument(
        "--pack",
        choices=sorted(PACK_MODES),
        default="before",
        help="shm without shadow: weight_sync.pack_before_pause on (before), off (in: rows "
        "shm+pack-in-pause, the trainer packs inside the engines' pause), or both",
    )
    parser.add_argument("--bucket-mib", type=int, default=512, help="bucket cap in MiB")
    parser.add_argument("--tp", type=int, default=1, help="trainer tensor-parallel size")
    parser.add_argument(
        "--engine-tp", type=int, default=1, help="the engine's tensor-parallel size (its workers)"
    )
    parser.add_argument(
        "--engine-env", nargs="*", default=[], help="KEY=VALUE environment for the vLLM servers"
    )
    parser.add_argument(
        "--engine-malloc",
        choices=["reuse", "default"],
        default="reuse",
        help="engine.cpu_reuse_freed_memory on (reuse) or off (glibc's default)",
    )
    parser.add_argument(
        "--engine-load-cores",
        choices=["all", "own"],
        default="all",
        help="engine.cpu_sync_load_cores: load on every core during a sync, or the worker's own",
    )
    parser.add_argument(
        "--engine-url",
        nargs="*",
        default=[],
        metavar="TRANSPORT=URL",
        help="attach to a running engine for that transport instead of launching one (its "
        "token, if any, in $VIME_ENGINE_TOKEN); it must serve the bench model's architecture",
    )
    parser.add_argument("--out", default="runs/bench-sync", help="JSON, engine logs, disk files")
    parser.add_argument(
        "--delta",
        action="store_true",
        help="full vs delta sync after real bf16 AdamW steps (vime.bench.delta); "
        "uses the first of --transports",
    )
    parser.add_argument(
        "--peer-copy",
        action="store_true",
        help="a fleet joiner's first weights from the trainer (a full sync) vs copied from a live "
        "engine and a delta (vime.bench.peer_copy); two engines, the first of --transports "
        "and --delta-lrs",
    )
    parser.add_argument("--delta-lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--delta-steps", type=int, default=5, help="optimizer steps per lr")
    parser.add_argument("--model-root", default="models", help="where checkpoints are built")
    args = parser.parse_args(argv)
    args.engine_urls = {}
    for item in args.engine_url:
        transport, sep, url = item.partition("=")
        if not sep or transport not in BENCH_TRANSPORTS or not url.startswith("http"):
            parser.error(
                f"--engine-url {item!r}: write TRANSPORT=URL, e.g. shm=http://127.0.0.1:8000"
            )
        args.engine_urls[transport] = url
    if args.iterations < 1 or args.warmup < 0 or args.control_iterations < 1:
        parser.error(
            "need --iterations >= 1, --control-iterations >= 1 and --warmup >= 0, got "
            f"{args.iterations}, {args.control_iterations}, {args.warmup}"
        )
    if args.engine_tp < 1:
        parser.error(f"--engine-tp must be >= 1, got {args.engine_tp}")
    if args.sizes is not None and len(set(args.sizes)) < 2:
        parser.error(f"--sizes needs at least two different presets, got {args.sizes}")
    if args.bucket_mib < 1:
        parser.error(f"--bucket-mib must be >= 1, got {args.bucket_mib}")
    return args


def main(argv: list[str] | None = None) -> list[DtypeResult]:
    from vime.megatron.model import initialize_model_parallel

    all_cores()  # read before anything pins this process
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s"
    )
    _init_distributed()
    try:
        world_size = dist.get_world_size()
        if world_size != args.tp:
            raise SystemExit(
                f"--tp {args.tp} needs {args.tp} trainer ranks, have {world_size}: run "
                f"`torchrun --nproc-per-node {args.tp} -m vime.bench.sync --tp {args.tp}`"
            )
        topology = initialize_model_parallel(tp=args.tp, pp=1, timeout=timedelta(minutes=15))
        sync_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=15))
        if args.peer_copy:
            from vime.bench.peer_copy import bench_peer_copy

            bench_peer_copy(args, topology, sync_group)
            return []
        if args.delta:
            from vime.bench.delta import bench_delta

            bench_delta(args, topology, sync_group)
            return []
        presets = args.sizes or [args.preset]
        results = [
            bench_dtype(args, preset, dtype, topology, sync_group)
            for preset in presets
            for dtype in args.dtypes
        ]
        if dist.get_rank() == 0:
            report(args, argv, results)
        return results
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
