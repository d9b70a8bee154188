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

Prints a table (seconds per phase of the median sync) and writes every figure, iteration by
iteration, to `--out`/bench_sync.json. Each iteration flips the sign of every weight first, so
every sync moves new bytes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vime.utils.dist_env import default_to_single_process
from vime.utils.timing import PhaseTimer

logger = logging.getLogger("vime.bench")

_ALL_CORES = frozenset(os.sched_getaffinity(0))

BENCH_TRANSPORTS = ("gloo", "shm")  # the CPU ones
# The columns of a sync, in order; with "other" (barriers, bookkeeping) they add up to the total
# from pause to resume. "wait" is the trainer waiting for the bytes to move and the engines to load
# them, beyond the packing it overlaps with.
SYNC_PHASES = (
    "pause",
    "flush",
    "start",
    "gather",
    "convert",
    "pack",
    "wait",
    "finish",
    "resume",
)
# Measured inside the engine (vime_weight_update_stats); they overlap the trainer's columns.
ENGINE_PHASES = ("engine_receive", "engine_load")


@dataclass
class Measurement:
    """One method's timed iterations for one dtype: phase -> seconds, "total" = pause -> resume."""

    method: str
    dtype: str
    num_bytes: int
    iterations: list[dict[str, float]] = field(default_factory=list)
    engine_stats: list[dict[str, float]] = field(default_factory=list)
    num_requests: int = 0  # update_weights requests per sync
    engine_rss_gib: list[float] = field(default_factory=list)  # after each sync, warm-up included
    warmup_totals: list[float] = field(default_factory=list)  # seconds of the untimed syncs

    def mean(self) -> dict[str, float]:
        keys = {key for iteration in self.iterations for key in iteration}
        count = max(len(self.iterations), 1)
        return {k: sum(it.get(k, 0.0) for it in self.iterations) / count for k in sorted(keys)}

    def typical(self) -> dict[str, float]:
        """The phases of the iteration with the median total: one real sync, robust to a hiccup
        of the machine (the table shows it; the JSON keeps every iteration and the means)."""
        if not self.iterations:
            return {}
        ranked = sorted(self.iterations, key=lambda it: it.get("total", 0.0))
        return dict(ranked[(len(ranked) - 1) // 2])


@dataclass
class DtypeResult:
    dtype: str
    num_tensors: int
    num_bytes: int
    floor_s: float  # one memcpy with every core of the machine: the ratios' denominator
    floor_pinned_s: float  # the same on the trainer's pinned core(s)
    engine_startup_s: dict[str, float]
    measurements: list[Measurement]


# ---- the floor ---------------------------------------------------------------------------------


def memcpy_floor(num_bytes: int, repeats: int = 3) -> float:
    """Seconds of the fastest of `repeats` copies of `num_bytes` into memory already touched."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return best


# ---- engines -------------------------------------------------------------------------------------


def split_cores() -> tuple[list[int], list[int]]:
    """(engine cores, trainer cores): the trainer gets the last core, as in the RL job.

    vLLM's OpenMP threads spin after each kernel; a trainer whose threads share their core runs
    several times slower (see TrainerConfig.cpu_cores). All engines share the other cores: only
    one of them works at a time here.
    """
    cores = sorted(_ALL_CORES)
    if len(cores) < 2:
        return cores, cores
    return cores[:-1], cores[-1:]


def engine_cpu_binding() -> dict[str, str]:
    if torch.cuda.is_available():
        return {}
    engine_cores, _ = split_cores()
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, engine_cores))}


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-env takes KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def pin_trainer() -> list[int]:
    """Pin this process (and torch's threads) to the trainer's cores; returns them."""
    _, trainer_cores = split_cores()
    os.sched_setaffinity(0, trainer_cores)
    torch.set_num_threads(len(trainer_cores))
    return trainer_cores


def unpin() -> None:
    """Every core again (engines launched from here inherit this process's affinity)."""
    os.sched_setaffinity(0, _ALL_CORES)
    torch.set_num_threads(len(_ALL_CORES))


@contextmanager
def running_engine(
    args: argparse.Namespace, model_dir: Path, dtype: str, transport: str
) -> Iterator[Any]:
    """One vLLM engine serving `transport`'s backend, launched by rank 0 and ended on exit.

    Engines run one at a time: two 0.5B fp32 engines next to the trainer do not fit in 24 GiB.
    They start unpinned (they inherit this process's affinity) on the cores the trainer leaves.
    """
    from vime.config import EngineConfig
    from vime.rollout.vllm_engine import VLLMEngine

    rank = dist.get_rank()
    config = EngineConfig(
        model_path=str(model_dir),
        dtype=dtype,
        max_model_len=512,
        max_num_seqs=8,
        weight_transfer_backend=transport,
        request_timeout_s=900,
        startup_timeout_s=900,
        extra_env={**engine_cpu_binding(), **parse_env(args.engine_env)},
        cpu_reuse_freed_memory=args.engine_malloc == "reuse",
    )
    engine = None
    url: list[str | None] = [None]
    unpin()
    try:
        if rank == 0:
            log_dir = Path(args.out) / "engines" / f"{dtype}-{transport}"
            engine = VLLMEngine(config, log_dir=str(log_dir))
            try:
                url[0] = engine.init()
            finally:
                dist.broadcast_object_list(url, src=0)  # None tells the others it failed
        else:
            dist.broadcast_object_list(url, src=0)
            if url[0] is None:
                raise RuntimeError(f"rank 0 could not start the {transport} engine")
            engine = VLLMEngine(config, url=url[0])
            engine.init()
        yield engine
    finally:
        if rank == 0 and engine is not None:
            engine.shutdown()


# ---- the trainer side ------------------------------------------------------------------------


@dataclass
class Trainer:
    model: torch.nn.Module
    converter: Any
    topology: Any
    groups: Any
    sync_group: Any

    def flip_weights(self) -> None:
        """New bytes for the next sync: every weight changes sign (exactly)."""
        with torch.no_grad():
            for param in self.model.parameters():
                param.neg_()

    def updater(self, transport: str, engine: Any, bucket_bytes: int, version: int) -> Any:
        from vime.config import WeightSyncConfig
        from vime.weight_sync.updater import WeightUpdater

        config = WeightSyncConfig(
            transport=transport,
            update_weight_buffer_size=bucket_bytes,
            transfer_timeout_s=900,
            barrier_timeout_s=900,
        )
        updater = WeightUpdater(
            config=config,
            engines=[engine],
            model=self.model,
            converter=self.converter,
            topology=self.topology,
            gather_groups=self.groups,
            sync_group=self.sync_group,
            weight_version=version,
        )
        updater.connect()
        return updater


def build_trainer(model_dir: Path, dtype: str, topology: Any, sync_group: Any) -> Trainer:
    from vime.megatron.converters import get_converter
    from vime.megatron.gather import GatherGroups
    from vime.megatron.model import (
        build_gpt_model,
        load_hf_checkpoint,
        load_hf_config,
        pad_vocab_size,
    )

    hf_config = load_hf_config(model_dir)
    padded = pad_vocab_size(hf_config.vocab_size, topology.tp_size)
    converter = get_converter(hf_config, padded_vocab_size=padded)
    model = build_gpt_model(converter, topology, params_dtype=getattr(torch, dtype))
    load_hf_checkpoint(model, model_dir, converter=converter, topology=topology)
    return Trainer(model, converter, topology, GatherGroups.from_parallel_state(), sync_group)


# ---- the methods -------------------------------------------------------------------------------


def sync_phases(report: Any, engine_stats: dict[str, float]) -> dict[str, float]:
    """A SyncReport as the table's columns, plus the engine's own receive and load times."""
    send = report.send_seconds
    row = {
        "pause": report.seconds.get("pause", 0.0),
        "flush": report.seconds.get("flush", 0.0),
        "start": report.seconds.get("start", 0.0),
        "gather": send.get("gather", 0.0),
        "convert": send.get("convert", 0.0),
        "pack": send.get("pack", 0.0),
        "wait": send.get("transfer", 0.0),
        "finish": report.seconds.get("finish", 0.0),
        "resume": report.seconds.get("resume", 0.0),
    }
    row["other"] = max(0.0, report.total_s - sum(row.values()))
    row["total"] = report.total_s
    row["engine_receive"] = float(engine_stats.get("receive", 0.0))
    row["engine_load"] = float(engine_stats.get("load", 0.0))
    return row


def engine_rss_gib(engine: Any) -> float:
    """Resident memory of a launched server's whole process tree (GiB); 0 for an external one."""
    import psutil

    pid = engine.server_pid()
    if pid is None:
        return 0.0
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 1024**3


def bench_updater(
    method: str,
    trainer: Trainer,
    updater: Any,
    engine: Any,
    *,
    dtype: str,
    num_bytes: int,
    iterations: int,
    warmup: int,
) -> Measurement:
    """`warmup` + `iterations` syncs; only the last `iterations` are in the table.

    The first syncs are slower: segments and receive buffers are created, and the engine's heap
    grows to its steady size (engine.cpu_reuse_freed_memory); an RL run does thousands of syncs.
    """
    measurement = Measurement(method, dtype, num_bytes, num_requests=len(updater.buckets))
    is_rank0 = dist.get_rank(trainer.sync_group) == 0
    for index in range(warmup + iterations):
        trainer.flip_weights()
        report = updater.update_weights()
        stats = engine.collective_rpc("vime_weight_update_stats")[0] if is_rank0 else {}
        if is_rank0:
            measurement.engine_rss_gib.append(engine_rss_gib(engine))
        if index >= warmup:
            measurement.iterations.append(sync_phases(report, stats))
            measurement.engine_stats.append(stats)
        else:
            measurement.warmup_totals.append(report.total_s)
        if is_rank0:
            logger.info(
                "%s %s sync %d: %.3f s, engine RSS %.2f GiB",
                method,
                dtype,
                index,
                report.total_s,
                measurement.engine_rss_gib[-1],
            )
    if method == "gloo":  # the whole stage goes in one request, bucket after bucket
        measurement.num_requests = 1
    return measurement


def bench_control(
    trainer: Trainer, engine: Any, *, dtype: str, iterations: int, version: int
) -> Measurement:
    """Sessions that move nothing: pause, flush, start, finish, resume and their barriers."""
    from vime.weight_sync.session import run_sync_session

    measurement = Measurement("control", dtype, 0)
    for index in range(1 + iterations):
        report = run_sync_session(
            engines=[engine],
            group=trainer.sync_group,
            weight_version=version + index,
            pp_rank=0,
            pp_size=1,
            send_stage=lambda: None,
            call_timeout_s=120,
            barrier_timeout_s=120,
        )
        if index:
            row = {phase: report.seconds.get(phase, 0.0) for phase in SYNC_PHASES}
            measurement.iterations.append({**row, "total": report.total_s})
    return measurement


def bench_disk(
    trainer: Trainer, engine: Any, *, dtype: str, num_bytes: int, ckpt_dir: Path, iterations: int
) -> Measurement:
    """Pause, save the gathered HF tensors as safetensors, reload_weights from there, resume.

    The file is written without fsync, so vLLM reads it back from the page cache, and the first
    (cold) save is not timed: the most favourable case for the disk path.
    """
    measurement = Measurement("disk", dtype, num_bytes, num_requests=1)
    for index in range(1 + iterations):  # the first writes a new file: not timed
        trainer.flip_weights()
        began = time.perf_counter()
        timer = PhaseTimer()
        _disk_sync(trainer, engine, ckpt_dir, timer)
        row = {**timer.seconds, "total": time.perf_counter() - began}
        if index:
            measurement.iterations.append(row)
        else:
            measurement.warmup_totals.append(row["total"])
        if dist.get_rank(trainer.sync_group) == 0:
            logger.info("disk %s: %.3f s", dtype, row["total"])
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return measurement


def _disk_sync(trainer: Trainer, engine: Any, ckpt_dir: Path, timer: PhaseTimer) -> None:
    from safetensors.torch import save_file

    from vime.megatron.gather import gather_hf_weights

    is_rank0 = dist.get_rank(trainer.sync_group) == 0
    if is_rank0:
        with timer.phase("pause"):
            engine.pause_generation(mode="keep", clear_cache=False)
        with timer.phase("flush"):
            engine.flush_cache(timeout_s=1.0, raise_on_timeout=False)
    dist.barrier(group=trainer.sync_group)
    with timer.phase("gather"):
        gathered = list(
            gather_hf_weights(
                trainer.model,
                converter=trainer.converter,
                topology=trainer.topology,
                groups=trainer.groups,
            )
        )
    if is_rank0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        ckpt_dir.mkdir(parents=True)
        with timer.phase("save"):
            # safetensors refuses tensors that share storage (gate/up are views of one matrix).
            tensors = {name: tensor.clone() for name, tensor in gathered}
            save_file(tensors, str(ckpt_dir / "model.safetensors"))
        del tensors
        with timer.phase("reload"):
            kwargs = {"weights_path": str(ckpt_dir), "is_checkpoint_format": True}
            engine.collective_rpc("reload_weights", kwargs=kwargs)
        with timer.phase("resume"):
            engine.continue_generation()
    del gathered
    dist.barrier(group=trainer.sync_group)


# ---- one dtype ---------------------------------------------------------------------------------


def bench_dtype(args: argparse.Namespace, dtype: str, topology: Any, sync_group: Any) -> Any:
    from vime.megatron.gather import hf_weight_metadata
    from vime.megatron.model import unwrap

    rank = dist.get_rank()
    model_dir = Path(args.model_root) / f"bench-{args.preset}-{dtype}"
    if rank == 0:
        from vime.testing.tiny_model import build_tiny_model

        build_tiny_model(model_dir, args.preset, dtype)
    dist.barrier()
    unpin()
    trainer = build_trainer(model_dir, dtype, topology, sync_group)
    metadata = hf_weight_metadata(trainer.converter, unwrap(trainer.model).config)
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
            updater = trainer.updater(transport, engine, bucket_bytes, version)
            measurements.append(
                bench_updater(
                    transport,
                    trainer,
                    updater,
                    engine,
                    dtype=dtype,
                    num_bytes=num_bytes,
                    iterations=args.iterations,
                    warmup=args.warmup,
                )
            )
            version = updater.weight_version
            updater.close()
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
    )


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
        measurements.append(
            bench_updater(
                "naive",
                trainer,
                updater,
                engine,
                dtype=dtype,
                num_bytes=num_bytes,
                iterations=1,
                warmup=args.warmup,
            )
        )
        version = updater.weight_version
        updater.close()
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
                iterations=max(1, min(args.iterations, 2)),
            )
        )
    measurements.append(
        bench_control(trainer, engine, dtype=dtype, iterations=args.iterations, version=version)
    )
    return version + args.iterations + 1, measurements


# ---- the report --------------------------------------------------------------------------------


def format_table(results: list[DtypeResult]) -> str:
    """The screen table: seconds per phase of the median sync, pause -> resume, GB/s, x floor."""
    columns = [*SYNC_PHASES, "other", "save", "reload", *ENGINE_PHASES]
    names = {"engine_receive": "eng.recv", "engine_load": "eng.load"}
    header = ["dtype", "method", "req", *(names.get(c, c) for c in columns)]
    header += ["total", "GB/s", "x floor"]
    rows = []
    for result in results:
        floors = [
            (f"memcpy {len(_ALL_CORES)} cores", result.floor_s),
            ("memcpy 1 core", result.floor_pinned_s),
        ]
        for name, seconds in floors:
            rows.append(
                [result.dtype, name, "", *[""] * len(columns)]
                + [f"{seconds:.3f}", f"{result.num_bytes / seconds / 1e9:.1f}"]
                + [f"{seconds / result.floor_s:.1f}"]
            )
        for m in result.measurements:
            typical = m.typical()
            total = typical.get("total", 0.0)
            cells = [f"{typical[c]:.3f}" if c in typical else "" for c in columns]
            gbps = f"{m.num_bytes / total / 1e9:.2f}" if m.num_bytes and total else ""
            ratio = f"{total / result.floor_s:.1f}" if m.num_bytes and result.floor_s else ""
            rows.append(
                [result.dtype, m.method, str(m.num_requests or ""), *cells]
                + [f"{total:.3f}", gbps, ratio]
            )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(str(cell).rjust(w) for cell, w in zip(cells, widths, strict=True))

    head = line(header)
    return "\n".join([head, "-" * len(head), *map(line, rows)])


def summarize(results: list[DtypeResult]) -> list[str]:
    """The issue's ratios, each one line."""
    lines = []
    for result in results:
        means = {m.method: m.typical() for m in result.measurements}
        by_method = {method: mean.get("total", 0.0) for method, mean in means.items()}
        for method in ("shm", "gloo"):
            if method not in by_method:
                continue
            total = by_method[method]
            line = (
                f"{result.dtype} {method}: {total:.3f} s = {total / result.floor_s:.1f}x the "
                f"memcpy floor"
            )
            load = means[method].get("engine_load", 0.0)
            if load:
                rest = total - load
                line += (
                    f" ({rest:.3f} s = {rest / result.floor_s:.1f}x without the engine's own "
                    f"load_weights, {load:.3f} s)"
                )
            for baseline in ("disk", "naive"):
                if baseline in by_method:
                    line += f"; {baseline} takes {by_method[baseline] / total:.1f}x as long"
            lines.append(line)
        if "control" in by_method:
            lines.append(
                f"{result.dtype} control plane (no bytes): {by_method['control'] * 1e3:.1f} ms"
            )
    return lines


# ---- entry point -------------------------------------------------------------------------------


def _init_distributed() -> None:
    """torchrun's environment, or a one-rank gloo world of our own."""
    default_to_single_process()
    dist.init_process_group("gloo", timeout=timedelta(minutes=15))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vime bench-sync", description=__doc__.splitlines()[0].strip("`: ")
    )
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="vime.testing.tiny_model preset")
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
        "--warmup", type=int, default=3, help="untimed syncs first (the heap reaches steady size)"
    )
    parser.add_argument("--bucket-mib", type=int, default=512, help="bucket cap in MiB")
    parser.add_argument("--tp", type=int, default=1, help="trainer tensor-parallel size")
    parser.add_argument(
        "--engine-env", nargs="*", default=[], help="KEY=VALUE environment for the vLLM servers"
    )
    parser.add_argument(
        "--engine-malloc",
        choices=["reuse", "default"],
        default="reuse",
        help="engine.cpu_reuse_freed_memory on (reuse) or off (glibc's default)",
    )
    parser.add_argument("--out", default="runs/bench-sync", help="JSON, engine logs, disk files")
    parser.add_argument("--model-root", default="models", help="where checkpoints are built")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup < 0:
        parser.error(
            f"need --iterations >= 1 and --warmup >= 0, got {args.iterations}, {args.warmup}"
        )
    if args.bucket_mib < 1:
        parser.error(f"--bucket-mib must be >= 1, got {args.bucket_mib}")
    return args


def main(argv: list[str] | None = None) -> list[DtypeResult]:
    from vime.megatron.model import initialize_model_parallel

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
        results = [bench_dtype(args, dtype, topology, sync_group) for dtype in args.dtypes]
        if dist.get_rank() == 0:
            report(args, argv, results)
        return results
    finally:
        dist.destroy_process_group()


def report(args: argparse.Namespace, argv: list[str], results: list[DtypeResult]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = {
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
    }
    document = {
        "command": "vime bench-sync " + " ".join(argv),
        "machine": machine,
        "preset": args.preset,
        "bucket_mib": args.bucket_mib,
        "tp": args.tp,
        "results": [
            {
                **asdict(r),
                "means": {m.method: m.mean() for m in r.measurements},
                "medians": {m.method: m.typical() for m in r.measurements},
            }
            for r in results
        ],
        "summary": summarize(results),
    }
    path = out / "bench_sync.json"
    path.write_text(json.dumps(document, indent=2))
    model_gb = ", ".join(f"{r.dtype} {r.num_bytes / 1e9:.2f} GB" for r in results)
    print(
        f"\nvime bench-sync: {args.preset} ({model_gb}), seconds, the median of "
        f"{args.iterations} syncs after {args.warmup} warm-up ones"
    )
    print(format_table(results))
    print("\n".join(["", *document["summary"], f"figures: {path}"]))


if __name__ == "__main__":
    main()
