"""Rank 0's calls to the engines during a sync: each on every engine at once, each bounded by a
timeout, each failure named by the engine it came from (`call_engines`); `EngineControl` holds
the calls a sync makes (pause, flush, start, the staged-load poll, the commit, finish, resume)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager
from typing import Any, Protocol

from vime.weight_sync.engine import core_commit

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """The control methods a sync needs; `vime.engines.vllm_engine.VLLMEngine` has them all."""

    def pause_generation(self, mode: Any = None, clear_cache: bool | None = None) -> Any: ...
    def continue_generation(self) -> Any: ...
    def flush_cache(self, timeout_s: float | None = None, raise_on_timeout: bool = True) -> Any: ...
    def start_weight_update(self) -> Any: ...
    def finish_weight_update(self, weight_version: str | int | None) -> Any: ...


class WeightSyncError(RuntimeError):
    """A sync failed; `phase` names where, and the message names the engine or rank."""

    def __init__(self, message: str, *, phase: str = ""):
        super().__init__(message)
        self.phase = phase


def describe_engine(index: int, engine: Any) -> str:
    """ "engine <index> (<url>)": every engine handle (VLLMEngine, RayEngine) has a `url`, which
    a VLLMEngine that never started refuses to give."""
    try:
        url = engine.url
    except (AttributeError, RuntimeError):
        url = None
    return f"engine {index}" + (f" ({url})" if isinstance(url, str) else "")


def call_engines(
    engines: Sequence[Any],
    phase: str,
    call: Callable[[Any], Any],
    *,
    timeout_s: float,
) -> list[Any]:
    """`call(engine)` for every engine on its own thread; WeightSyncError naming the first failure.

    Waits at most `timeout_s` in all. A call still running at the deadline is abandoned, never
    joined (it may be blocked on an engine that will not answer).
    """
    if not engines:
        return []
    executor = ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix=f"vime-{phase}")
    futures = [executor.submit(call, engine) for engine in engines]
    deadline = time.monotonic() + timeout_s
    results, errors = [], []
    for index, future in enumerate(futures):
        try:
            results.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
        except FutureTimeoutError:
            errors.append(f"{describe_engine(index, engines[index])}: no answer in {timeout_s:g} s")
        except Exception as exc:
            errors.append(f"{describe_engine(index, engines[index])}: {type(exc).__name__}: {exc}")
    executor.shutdown(wait=not errors, cancel_futures=True)
    if errors:
        raise WeightSyncError(
            f"weight sync phase {phase!r} failed: " + "; ".join(errors), phase=phase
        )
    return results


# Each poll may hold the engine's busy loop this long (it serves RPCs between steps).
STAGE_POLL_WAIT_S = 0.01
STAGE_POLL_INTERVAL_S = 0.02


def wait_staged(engine: Any, timeout_s: float) -> None:
    """Poll `engine` until each of its workers has its shadow load ready (`vime_shadow_ready`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = engine.collective_rpc(
            "vime_shadow_ready", kwargs={"wait_s": str(STAGE_POLL_WAIT_S)}, timeout_s=timeout_s
        )
        errors = [w["error"] for w in workers if isinstance(w, dict) and w.get("error")]
        if errors:
            raise RuntimeError("loading beside the served weights failed: " + "; ".join(errors))
        if workers and all(isinstance(w, dict) and w.get("ready") for w in workers):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine's workers were not ready in {timeout_s:g} s: {workers}")
        time.sleep(STAGE_POLL_INTERVAL_S)


class EngineControl:
    """Rank 0's engine calls, each on every engine in parallel; with no engines, all no-ops."""

    warned = False  # can_commit's warning, once per process

    def __init__(self, engines: Sequence[Engine], timeout_s: float):
        self.engines, self.timeout_s = engines, timeout_s

    def _all(self, phase: str, call: Callable[[Any], Any], timeout_s: float = 0.0) -> list[Any]:
        return call_engines(self.engines, phase, call, timeout_s=timeout_s or self.timeout_s)

    def pause(self, clear_cache: bool) -> None:
        # keep: requests in flight freeze and continue on the new weights; none is lost.
        self._all("pause", lambda e: e.pause_generation(mode="keep", clear_cache=clear_cache))

    def flush(self, clear_cache: bool) -> bool | None:
        """Whether every engine's prefix cache is now empty (None: no engines here); never
        raises for a cache that is still in use."""
        if not self.engines:
            return None
        if clear_cache:
            # vLLM 0.32: a pause with clear_cache resets the prefix cache itself before it
            # returns (EngineCore._finish_pause -> _reset_caches, which raises if the reset
            # fails), so a pause that succeeded left nothing to flush: no extra round trip.
            return True
        # After a keep pause with clear_cache=False, frozen requests hold their KV blocks until
        # they finish: a flush that fails once cannot succeed before resume, so it is not retried
        # (retrying cost the async loop 0.2 s per sync).
        flushed = self._all(
            "flush", lambda e: bool(e.flush_cache(timeout_s=0.0, raise_on_timeout=False))
        )
        return all(flushed)

    def start(self) -> None:
        self._all("start", lambda e: e.start_weight_update())

    def wait_staged(self) -> None:
        """Until every worker of every engine has the update loaded beside its served weights
        (`weight_sync.shadow`); raises naming the engine whose load failed."""
        self._all("stage", lambda e: wait_staged(e, self.timeout_s))

    def finish(self, version: str) -> None:
        self._all("finish", lambda e: e.finish_weight_update(version))

    def can_commit(self) -> bool:
        """Whether every engine answers `core_commit.PROBE` available (logs why not, once)."""
        answers = self._all("probe", lambda e: e.collective_rpc(core_commit.PROBE))
        why = {
            str(worker.get("why"))
            for workers in answers
            for worker in workers
            if not (isinstance(worker, dict) and worker.get("available"))
        }
        if why and not EngineControl.warned:
            EngineControl.warned = True
            logger.warning("weight_sync.shadow: swapping inside a keep pause: %s", "; ".join(why))
        return not why

    def commit_between_steps(self, version: str) -> bool:
        """Every engine swaps in its loaded update, labels it `version` and resets its prefix
        cache in one engine-core call (`core_commit.COMMIT`); whether every cache was reset."""
        kwargs = {"weight_version": version, "flush": "1"}
        answers = self._all("finish", lambda e: e.collective_rpc(core_commit.COMMIT, kwargs=kwargs))
        return all(worker.get("prefix_cache_flushed") for workers in answers for worker in workers)

    def resume(self) -> None:
        self._all("resume", lambda e: e.continue_generation())

    @contextmanager
    def paused(self, resume_on_failure: bool = True) -> Iterator[None]:
        """Resume every engine if the block fails (a half-failed pause may have paused some)."""
        try:
            yield
        except BaseException:
            if resume_on_failure:
                self._best_effort("resume", self.resume, "engines may still be paused")
            raise

    @contextmanager
    def updating(self, weight_version: int, shadow: bool = False) -> Iterator[None]:
        """End the update with version "<weight_version>-failed" if the block fails after start
        (weights may be partly new). A shadow update is dropped instead (`vime_end_open_update`:
        a finish would swap in what had loaded): its engines keep serving their version, and
        keep its label."""
        try:
            yield
        except BaseException:
            # Also after a failed start or finish: they may have reached some engines.
            if shadow:
                self._best_effort("finish", self.drop_open_update, "update left open")
            else:
                failed = f"{weight_version}-failed"
                self._best_effort("finish", lambda: self.finish(failed), "update left open")
            raise

    def drop_open_update(self) -> None:
        self._all("finish", lambda e: e.collective_rpc("vime_end_open_update"))

    def _best_effort(self, what: str, call: Callable[[], None], consequence: str) -> None:
        if not self.engines:
            return
        try:
            call()
        except WeightSyncError as exc:
            logger.error("recovery (%s): %s: %s", what, consequence, exc)
