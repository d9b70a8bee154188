"""The weight-sync session: the one place that orders pause, update and resume across trainer ranks.

Every trainer rank calls `run_sync_session` with the same arguments except `send_weights` (what
this rank moves, possibly nothing). Rank 0 of `group` drives the engines' control plane; the
others only send their buckets. Phases end in a *checked barrier* on the gloo `group`: every rank
reports whether its phase succeeded, so a failure on any rank stops every rank at the same point,
and each wait is bounded by a timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """The control methods a sync needs; `vime.rollout.vllm_engine.VLLMEngine` has them all."""

    def pause_generation(self, mode: Any = None, clear_cache: bool | None = None) -> Any: ...
    def continue_generation(self) -> Any: ...
    def flush_cache(self, timeout_s: float | None = None) -> Any: ...
    def start_weight_update(self) -> Any: ...
    def finish_weight_update(self, weight_version: str | int | None) -> Any: ...


class WeightSyncError(RuntimeError):
    """A sync failed; `phase` names where, and the message names the engine or rank."""

    def __init__(self, message: str, *, phase: str = ""):
        super().__init__(message)
        self.phase = phase


@dataclass
class SyncReport:
    """What one sync did, as seen from this rank (engine phases are timed on rank 0 only)."""

    weight_version: int
    # Per phase, each including its barrier: pause, flush (rank 0), start, send, finish,
    # verify (when asked), resume.
    seconds: dict[str, float] = field(default_factory=dict)
    prefix_cache_flushed: bool | None = None  # None on ranks other than 0
    num_buckets: int = 0  # sent by this rank
    num_bytes: int = 0  # sent by this rank
    verified: bool = False  # engine checksums compared with what this rank sent
    # The send phase on this rank, split up by the updater: gather, convert, pack, checksum,
    # transfer (bytes moving + the engines' update calls, their load included).
    send_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def describe_engine(index: int, engine: Any) -> str:
    # Read the instance's own fields: a RayEngine forwards unknown attributes to its actor.
    fields = getattr(engine, "__dict__", {})
    url = fields.get("url") or fields.get("_url") or fields.get("_external_url")
    return f"engine {index}" + (f" ({url})" if url else "")


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


def checked_barrier(group: Any, phase: str, failed: bool, timeout_s: float) -> None:
    """A barrier that also tells every rank whether any rank failed `phase`.

    Raises WeightSyncError on every rank when one failed (the failing rank raises its own error
    instead) or when some rank does not arrive within `timeout_s`.
    """
    world_size = dist.get_world_size(group)
    flags = [torch.zeros(1, dtype=torch.int32) for _ in range(world_size)]
    mine = torch.tensor([1 if failed else 0], dtype=torch.int32)
    work = dist.all_gather(flags, mine, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weight sync barrier after phase {phase!r} failed or timed out after {timeout_s:g} s "
            f"(a rank did not arrive): {exc}",
            phase=phase,
        ) from exc
    failed_ranks = [rank for rank, flag in enumerate(flags) if int(flag) != 0]
    if failed_ranks and not failed:
        raise WeightSyncError(
            f"weight sync phase {phase!r} failed on trainer rank(s) {failed_ranks} "
            "(their logs have the cause)",
            phase=phase,
        )


def run_sync_session(
    *,
    engines: Sequence[Engine],
    group: Any,
    weight_version: int,
    send_weights: Callable[[], None],
    verify: Callable[[], None] | None = None,
    clear_cache: bool = False,
    flush_timeout_s: float = 1.0,
    call_timeout_s: float = 600.0,
    barrier_timeout_s: float = 600.0,
) -> SyncReport:
    """One weight sync, on every trainer rank of the gloo `group`. The order:

    0. the caller has already incremented `weight_version` and checked names, dtypes and shapes;
    1. rank 0 pauses every engine in parallel (mode keep, `clear_cache`) and then flushes their
       prefix caches (retried up to `flush_timeout_s` with clear_cache=True, tried once without:
       with clear_cache=False and requests in flight the frozen requests hold KV blocks and the
       flush cannot succeed); a failed flush is logged as a warning and reported as
       `prefix_cache_flushed=False`, not an error;
       barrier;
    2. rank 0 calls start_weight_update on every engine; barrier;
    3. every rank runs `send_weights` (pp senders move their buckets, turn by turn); barrier;
    4. rank 0 calls finish_weight_update(str(weight_version)) on every engine; barrier;
    5. `verify`, if given (on every rank or none), e.g. engine checksums against what this rank
       sent; barrier;
    6. rank 0 continues every engine; barrier.

    Each engine call and each barrier has a timeout. On a failure every rank raises
    WeightSyncError naming the phase (and the engine, on rank 0); before raising, rank 0 makes
    sure no engine stays paused or mid-update: after a start it calls finish_weight_update with
    version "<weight_version>-failed" (weights may be partly new: sync again before trusting
    them), then continues every engine, best effort.
    """
    rank = dist.get_rank(group)
    driver = rank == 0
    report = SyncReport(weight_version=weight_version)
    state = {"paused": False, "started": False}

    def pause() -> None:
        state["paused"] = True  # a pause that failed halfway may still have paused some engines
        call_engines(
            engines,
            "pause",
            lambda e: e.pause_generation(mode="keep", clear_cache=clear_cache),
            timeout_s=call_timeout_s,
        )

    def flush() -> None:
        began = time.monotonic()
        # After a keep pause with clear_cache=False, frozen requests hold their KV blocks until
        # they finish: a flush that fails once cannot succeed before resume, so it is not retried
        # (retrying cost the async loop 0.2 s per sync). With clear_cache=True the pause freed
        # them and retries cover a scheduler that has not let go yet.
        retry_s = flush_timeout_s if clear_cache else 0.0

        def flush_one(engine: Any) -> bool:
            return bool(engine.flush_cache(timeout_s=retry_s, raise_on_timeout=False))

        flushed = call_engines(engines, "flush", flush_one, timeout_s=retry_s + call_timeout_s)
        report.prefix_cache_flushed = all(flushed)
        report.seconds["flush"] = time.monotonic() - began
        if not report.prefix_cache_flushed:
            logger.warning(
                "weight version %d: prefix caches not flushed (clear_cache=%s with requests in "
                "flight); new requests may reuse prefixes computed by the old weights",
                weight_version,
                clear_cache,
            )

    def start() -> None:
        state["started"] = True
        call_engines(engines, "start", lambda e: e.start_weight_update(), timeout_s=call_timeout_s)

    def finish() -> None:
        version = str(weight_version)
        call_engines(
            engines, "finish", lambda e: e.finish_weight_update(version), timeout_s=call_timeout_s
        )
        state["started"] = False

    def resume() -> None:
        call_engines(engines, "resume", lambda e: e.continue_generation(), timeout_s=call_timeout_s)
        state["paused"] = False

    steps: list[tuple[str, Callable[[], None] | None]] = [
        ("pause", (lambda: (pause(), flush())) if driver else None),
        ("start", start if driver else None),
        ("send", send_weights),
        ("finish", finish if driver else None),
        ("verify", verify),
        ("resume", resume if driver else None),
    ]
    if verify is None:  # the same on every rank: the phase and its barrier are skipped
        steps = [(phase, step) for phase, step in steps if phase != "verify"]
    for phase, step in steps:
        began = time.monotonic()
        error: BaseException | None = None
        if step is not None:
            try:
                step()
            except Exception as exc:
                error = exc
                logger.error("weight version %d: phase %r failed: %s", weight_version, phase, exc)
        try:
            checked_barrier(group, phase, error is not None, barrier_timeout_s)
        except WeightSyncError as barrier_error:
            error = error or barrier_error
        report.seconds[phase] = (
            time.monotonic() - began - report.seconds.get("flush", 0.0) * (phase == "pause")
        )
        if error is not None:
            if driver:
                _recover(engines, state, weight_version, call_timeout_s)
            if isinstance(error, WeightSyncError):
                raise error
            raise WeightSyncError(
                f"weight sync phase {phase!r} failed on trainer rank {rank}: "
                f"{type(error).__name__}: {error}",
                phase=phase,
            ) from error
    logger.info(
        "weight version %d synced in %.3f s (%s)",
        weight_version,
        report.total_s,
        ", ".join(f"{k} {v:.3f}" for k, v in report.seconds.items()),
    )
    return report


def _recover(
    engines: Sequence[Engine], state: dict[str, bool], weight_version: int, timeout_s: float
) -> None:
    """Best effort after a failure: end an open update, then continue every engine."""
    if state["started"]:
        try:
            call_engines(
                engines,
                "finish",
                lambda e: e.finish_weight_update(f"{weight_version}-failed"),
                timeout_s=timeout_s,
            )
        except WeightSyncError as exc:
            logger.error("recovery: %s", exc)
    if state["paused"]:
        try:
            call_engines(engines, "resume", lambda e: e.continue_generation(), timeout_s=timeout_s)
        except WeightSyncError as exc:
            logger.error("recovery: engines may still be paused: %s", exc)
