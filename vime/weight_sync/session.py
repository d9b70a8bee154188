"""The weight-sync session: the one place that orders pause, update and resume across trainer ranks.

`run_sync_session` is the whole sync, top to bottom: rank 0 pauses every engine (keep) and
flushes their prefix caches, starts the update, each pipeline stage sends in its turn, rank 0
finishes the update with the new version and resumes the engines. With `shadow` (engines that
load beside the served weights, `weight_sync.shadow`) the engines keep decoding through start,
send and their load (`stage`: rank 0 waits until every engine has the update ready), and the
keep pause covers only the swap: pause, flush, finish, verify, resume. Every trainer rank runs the
same lines (ranks other than 0 with no engines to call), and every step ends in a *checked
barrier* on the gloo `group`: each rank says whether its part failed, so a failure anywhere stops
every rank at the same point, each wait bounded by a timeout. Two context managers undo what a
failure leaves open: `updating` ends an update that started, `paused` resumes the engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

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


@dataclass
class SyncReport:
    """What one sync did, as seen from this rank (engine phases are timed on rank 0 only)."""

    weight_version: int
    # Per step, each including its barrier: pause, flush, start, send (all stages' turns),
    # finish, verify (when asked), resume.
    seconds: dict[str, float] = field(default_factory=dict)
    prefix_cache_flushed: bool | None = None  # None on ranks other than 0
    num_buckets: int = 0  # sent by this rank
    num_bytes: int = 0  # sent by this rank
    verified: bool = False  # engine checksums compared with what this rank sent
    # The send phase on this rank, split up by the updater: gather, convert, pack, checksum,
    # transfer (bytes moving + the engines' update calls, their load included).
    send_seconds: dict[str, float] = field(default_factory=dict)
    # weight_sync.transport.delta: "full" or "delta" (None without); a delta's changed share of
    # the elements and the bytes a full sync would have sent (this rank's stage).
    delta: str | None = None
    changed_fraction: float | None = None
    full_bytes: int = 0
    # A delta sync failed and the same version then went in full before the engines resumed.
    repaired: bool = False
    # Rank 0: from the pause request to the resume's answer, the longest the engines can have
    # stood still for this sync (0.0 on other ranks, and where the caller keeps them paused).
    paused_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


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
    pp_size: int,
    stage_part: Callable[[int], Callable[[], None] | None],
    verify: Callable[[], None] | None = None,
    clear_cache: bool = False,
    shadow: bool = False,
    resume_on_failure: bool = True,
    call_timeout_s: float = 600.0,
    barrier_timeout_s: float = 600.0,
) -> SyncReport:
    """One weight sync, called on every trainer rank of the gloo `group` with the same arguments
    except `stage_part`: what this rank does in pipeline stage k's turn, `stage_part(k)` (None:
    nothing; the stage's ranks gather, its sender moves the buckets, holder ranks of a colocated
    transport receive them). The caller has already incremented `weight_version` and checked
    names, dtypes and shapes against the engines.

    With clear_cache=False and requests in flight, the frozen requests hold KV blocks and the
    prefix cache cannot be flushed before resume: that is reported as
    `prefix_cache_flushed=False` and logged, not raised. `verify`, if given, runs on every rank.

    On a failure every rank raises WeightSyncError naming the step (and the engine, on rank 0).
    Before that rank 0 ends an open update with version "<weight_version>-failed" (weights may
    be partly new: sync again before trusting them; with `shadow` the update is dropped, nothing
    swapped in, and the label stays) and, if `resume_on_failure`, resumes every
    engine, best effort (without it they stay paused for the caller's next sync, which resumes
    them: `resume_engines` if that cannot happen).
    """
    rank = dist.get_rank(group)
    engines = engines if rank == 0 else []  # only rank 0 calls the engines
    report = SyncReport(weight_version=weight_version)
    step = CheckedSteps(
        group, barrier_timeout_s, report.seconds, f"weight version {weight_version}"
    )
    control = _Control(engines, call_timeout_s)

    def flush() -> None:
        report.prefix_cache_flushed = control.flush(clear_cache)

    def send() -> None:
        step("start", control.start)
        for stage in range(pp_size):  # stages take turns: one engine loads one at a time
            step("send", stage_part(stage), f"pp stage {stage}")

    paused_at = time.monotonic()
    with control.paused(resume_on_failure):
        with control.updating(weight_version, shadow):
            if shadow:  # the engines decode on while they receive and load
                send()
                step("stage", control.wait_staged)
                paused_at = time.monotonic()
            step("pause", lambda: control.pause(clear_cache))
            step("flush", flush)
            if not shadow:
                send()
            step("finish", lambda: control.finish(str(weight_version)))
        if verify is not None:
            step("verify", verify)
        step("resume", control.resume)
    if engines:
        report.paused_s = time.monotonic() - paused_at

    # Rank 0 tells every sync once; the other ranks' view of it is detail.
    level = logging.INFO if rank == 0 else logging.DEBUG
    if report.prefix_cache_flushed is False:
        # Expected with clear_cache=False and requests in flight (the job counts it per step).
        logger.debug(
            "weight version %d: prefix caches not flushed (requests in flight hold KV blocks)",
            weight_version,
        )
    logger.log(
        level,
        "weight version %d synced in %.3f s (%s)",
        weight_version,
        report.total_s,
        ", ".join(f"{k} {v:.3f}" for k, v in report.seconds.items()),
    )
    return report


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


def resume_engines(engines: Sequence[Engine], group: Any, timeout_s: float) -> None:
    """Rank 0 of `group`: resume every engine, best effort (after a failed sync that left them
    paused and will not be followed by another); other ranks do nothing."""
    if dist.get_rank(group) == 0:
        control = _Control(engines, timeout_s)
        control._best_effort("resume", control.resume, "engines may still be paused")


class CheckedSteps:
    """`step(phase, fn)`: run `fn` (None: nothing to do on this rank), then a checked barrier.

    Each step's time, barrier included, is added to `seconds[phase]`. A failure on this rank
    or any other raises WeightSyncError(phase=phase) on every rank after the barrier.
    """

    def __init__(self, group: Any, barrier_timeout_s: float, seconds: dict[str, float], what: str):
        self.group = group
        self.barrier_timeout_s = barrier_timeout_s
        self.seconds = seconds
        self.what = what  # names the sync in log lines

    def __call__(self, phase: str, fn: Callable[[], Any] | None, detail: str = "") -> None:
        where = f"{phase} ({detail})" if detail else phase
        began = time.monotonic()
        error: BaseException | None = None
        if fn is not None:
            try:
                fn()
            except Exception as exc:
                error = exc
                logger.error("%s: step %r failed: %s", self.what, where, exc)
        try:
            checked_barrier(self.group, where, error is not None, self.barrier_timeout_s)
        except WeightSyncError as barrier_error:
            error = error or barrier_error
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.monotonic() - began
        if isinstance(error, WeightSyncError):
            error.phase = phase
            raise error
        if error is not None:
            rank = dist.get_rank(self.group)
            raise WeightSyncError(
                f"weight sync phase {where!r} failed on trainer rank {rank}: "
                f"{type(error).__name__}: {error}",
                phase=phase,
            ) from error


class _Control:
    """Rank 0's engine calls, each on every engine in parallel; with no engines, all no-ops."""

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
