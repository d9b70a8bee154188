"""An update loaded beside the served weights (`weight_sync.shadow`), swapped in at the commit.

vLLM's layerwise reload, which a plain update runs, puts every layer of the served model on the
meta device at the start of an update: nothing can decode until it finishes. `ShadowLoad` runs
the same machinery on a *copy of the model's module tree* instead, on a thread of its own, while
the engine keeps decoding on the served modules:

- the copy is structural: every module is shallow-copied (its own parameter, buffer and child
  dicts; everything else shared), and each copied layer starts as vLLM starts a first load, from
  the model-format metadata vLLM recorded at load time, on meta, with its weight loaders wrapped
  for layerwise processing but *no kernel tensors to copy back into* (a reload would copy the
  processed values into the served tensors in place: exactly what must not happen here);
- buckets load into the copy through the model's own `load_weights`; a layer whose weights are
  all in is materialized, loaded and processed (on CPU: repacked into oneDNN kernels, kept in
  `cpu_linear`) on the load thread, in memory of its own; the load thread runs on the sync-load
  cores beyond the worker's own where there are any, off the core that decodes;
- `seal` (run on the load thread once the last bucket is in) processes layers that loaded part of
  their elements (padding), gives tied modules (a head sharing the embedding's weight) the new
  tensor and reprocesses them, and re-runs the CPU MoE prepack on the copy;
- `commit`, on the worker's own thread between two scheduler steps (in the engine-core call that
  also sets the version label, `core_commit`, or inside a keep pause where that hook is missing:
  either way each token's weight version stays exact), swaps into each served
  module that loaded something its copy's parameter and persistent-buffer dicts and every
  attribute its processing changed (the kernel handles): dictionary assignments, no bytes moved.

A failure anywhere before the swap leaves the served modules untouched: the copy is dropped.
Memory: one more copy of the served weights per worker until the commit (`required_bytes`),
checked against what the machine has free before the load starts.

Limits (refused with a message, or stated): CPU engines only, eager only (a captured graph holds
the served tensors' addresses); quantized attention (KV-cache scales loaded into attention
layers) is refused.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from types import MethodType
from typing import Any

import torch

logger = logging.getLogger(f"vllm.{__name__}")

# The attribute of a load thread naming its ShadowLoad (cleared when the thread ends).
SHADOW_OF_THREAD = "vime_shadow_load"
# Module dict entries the swap treats apart (the rest: swapped when the copy's differs).
_STRUCTURE = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set")


def _rebind(tensor: torch.Tensor, old: Any, new: Any) -> torch.Tensor:
    """Methods of `old` kept on `tensor` (weight loaders) bound to `new` instead."""
    for key, value in list(tensor.__dict__.items()):
        if isinstance(value, MethodType) and value.__self__ is old:
            tensor.__dict__[key] = value.__func__.__get__(new)
    return tensor


def _own_meta(tensor: torch.Tensor, live: torch.nn.Module, twin: torch.nn.Module) -> torch.Tensor:
    """A meta tensor like `tensor` (vLLM's restore metadata of `live`) for `twin` alone: its
    own attribute dict, weight loaders unwrapped from any layerwise wrapper and bound to `twin`
    (vLLM keeps one metadata tensor per layer and wraps its loader in place)."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    own = tensor.data.to("meta")
    own.__class__ = tensor.__class__
    own.__dict__ = tensor.__dict__.copy()
    _unwrap_loader(own)
    _rebind(own, layer_ref_sentinel, twin)
    return _rebind(own, live, twin)


def _unwrap_loader(tensor: torch.Tensor) -> None:
    """Drop a layerwise wrapper from `tensor`'s weight loader: one left by a reload of the
    served layer would route the twin's loads into the served layer's bookkeeping. (vLLM's
    parameter classes keep it in `_weight_loader` behind a `weight_loader` property.)"""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader

    try:
        loader = tensor.weight_loader
    except (AttributeError, ValueError):
        return
    if callable(loader) and loader.__name__ == "online_process_loader":
        tensor.weight_loader = _get_original_loader(tensor)


def _own_copy(tensor: torch.Tensor, live: torch.nn.Module, twin: torch.nn.Module) -> torch.Tensor:
    """A copy of a tensor vLLM never puts on meta (`bias`, expert maps), so that loading into
    the twin cannot write the served one."""
    own = tensor.detach().clone()
    if isinstance(tensor, torch.nn.Parameter):
        own = torch.nn.Parameter(own, requires_grad=False)
        own.__class__ = tensor.__class__  # vLLM's parameter classes (as its own meta copies do)
    own.__dict__.update(tensor.__dict__)
    _unwrap_loader(own)
    return _rebind(own, live, twin)


def _copy_tree(
    module: torch.nn.Module, memo: dict[int, torch.nn.Module], pairs: list
) -> torch.nn.Module:
    """A shallow structural copy of `module`'s tree: one copy per module (a module reached twice,
    e.g. a shared one, gets one copy), with dicts of its own for parameters, buffers, children."""
    if id(module) in memo:
        return memo[id(module)]
    twin = copy.copy(module)
    memo[id(module)] = twin
    pairs.append((module, twin))
    twin.__dict__["_parameters"] = dict(module._parameters)
    twin.__dict__["_buffers"] = dict(module._buffers)
    twin.__dict__["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    twin.__dict__["_modules"] = {
        name: None if child is None else _copy_tree(child, memo, pairs)
        for name, child in module._modules.items()
    }
    return twin


class ShadowLoad:
    """One update loaded into a copy of `model`'s modules on a thread of its own; `commit`
    swaps it in. Call `submit` per bucket, then `status` until ready, then `commit` (or
    `discard`)."""

    def __init__(self, model: torch.nn.Module, cores: Sequence[int] = ()):
        """`cores`: CPUs for the load thread other than those the worker decodes on (the
        engine's `cpu_sync_load_cores` beyond its own); none: the worker's own, shared with
        decoding."""
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            get_layerwise_info,
            initialize_online_processing,
        )
        from vllm.model_executor.model_loader.reload.meta import (
            SKIP_TENSORS,
            restore_layer_on_meta,
        )

        began = time.perf_counter()
        self._pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        self.root: Any = _copy_tree(model, {}, self._pairs)
        # Parameters one served module shares with another (a tied head): {id: [(module, name)]}.
        self._owners: dict[int, list[tuple[torch.nn.Module, torch.nn.Module, str]]] = {}
        for live, twin in self._pairs:
            for name, param in live._parameters.items():
                if param is not None:
                    self._owners.setdefault(id(param), []).append((live, twin, name))
            served_info = LAYERWISE_INFO.get(live)
            if served_info is None:
                raise RuntimeError(
                    f"vLLM recorded no reload metadata for {type(live).__name__}: this model "
                    "cannot be loaded beside the served weights (set weight_sync.shadow false)"
                )
            params, buffers = served_info.restore_metadata
            info = get_layerwise_info(twin)
            info.restore_metadata = (
                {n: _own_meta(t, live, twin) for n, t in params.items()},
                {n: _own_meta(t, live, twin) for n, t in buffers.items()},
            )
            info.restore_device = served_info.restore_device
            info.kernel_tensors = None  # a first load: processed tensors stay the twin's own
            for table in ("_parameters", "_buffers"):
                tensors = twin.__dict__[table]
                for name in SKIP_TENSORS & tensors.keys():
                    if tensors[name] is not None:
                        tensors[name] = _own_copy(tensors[name], live, twin)
            restore_layer_on_meta(twin, info)
            initialize_online_processing(twin)
        self.stats: dict[str, float] = {"prepare": time.perf_counter() - began, "load": 0.0}
        self._swap: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._pending = 0
        self._sealed = False
        self._dropped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._work, args=(tuple(cores),), name="vime-shadow-load", daemon=True
        )
        setattr(self._thread, SHADOW_OF_THREAD, self)
        self._thread.start()

    # -- the load thread ---------------------------------------------------------------------

    def _work(self, cores: Sequence[int]) -> None:
        if cores:  # off the cores the worker decodes on, so the load does not slow decoding
            try:
                os.sched_setaffinity(0, set(cores))  # this thread only (Linux: pid 0 = caller)
            except OSError as exc:
                logger.warning("shadow load thread not pinned to cores %s: %s", list(cores), exc)
        while True:
            job = self._jobs.get()
            if job is None:
                setattr(self._thread, SHADOW_OF_THREAD, None)
                return
            try:
                if self.error is None and not self._dropped:
                    with torch.no_grad():
                        job()
            except BaseException as exc:  # noqa: BLE001 (kept, raised at status/commit)
                logger.exception("loading the update beside the served weights failed")
                self.error = exc
            finally:
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def _enqueue(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put(job)

    def run_on_load_thread(self, job: Callable[[], None]) -> None:
        """Run `job` (e.g. receiving buckets, which then `submit` their weights) on the load
        thread, in turn with the loads; its failure fails the load."""
        if self._sealed:
            raise RuntimeError("this shadow load is sealed: no weights can be added to it")
        self._enqueue(job)

    def submit(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load `weights` (HF names, views that stay valid until the commit) into the copy: on
        the load thread, at once when called there (from a job of `run_on_load_thread`)."""
        on_load_thread = threading.current_thread() is self._thread
        if self._dropped or (self._sealed and not on_load_thread):
            raise RuntimeError("this shadow load is sealed: no weights can be added to it")
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        def load() -> None:
            began = time.perf_counter()
            with disable_mtp_completeness_check():
                self.root.load_weights(weights)
            self.stats["load"] += time.perf_counter() - began

        if on_load_thread:
            load()
        else:
            self._enqueue(load)

    def seal(self, expert_prefixes: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        """No more weights: finish the copy on the load thread (idempotent)."""
        if self._sealed:
            return
        self._sealed = True
        self._enqueue(lambda: self._finish(expert_prefixes))

    def _finish(self, expert_prefixes: set[str]) -> None:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import (
            _layerwise_process,
            get_layerwise_info,
        )

        began = time.perf_counter()
        processed: set[int] = set()
        for live, twin in self._pairs:
            info = get_layerwise_info(twin)
            if not info.can_load():  # processed as its last weight arrived (and reset)
                processed.add(id(twin))
            elif info.load_numel > 0:
                if is_deferred_attention_layer(twin):
                    raise ValueError(
                        f"{type(live).__name__}: attention weights (KV-cache scales) cannot be "
                        "loaded beside the served weights; set weight_sync.shadow false"
                    )
                _layerwise_process(twin, info)  # loaded all it will get (padding)
                processed.add(id(twin))
        self._tie(processed)
        self._swap = [(live, twin) for live, twin in self._pairs if id(twin) in processed]
        if expert_prefixes and self._swap:
            from vime.weight_sync.engine.moe import refresh_cpu_moe_prepack

            refresh_cpu_moe_prepack(self.root, expert_prefixes)
        self.stats["seal"] = time.perf_counter() - began

    def _tie(self, processed: set[int]) -> None:
        """A served parameter shared by modules (a tied head) goes to all of them: the modules
        that loaded nothing of it take the new tensor and are processed again (their kernel)."""
        for owners in self._owners.values():
            if len(owners) < 2:
                continue
            loaded = [(twin, name) for _, twin, name in owners if id(twin) in processed]
            if not loaded:
                continue
            source, source_name = loaded[0]
            new = source._parameters[source_name]
            for _, twin, name in owners:
                if id(twin) in processed:
                    continue
                twin._parameters[name] = new
                method = getattr(twin, "quant_method", None)
                if method is not None:
                    method.process_weights_after_loading(twin)
                processed.add(id(twin))

    # -- the worker's thread -----------------------------------------------------------------

    def status(self, wait_s: float = 0.0) -> dict[str, Any]:
        """Seal, wait up to `wait_s`; {"ready": loaded and finished, "error": text or None}."""
        self.seal()
        with self._lock:
            done = self._lock.wait_for(lambda: self._pending == 0, timeout=max(0.0, wait_s))
        error = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        return {"ready": bool(done and error is None), "error": error}

    def commit(self, timeout_s: float) -> int:
        """Wait for the copy (at most `timeout_s`), then swap it into the served modules;
        returns how many modules were swapped. Raises (swapping nothing) if the load failed."""
        self.seal()
        with self._lock:
            if not self._lock.wait_for(lambda: self._pending == 0, timeout=timeout_s):
                self.discard()
                raise TimeoutError(
                    f"the update loading beside the served weights did not finish in "
                    f"{timeout_s:g} s; the engine keeps serving the previous weights"
                )
        self._jobs.put(None)
        if self.error is not None:
            error = self.error
            self.discard()
            raise RuntimeError(
                f"loading the update beside the served weights failed ({type(error).__name__}: "
                f"{error}); the engine keeps serving the previous weights"
            ) from error
        began = time.perf_counter()
        for live, twin in self._swap:
            _swap_module(live, twin)
        self.stats["swap"] = time.perf_counter() - began
        swapped = len(self._swap)
        self._release()
        return swapped

    def discard(self) -> None:
        """Drop the copy; the served modules were never touched."""
        self._dropped = True
        self._sealed = True
        self._jobs.put(None)
        self._release()

    def _release(self) -> None:
        """Let the copy go. Its layerwise records hold weight loaders bound to its modules, so
        vLLM's weak table would keep each module (and the tensors it last held) alive forever:
        they are removed here, and each module's tensor tables are let go."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        for _, twin in self._pairs:
            info = LAYERWISE_INFO.pop(twin, None)
            if info is not None:
                # Its meta tensors carry loaders wrapped around `info` and the module: a cycle
                # the engine's collector may not reach for a long time (one update's kernels).
                info.restore_metadata = ({}, {})
                info.reset()
            # The module's own attribute dict (shared values, never the served module's dict):
            # dropping it lets go of what it last held, tables included (a swapped table is
            # served now and stays alive there).
            twin.__dict__.clear()
        self._pairs, self._swap, self._owners = [], [], {}
        self.root = None


def _swap_module(live: torch.nn.Module, twin: torch.nn.Module) -> None:
    """Give `live` what `twin` loaded: its parameter dict, its persistent buffers, and every
    other attribute whose object differs (kernel handles, load digests). Children stay."""
    params = twin.__dict__["_parameters"]
    for tensor in params.values():
        if tensor is not None:
            _rebind(tensor, twin, live)
    buffers = dict(twin.__dict__["_buffers"])
    # A non-persistent buffer is no checkpoint weight: the served one stays (as vLLM's reload
    # leaves a non-persistent buffer it did not load).
    for name in live._non_persistent_buffers_set:
        if name in live._buffers:
            buffers[name] = live._buffers[name]
    for key, value in twin.__dict__.items():
        if key not in _STRUCTURE and live.__dict__.get(key, _MISSING) is not value:
            live.__dict__[key] = value
    live.__dict__["_parameters"] = params
    live.__dict__["_buffers"] = buffers


_MISSING = object()
