"""The weight-sync session: the one place that orders pause, update and resume across trainer ranks.

`run_sync_session` is the whole sync, top to bottom: every rank first does what needs no engine
(`prepare`: colocated senders gather and pack into their kept buffers), rank 0 pauses every
engine (keep) and flushes their prefix caches, starts the update, each pipeline stage sends in
its turn, rank 0 finishes the update with the new version and resumes the engines. With
`shadow` (engines that load beside the served weights, `weight_sync.shadow`) the engines keep
decoding through start, send and their load (`stage`: rank 0 waits until every engine has the
update ready); then, where every engine has vime's engine-core hook (`engine.core_commit`) and
the cache is not cleared, `finish` swaps, labels and flushes in one engine-core call between two
scheduler steps and the engines are never paused; otherwise a keep pause covers only the swap:
pause, flush, finish, verify, resume. Every trainer rank runs the same lines (ranks other than 0
with no engines to call), and every step ends in a *checked barrier* on the gloo `group`: each
rank says whether its part failed, so a failure anywhere stops every rank at the same point,
each wait bounded by a timeout. Two context managers undo what a failure leaves open:
`updating` ends an update that started, `paused` resumes the engines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.weight_sync.engine_control import (  # noqa: F401 (callers import them from here)
    Engine,
    EngineControl,
    WeightSyncError,
    call_engines,
    describe_engine,
)

logger = logging.getLogger(__name__)


@dataclass
class SyncReport:
    """What one sync did, as seen from this rank (engine phases are timed on rank 0 only)."""

    weight_version: int
    # Per step, each including its barrier: prepare (before the pause: colocated, or a delta),
    # pause, flush, start, send (all stages' turns), finish, verify (when asked), resume.
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
    # stood still for this sync (0.0 on other ranks, and where the caller keeps them paused);
    # a shadow commit between two steps: its finish step, which pauses nothing.
    paused_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


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
    prepare: Callable[[], None] | None = None,
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
    `prepare`, if given (on every rank or on none), runs on every rank before the first engine
    call: work that needs no engine, such as filling the buckets ahead, so the pause leaves it out.

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
    control = EngineControl(engines, call_timeout_s)

    def flush() -> None:
        report.prefix_cache_flushed = control.flush(clear_cache)

    def send() -> None:
        step("start", control.start)
        for stage in range(pp_size):  # stages take turns: one engine loads one at a time
            step("send", stage_part(stage), f"pp stage {stage}")

    # With shadow, rank 0 learns at the stage whether every engine can swap and label in one
    # call between two steps; then the engines are never paused (the other ranks, which call
    # no engine, run the same steps). A clear_cache switch keeps the keep pause: its reset
    # cannot wait for requests in flight to let go of their blocks.
    between_steps = False

    def stage() -> None:
        nonlocal between_steps
        control.wait_staged()
        between_steps = not clear_cache and bool(engines) and control.can_commit()

    def finish() -> None:
        if between_steps:  # the swap, its label and the flush: one engine-core call
            report.prefix_cache_flushed = control.commit_between_steps(str(weight_version))
        else:
            control.finish(str(weight_version))

    if prepare is not None:
        step("prepare", prepare)
    paused_at = time.monotonic()
    with control.paused(resume_on_failure):
        with control.updating(weight_version, shadow):
            if shadow:  # the engines decode on while they receive and load
                send()
                step("stage", stage)
                paused_at = time.monotonic()
            step("pause", None if between_steps else lambda: control.pause(clear_cache))
            step("flush", None if between_steps else flush)
            if not shadow:
                send()
            step("finish", finish)
        if verify is not None:
            step("verify", verify)
        step("resume", None if between_steps else control.resume)
    if engines:
        report.paused_s = (
            report.seconds["finish"] if between_steps else time.monotonic() - paused_at
        )

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


def resume_engines(engines: Sequence[Engine], group: Any, timeout_s: float) -> None:
    """Rank 0 of `group`: resume every engine, best effort (after a failed sync that left them
    paused and will not be followed by another); other ranks do nothing."""
    if dist.get_rank(group) == 0:
        control = EngineControl(engines, timeout_s)
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
