"""The methods `vime bench-sync` times on the same bytes: the memcpy floor, vime's session (shm,
gloo), the control plane alone, and the disk baseline.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vime.bench.stall import StreamProbe
from vime.bench.sync_results import FLOOR_REPEATS, SYNC_PHASES, Measurement
from vime.bench.sync_setup import Trainer
from vime.utils.timing import PhaseTimer

logger = logging.getLogger("vime.bench")

# ---- the floor ---------------------------------------------------------------------------------


def memcpy_floor(num_bytes: int, repeats: int = FLOOR_REPEATS) -> float:
    """Seconds of the fastest of `repeats` copies of `num_bytes` into memory already touched."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return best


# ---- the methods -------------------------------------------------------------------------------


def sync_phases(report: Any, engine_stats: dict[str, float]) -> dict[str, float]:
    """A SyncReport as the table's columns, plus the engine's own receive and load times."""
    send = report.send_seconds
    row = {
        # weight_sync.pack_before_pause: gather, convert and pack ran here, before the pause.
        "prepare": report.seconds.get("prepare", 0.0),
        "pause": report.seconds.get("pause", 0.0),
        "flush": report.seconds.get("flush", 0.0),
        "start": report.seconds.get("start", 0.0),
        "gather": send.get("gather", 0.0),
        "convert": send.get("convert", 0.0),
        "pack": send.get("pack", 0.0),
        "wait": send.get("transfer", 0.0),
        "stage": report.seconds.get("stage", 0.0),
        "finish": report.seconds.get("finish", 0.0),
        "resume": report.seconds.get("resume", 0.0),
    }
    counted = sum(row.values())
    if row["prepare"]:  # the trainer's own phases are inside it: count them once
        counted -= row["gather"] + row["convert"] + row["pack"]
    row["other"] = max(0.0, report.total_s - counted)
    row["total"] = report.total_s
    row["engine_receive"] = float(engine_stats.get("receive", 0.0))
    # weight_sync.shadow: the load runs on the shadow's thread (its own clock), beside decoding.
    load = engine_stats.get("load", 0.0) or engine_stats.get("shadow_load", 0.0)
    row["engine_load"] = float(load)
    # The worker's own start and finish (vLLM's layerwise set-up, its finalize and kernel
    # rebuilds such as a tied head's): with the load, the engine's work inside the pause.
    row["engine_start"] = float(engine_stats.get("start", 0.0))
    row["engine_finish"] = float(engine_stats.get("finish", 0.0))
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
    probe_tokens: int = 0,
) -> Measurement:
    """`warmup` + `iterations` syncs; only the last `iterations` are in the table.

    The first syncs are slower: segments and receive buffers are created, and the engine's heap
    grows to its steady size (engine.cpu_reuse_freed_memory); an RL run does thousands of syncs.
    With `probe_tokens`, a greedy request of that many tokens streams through each timed sync
    (rank 0): its gap at the version switch is the row's "stall" (`vime.bench.stall`).
    """
    measurement = Measurement(method, dtype, num_bytes)
    is_rank0 = dist.get_rank(trainer.sync_group) == 0
    for index in range(warmup + iterations):
        trainer.flip_weights()
        probe = None
        if probe_tokens and is_rank0 and index >= warmup:
            version = str(updater.weight_version + 1)
            probe = StreamProbe(engine.url, engine.auth_token, probe_tokens, version)
            probe.wait_streaming()
            probe.mark_sync()
        report = updater.update_weights()
        stall = probe.stall_s() if probe is not None else math.nan
        longest_gap = probe.longest_gap_s() if probe is not None else math.nan
        step_gap = probe.step_gap_s() if probe is not None else math.nan
        stats = engine.collective_rpc("vime_weight_update_stats")[0] if is_rank0 else {}
        if is_rank0:
            measurement.engine_rss_gib.append(engine_rss_gib(engine))
        if index >= warmup:
            row = sync_phases(report, stats)
            if is_rank0:  # paused: pause request to resume answered (shadow: the swap)
                row["paused"], row["stall"] = report.paused_s, stall
                row["longest_gap"], row["step_gap"] = longest_gap, step_gap
            measurement.iterations.append(row)
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
    if is_rank0:  # counted by the engine: update_weights requests it served per sync
        counts = {int(stats.get("requests", 0)) for stats in measurement.engine_stats}
        if len(counts) != 1:
            raise RuntimeError(f"{method}: the engine counted {sorted(counts)} requests per sync")
        measurement.num_requests = counts.pop()
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
            pp_size=1,
            stage_part=lambda stage: None,
            call_timeout_s=120,
            barrier_timeout_s=120,
        )
        if index:
            row = {phase: report.seconds.get(phase, 0.0) for phase in SYNC_PHASES}
            if dist.get_rank(trainer.sync_group) == 0:
                # The worker's own part of start and finish (vLLM's layerwise reload set-up and
                # tear-down); the rest of those round trips is HTTP, API server and engine core.
                stats = engine.collective_rpc("vime_weight_update_stats")[0]
                row["engine_start"] = float(stats.get("start", 0.0))
                row["engine_finish"] = float(stats.get("finish", 0.0))
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
            engine.collective_rpc("vime_rebuild_tied_kernels")  # as vime's own syncs do
        with timer.phase("resume"):
            engine.continue_generation()
    del gathered
    dist.barrier(group=trainer.sync_group)
