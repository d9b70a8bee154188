"""Which CPU cores a vLLM CPU engine's workers run and load weights on (the CPU build only)."""

from __future__ import annotations

import os

from vime.utils.cores import spare_core


def cpu_core_binding(rank: int, num_engines: int, tensor_parallel_size: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND giving each worker of `num_engines` local CPU engines its cores.

    One core list per worker, `|`-separated: the engine's share of this process's cores split
    evenly between its `tensor_parallel_size` workers (a single engine leaves the last core free
    when it has more cores than workers). vLLM's "auto" binds every engine to the
    same cores (all but one), so several engines on one host spin on one core in turn, and
    refuses a TP > 1 engine on a one-NUMA-node machine. With fewer cores than workers, each
    worker gets one core, round robin (workers then share cores). None (keep "auto") for one
    single-worker engine, or single-worker engines outnumbering the cores.
    """
    if num_engines <= 1 and tensor_parallel_size <= 1:
        return None
    cores = sorted(os.sched_getaffinity(0))
    if spare_core(cores, num_engines, tensor_parallel_size) is not None:
        # The last core stays free for the API server and a trainer on the same host
        # (trainer.cpu_cores "auto" pins it there).
        cores = cores[:-1]
    cores_per_engine = len(cores) // num_engines
    if cores_per_engine < tensor_parallel_size:
        if tensor_parallel_size == 1:
            return None
        first = (rank % num_engines) * tensor_parallel_size
        return "|".join(
            str(cores[(first + worker) % len(cores)]) for worker in range(tensor_parallel_size)
        )
    mine = cores[(rank % num_engines) * cores_per_engine :][:cores_per_engine]
    per_worker = cores_per_engine // tensor_parallel_size
    return "|".join(
        ",".join(str(core) for core in mine[worker * per_worker : (worker + 1) * per_worker])
        for worker in range(tensor_parallel_size)
    )


def sync_load_cores(setting: str | list[int]) -> list[int]:
    """engine.cpu_sync_load_cores as CPU ids: 'all' the cores this (launching) process may use,
    'own' none beyond the worker's (empty), a list as given (each must be one of this process's)."""
    allowed = sorted(os.sched_getaffinity(0))
    if setting == "own":
        return []
    if isinstance(setting, str):  # "all"
        return allowed
    unknown = sorted(set(setting) - set(allowed))
    if unknown:
        raise ValueError(
            f"engine.cpu_sync_load_cores {setting} names cores {unknown} this process may not "
            f"use (it may use {allowed}): list some of those, or write 'all' or 'own'"
        )
    return sorted(set(setting))
