"""A bucket's load on several CPU cores: vLLM's own layerwise load, whole decoder layers per thread.

On the CPU build a worker's OpenMP threads are pinned to its own cores, so vLLM's load (copy each
weight into its layer, repack every linear weight into oneDNN's layout) runs on those alone. During
a sync the engine is paused and a colocated trainer waits for it: their cores are idle. The server
gets the cores a worker may load on in `VIME_SYNC_LOAD_CORES` (from `engine.cpu_sync_load_cores`);
each extra core gets one thread, pinned to it, and a bucket's weights are split between the worker's
own thread and those by whole numbered blocks (`.layers.N.`, `.blocks.N.`, `.h.N.`, `.layer.N.`);
all other names (embeddings, final norm, head) load first, on the worker's thread alone. A vLLM
module's weights (q, k and v of one qkv_proj; gate and up) never meet two
threads, so vLLM's per-layer bookkeeping (which processes a layer when its last weight arrives)
sees each layer from one thread, as it does now. Threads run the same `model.load_weights` on
disjoint layers; what they write is the same as one thread's load, bit for bit (the tests
compare the served tensors' digests).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vime.weight_sync.names import LOAD_CORES_ENV

# Under vLLM's logger: in a worker, vLLM configures handlers for "vllm" only.
logger = logging.getLogger(f"vllm.{__name__}")

# A numbered block of the model: everything vLLM stacks into one module lies inside one.
_BLOCK = re.compile(r"\.(?:layers|blocks|h|layer)\.\d+\.")

Weights = list[tuple[str, torch.Tensor]]


def parse_cores(text: str | None) -> list[int]:
    """ "0,1,3" -> [0, 1, 3]; empty or unset -> []."""
    if not text:
        return []
    try:
        return sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(
            f"{LOAD_CORES_ENV}={text!r} is not a comma-separated list of CPU ids"
        ) from None


def split_by_layer(weights: Weights, parts: int) -> tuple[Weights, list[Weights]]:
    """(names outside the numbered blocks, the blocks' weights in at most `parts` groups).

    The first part is loaded alone, before the groups: its modules (embeddings, tied with the
    head in some models, final norm) are walked by every thread's `load_weights` when it starts,
    so they are not re-registered by one thread while another walks them. Blocks go whole to the
    group with the fewest bytes so far, largest first; each group keeps the bucket's order;
    empty groups are dropped.
    """
    outside: list[int] = []
    blocks: dict[str, list[int]] = {}  # block prefix -> positions in `weights`
    for position, (name, _) in enumerate(weights):
        match = _BLOCK.search(name)
        if match:
            blocks.setdefault(name[: match.end()], []).append(position)
        else:
            outside.append(position)
    sizes = {key: sum(weights[i][1].nbytes for i in positions) for key, positions in blocks.items()}
    loads = [0] * max(1, parts)
    groups: list[list[int]] = [[] for _ in loads]
    for key in sorted(blocks, key=lambda k: -sizes[k]):
        target = loads.index(min(loads))
        groups[target].extend(blocks[key])
        loads[target] += sizes[key]
    return [weights[i] for i in outside], [
        [weights[i] for i in sorted(group)] for group in groups if group
    ]


class CoreThreads:
    """One thread pinned to each of `cores` that this thread does not run on; kept for the
    worker's life. `run(fn, groups)` runs fn(groups[0]) here and the rest on those threads."""

    def __init__(self, cores: Sequence[int]):
        own = os.sched_getaffinity(0)
        self.extra = [core for core in cores if core not in own]
        self._free = list(self.extra)
        self._lock = threading.Lock()
        self._executor = (
            ThreadPoolExecutor(
                max_workers=len(self.extra),
                thread_name_prefix="vime-load",
                initializer=self._pin,
            )
            if self.extra
            else None
        )

    @property
    def num_threads(self) -> int:
        return 1 + len(self.extra)

    def _pin(self) -> None:
        with self._lock:
            core = self._free.pop()
        try:
            os.sched_setaffinity(0, {core})  # this thread only (Linux: pid 0 is the caller)
        except OSError as exc:  # e.g. a core outside this engine's cpuset: run unpinned
            logger.warning("weight load thread not pinned to core %d: %s", core, exc)

    def run(self, fn: Callable[[Weights], Any], groups: list[Weights]) -> None:
        if self._executor is None or len(groups) <= 1:
            for group in groups:
                fn(group)
            return
        # Grad and inference mode are per thread: the helpers load as this thread would.
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def in_mode(group: Weights) -> Any:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return fn(group)

        futures = [self._executor.submit(in_mode, group) for group in groups[1:]]
        error: BaseException | None = None
        try:
            fn(groups[0])
        except BaseException as exc:
            error = exc
        for future in futures:  # always wait: a helper may still be writing into the model
            try:
                future.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def core_threads_from_env() -> CoreThreads | None:
    """The worker's load threads from VIME_SYNC_LOAD_CORES; None (vLLM's one-thread load, with a
    log line saying why) when it names no core beyond the worker's own."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # GPU loads are kernels; threads would only add risk
        return None
    cores = parse_cores(os.environ.get(LOAD_CORES_ENV))
    if not cores:
        logger.info("weight load on the worker's own cores: %s is not set", LOAD_CORES_ENV)
        return None
    threads = CoreThreads(cores)
    if not threads.extra:
        logger.info(
            "weight load on the worker's own cores: %s=%s adds none to %s",
            LOAD_CORES_ENV,
            ",".join(map(str, cores)),
            sorted(os.sched_getaffinity(0)),
        )
        threads.shutdown()
        return None
    logger.info("weight load on %d threads (extra cores %s)", threads.num_threads, threads.extra)
    return threads
