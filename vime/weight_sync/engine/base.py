"""What vime's engine backends share: the worker's rank, bucket parsing, and `BucketEngine`,
vLLM's layerwise reload around an update with every bucket loaded from views of its bytes (or,
with `weight_sync.shadow`, a load beside the served weights swapped in at the finish:
`engine.shadow`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vime.weight_sync.buckets import Bucket
from vime.weight_sync.delta import Baseline
from vime.weight_sync.engine.moe import expert_prefixes, refresh_cpu_moe_prepack
from vime.weight_sync.engine.parallel_load import CoreThreads, core_threads_from_env, split_by_layer
from vime.weight_sync.engine.shadow import SHADOW_OF_THREAD, ShadowLoad
from vime.weight_sync.engine.shadow_checks import check_can_shadow

logger = logging.getLogger(__name__)


def worker_index(parallel_config: Any) -> int:
    """This worker's index among all workers of the engine (DP replicas included).

    The same formula as vLLM's NCCL engine, so trainers can use one rank layout for both.
    """
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def parse_buckets(buckets: list[dict[str, Any]]) -> list[Bucket]:
    if not isinstance(buckets, list) or not buckets:
        raise ValueError(f"update_info.buckets must be a non-empty list, got {buckets!r:.200}")
    return [Bucket.from_dict(b) for b in buckets]


def refresh_tied_kernels(model: torch.nn.Module) -> int:
    """Rebuild the CPU kernel of every module that serves another module's parameter (a head
    tied to the embedding); returns how many.

    vLLM's CPU backend packs such a head's weight into a oneDNN kernel of its own at load time
    (`cpu_linear`, a copy). Layerwise reload copies a new embedding into the shared parameter in
    place but never processes the head, which loads nothing: without this its kernel would keep
    computing logits from the embedding the engine started with.
    """
    owners: set[int] = set()
    rebuilt = 0
    for module in model.modules():
        tied = False
        for param in module._parameters.values():
            if param is None:
                continue
            tied |= id(param) in owners
            owners.add(id(param))
        method = getattr(module, "quant_method", None)
        if tied and getattr(module, "cpu_linear", None) is not None and method is not None:
            method.process_weights_after_loading(module)
            rebuilt += 1
    return rebuilt


class BucketEngine(WeightTransferEngine):
    """Shared by the vime backends: layerwise reload around an update, loading from views.

    `stats` times the last weight update on this worker, phase by phase (seconds): start,
    receive (waiting for and mapping the bytes), load (vLLM's load_weights, including layerwise
    processing of the layers a bucket completes), finish; and counts its update_weights requests,
    buckets and bytes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats: dict[str, float] = {}
        self._expert_prefixes: set[str] = set()  # MoE experts modules this update loaded
        self._baseline = Baseline()  # delta syncs: the tensors of the last full sync, patched
        # weight_sync.shadow (set at init): each update loads into a copy while the engine
        # decodes; `_shadow` is the open one, between start and finish.
        self.shadow_mode = False
        self._shadow: ShadowLoad | None = None
        self.commit_timeout_s = 600.0

    @property
    def baseline(self) -> Baseline:
        return self._baseline

    @functools.cached_property
    def _load_threads(self) -> CoreThreads | None:
        # Made on the first load, on the thread that loads (the worker's own, pinned one).
        return core_threads_from_env()

    def set_shadow_mode(self, shadow: bool, timeout_s: float) -> None:
        """At init: whether updates load beside the served weights (refused with the reason
        where this engine cannot: `check_can_shadow`)."""
        if shadow:
            check_can_shadow(self.model, self.model_config, self.device)
        self.shadow_mode = bool(shadow)
        self.commit_timeout_s = timeout_s
        self._drop_shadow()

    def _drop_shadow(self) -> None:
        """Let an open shadow load go (the served weights were never touched)."""
        if self._shadow is not None:
            self._shadow.discard()
            self._shadow = None

    def shadow_status(self, wait_s: float) -> dict[str, Any]:
        """The open shadow load: sealed (no more buckets), then {"ready", "error"} after
        waiting up to `wait_s` for it to finish."""
        if self._shadow is None:
            error = "no weight update is loading beside the served weights"
            return {"ready": False, "error": error}
        self._shadow.seal(self._expert_prefixes)
        return self._shadow.status(wait_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        began = time.perf_counter()
        self._drop_shadow()
        shadow_bytes = 0
        if self.shadow_mode:
            shadow_bytes = check_can_shadow(self.model, self.model_config, self.device)  # now
            threads = self._load_threads  # the extra cores of cpu_sync_load_cores, if any
            self._shadow = ShadowLoad(self.model, threads.extra if threads is not None else ())
        else:
            initialize_layerwise_reload(self.model)
        self._expert_prefixes = set()
        self._baseline.start()
        started = time.perf_counter() - began
        self.stats = dict(
            start=started,
            receive=0.0,
            load=0.0,
            finish=0.0,
            requests=0,
            buckets=0,
            parallel_buckets=0,  # loaded on more than one thread
            bytes=0,
            patch=0.0,  # applying delta buckets to the baseline
            delta_buckets=0,
            shadow_bytes=shadow_bytes,  # the copy's estimate (weight_sync.shadow)
        )

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        began = time.perf_counter()
        if self.shadow_mode:
            shadow, self._shadow = self._shadow, None
            if shadow is None:
                return  # ending an update that failed (its copy is already dropped)
            shadow.seal(self._expert_prefixes)
            try:
                self.stats["swapped_modules"] = shadow.commit(self.commit_timeout_s)
            except BaseException:
                self._baseline.invalidate()  # patched for a version that never served
                raise
            finally:
                self.stats.update({f"shadow_{k}": v for k, v in shadow.stats.items()})
            self.stats["finish"] = time.perf_counter() - began
            return
        finalize_layerwise_reload(self.model, self.model_config)
        if self._expert_prefixes and not torch.accelerator.is_available():
            self.stats["moe_layers_repacked"] = refresh_cpu_moe_prepack(
                self.model, self._expert_prefixes
            )
        if self.stats.get("buckets") and not torch.accelerator.is_available():
            self.stats["tied_kernels_rebuilt"] = refresh_tied_kernels(self.model)
        self.stats["finish"] = time.perf_counter() - began

    def _count(self, phase: str, began: float) -> None:
        self.stats[phase] += time.perf_counter() - began

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only
        # machine; loads here are synchronous on CPU and only need a sync on an accelerator.
        if self.stats:
            self.stats["requests"] += 1
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            self._end_failed_update()
            raise
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def _end_failed_update(self) -> None:
        """vLLM 0.32's worker drops the update session when update_weights raises, and refuses
        the finish that would have ended the layerwise reload: the layers it put on the meta
        device would stay there and the next forward would kill the EngineCore. End the reload
        here: a layer that got no weights in this update gets its previous tensors back (so an
        uncommitted delta, which loads nothing, leaves the previous weights whole)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._baseline.invalidate()  # what arrived of a delta may be half-applied
        if self.shadow_mode:
            self._drop_shadow()  # the served modules were never touched
            return
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except Exception:  # noqa: BLE001 (the update's own error is the one to raise)
            logger.exception("ending the failed weight update's layerwise reload failed")

    def _receive(self, bucket: Bucket, entries: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket's tensors, by its mode (see vime.weight_sync.buckets / delta)."""
        if bucket.mode == "dense":
            self._load(entries)
        elif bucket.mode == "full":
            self._baseline.store(entries)
            self._load(entries)
        elif bucket.mode == "delta":
            began = time.perf_counter()
            self._baseline.patch(entries)
            self._count("patch", began)
            self.stats["delta_buckets"] += 1
        else:  # commit: load the stage's patched tensors whole, as a full sync of them would
            self._load(self._baseline.commit(bucket.commit_names))

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        # Layerwise reload may keep these views until the rest of their layer arrives, possibly
        # in a later bucket: each bucket's storage must therefore stay valid and unchanged until
        # finish_weight_update, which is why both backends reuse a buffer only in a later sync.
        def load(group: list[tuple[str, torch.Tensor]]) -> None:
            # The check's switch is a context variable: each loading thread sets its own.
            with disable_mtp_completeness_check():
                self.model.load_weights(group)

        began = time.perf_counter()
        self._expert_prefixes |= expert_prefixes([name for name, _ in weights])
        if self.shadow_mode:  # loads on the shadow's own thread; timed there
            # On a load thread (a receive running there): that thread's own copy, even if the
            # update was dropped or another started meanwhile; never the served model.
            shadow = getattr(threading.current_thread(), SHADOW_OF_THREAD, None) or self._shadow
            if shadow is None:
                raise RuntimeError("no weight update is loading beside the served weights")
            shadow.submit(weights)
            self.stats["buckets"] += 1
            self.stats["bytes"] += sum(t.nbytes for _, t in weights)
            return
        threads = self._load_threads
        if threads is None:
            load(weights)
        else:
            outside, groups = split_by_layer(weights, threads.num_threads)
            if outside:
                load(outside)
            threads.run(load, groups)
            if len(groups) > 1:
                self.stats["parallel_buckets"] += 1
        self._count("load", began)
        self.stats["buckets"] += 1
        self.stats["bytes"] += sum(t.nbytes for _, t in weights)
