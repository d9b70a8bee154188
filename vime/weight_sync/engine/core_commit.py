"""The swap and its version label in one engine-core call, between two scheduler steps.

vLLM 0.32 tags every output of a step with the engine core's weight-version label
(`EngineCore._attach_weight_version`), and its `finish_weight_update` sets that label in a second
engine-core call after the workers' finish returned: a step may run between the two, its tokens
made by the new weights under the old label. A plain update hides this behind a keep pause. An
update loaded beside the served weights (`weight_sync.shadow`) needs no pause for its load, only
for this gap; this hook closes the gap instead.

`register` is a vLLM general plugin (entry point `vllm.general_plugins: vime`, loaded by every
vLLM process; vLLM calls it in `EngineCore.__init__`). It wraps `EngineCore.collective_rpc`, the
engine-core utility behind `POST /collective_rpc`, to answer two method names itself:

- `COMMIT` (kwargs `weight_version`, `flush` "1"/"0"): the workers' `finish_weight_update` (with
  shadow: the swap, dictionary assignments), then the label, then (flush "1") the prefix-cache
  reset, all inside one utility call. The engine core runs utility calls only between steps, so
  no step sees the new weights under the old label or the old ones under the new. One result
  per worker: {"weight_version", "prefix_cache_flushed"}.
- `PROBE`: [{"available": True}] (one answer, the engine core's) where the hook is loaded and
  the engine core runs one step at a time (no batch queue: CPU engines, and GPU ones without
  async scheduling or pipeline parallelism); otherwise {"available": False, "why": ...}.

Where the hook is not loaded (vime not installed in the engine's Python, or `VLLM_PLUGINS`
leaving it out), the calls reach the workers, whose extension answers PROBE with
{"available": False} and COMMIT with an error saying so (`vllm_extension`); the trainer then
commits inside a keep pause, as a plain update does.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")

COMMIT = "vime_commit_between_steps"
PROBE = "vime_commit_between_steps_available"
NOT_LOADED = (
    "vime's engine-core hook is not loaded in this engine (vLLM general plugin 'vime', "
    "entry point vllm.general_plugins): install vime in the engine's Python environment "
    "(pip install -e .) and leave 'vime' in VLLM_PLUGINS if that is set"
)


def register() -> None:
    """Wrap `EngineCore.collective_rpc` (once per process; vLLM may call plugins again)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError as exc:  # another vLLM layout: the trainer falls back to the paused commit
        logger.warning("vime: no engine-core hook (%s)", exc)
        return
    original = EngineCore.collective_rpc
    if getattr(original, "vime_hook", False):
        return

    def collective_rpc(
        self: Any,
        method: Any,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if method == PROBE:
            return probe(self)
        if method == COMMIT:
            return commit(self, original, timeout, kwargs or {})
        return original(self, method, timeout, args, kwargs)

    collective_rpc.vime_hook = True  # type: ignore[attr-defined]
    collective_rpc.__doc__ = original.__doc__
    EngineCore.collective_rpc = collective_rpc


def _one_step_at_a_time(core: Any) -> str | None:
    """Why a step could be in flight while a utility call runs (None: it cannot)."""
    if getattr(core, "batch_queue", None) is not None:
        return (
            "this engine core keeps a batch queue (async scheduling or pipeline parallelism): "
            "a step may be in flight during a utility call"
        )
    return None


def probe(core: Any) -> list[dict[str, Any]]:
    why = _one_step_at_a_time(core)
    return [{"available": why is None, "why": why}]  # the engine core's answer, for all workers


def commit(core: Any, rpc: Any, timeout: float | None, kwargs: dict[str, Any]) -> list[Any]:
    """Finish the open update on every worker, label it, optionally reset the prefix cache."""
    version = kwargs.get("weight_version")
    if not isinstance(version, str) or not version:
        raise ValueError(f"{COMMIT} needs kwargs weight_version (a non-empty string), got {kwargs}")
    why = _one_step_at_a_time(core)
    if why is not None:
        raise RuntimeError(f"{COMMIT}: {why}; commit inside a keep pause instead")
    results = rpc(core, "finish_weight_update", timeout, (), None)
    core.set_weight_version(version)
    flushed = bool(core.reset_prefix_cache()) if kwargs.get("flush") == "1" else None
    return [{"weight_version": version, "prefix_cache_flushed": flushed} for _ in results]
