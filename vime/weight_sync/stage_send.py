"""One sync's sending on one trainer rank: what it does in each pipeline stage's turn.

In its own stage's turn a rank takes part in the stage's gather; the stage's sender then hands
the buckets to its transport, in one of three modes: "dense" (no delta), "full" (a full sync the
delta encoder remembers) or "delta" (only what changed, then a commit). A holder rank of a
colocated transport receives the stage's buckets for its device after its own gathers. With
verification the sender digests each distinct slice an engine worker serves of what it sent, on
a thread of its own while the buckets travel (the hash and torch's copies release the GIL), and
waits for those digests before its stage's turn ends.

With `ahead` (weight_sync.pack_before_pause) every rank gathers, and each sender encodes (a
delta) and packs its stage's buckets, in `prepare`, before the engines pause. A colocated
transport packs into its kept buffers and the stage's turn only posts them, so the pause holds
the engines' load and not the trainer's packing; a broadcast transport (one buffer in flight)
takes only a delta ahead, whose encode is the cost, and packs its few bytes in the stage's turn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch

from vime.megatron.gather import GatherGroups, GatherPlan
from vime.utils.timing import PhaseTimer
from vime.weight_sync.buckets import Bucket, pack, take_bucket_tensors
from vime.weight_sync.checks import Served, digest
from vime.weight_sync.delta import DeltaEncoder, DeltaStats
from vime.weight_sync.shards import WorkerLayout
from vime.weight_sync.transports import Transport
from vime.weight_sync.transports.base import FillBucket, filled_ahead
from vime.weight_sync.transports.colocated import ColocatedTransport


class StageSend:
    """This rank's sending in one sync; `part(stage)` is its step in stage `stage`'s turn."""

    def __init__(
        self,
        *,
        mode: str,
        plan: GatherPlan | None,
        gather_groups: GatherGroups,
        pp_rank: int,
        transport: Transport | None,
        holding: dict[int, ColocatedTransport],
        buckets: Sequence[Bucket],
        engines: Sequence[Any],
        engine_layouts: list[list[WorkerLayout]] | None,
        delta: DeltaEncoder,
        casts: dict[str, torch.dtype],
        bucket_bytes: int,
        timeout: timedelta,
        timer: PhaseTimer,
        ahead: bool = False,
    ):
        """`transport`: this rank's, if it sends its stage (None otherwise). `engine_layouts`:
        each engine worker's served dtypes and slices, to digest what is sent (None: no
        verification). `ahead`: gather and pack in `prepare` (the same on every rank; the
        senders' transports must have `fills_ahead`, except for a delta)."""
        if ahead and transport is not None and not transport.fills_ahead and mode != "delta":
            raise ValueError(f"{type(transport).__name__} cannot fill its buckets ahead")
        self.ahead = ahead
        # What `prepare` made ready for the stage's turn: the buckets, and how to fill them.
        self._prepared: tuple[Sequence[Bucket], FillBucket] | None = None
        self.mode = mode
        self.plan = plan
        self.gather_groups = gather_groups
        self.pp_rank = pp_rank
        self.transport = transport
        self.holding = holding
        self.buckets = buckets
        self.engines = engines
        self.engine_layouts = engine_layouts
        self.delta = delta
        self.casts = casts  # HF name -> the narrower float it is sent in (rounded to nearest)
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.timer = timer
        self.sent: dict[str, dict[Served, str]] = {}  # name -> {(served dtype, slice): digest}
        self._digests: list[tuple[str, Future[dict[Served, str]]]] = []
        self.num_buckets = 0
        self.num_bytes = 0
        self.delta_stats: DeltaStats | None = None

    def part(self, stage: int) -> Callable[[], None] | None:
        """What this rank does in pipeline stage `stage`'s turn: its own stage's gather and send
        (with `ahead`: the sender's post of what `prepare` filled), then, if it holds that stage's
        buckets for its device, the holding (None: nothing)."""
        parts: list[Callable[[], None]] = []
        if stage == self.pp_rank and not self.ahead:
            parts.append(self.send_own_stage)
        if stage == self.pp_rank and self.ahead and self.transport is not None:
            parts.append(self._post_prepared)
        if stage in self.holding:
            parts.append(self.holding[stage].hold)
        if not parts:
            return None

        def run() -> None:
            for part in parts:  # a holder of its own stage gathers first (the sender waits)
                part()

        return run

    def prepare(self) -> None:
        """With `ahead`, on every rank before the engines pause: this stage's gather and, on
        its sender, every bucket filled (encoded first for a delta) and digested."""
        assert self.ahead, "prepare() is for a StageSend made with ahead=True"
        self.send_own_stage()

    def _post_prepared(self) -> None:
        assert self.transport is not None and self._prepared is not None
        buckets, fill = self._prepared
        calls = [e.update_weights for e in self.engines]
        with self.timer.phase("transport"):
            self.transport.send_buckets(buckets, fill, calls)

    def send_own_stage(self) -> None:
        """Gather (every rank of the stage), then on the sender the buckets in `mode` (with
        `ahead`: filled, for `_post_prepared` to post in the stage's turn)."""
        assert self.plan is not None
        gathered = self._cast(
            self.plan.gather(self.gather_groups, timeout=self.timeout, timer=self.timer)
        )
        if self.transport is None:
            for _ in gathered:  # takes part in the stage's gathers; yields nothing here
                pass
            return
        # Only with verification: a sync without it starts no thread.
        hasher = None
        if self.engine_layouts is not None:
            hasher = ThreadPoolExecutor(1, thread_name_prefix="vime-digest")
        try:
            self._send(gathered, hasher)
            with self.timer.phase("checksum"):  # what the transfer did not hide
                for name, future in self._digests:
                    self.sent[name] = future.result()
        finally:
            # No digest outlives its send: a failed one still waits for the thread to end.
            if hasher is not None:
                hasher.shutdown(wait=True, cancel_futures=True)
            self._digests = []

    def _send(
        self, gathered: Iterator[tuple[str, torch.Tensor]], hasher: ThreadPoolExecutor | None
    ) -> None:
        transport = self.transport
        assert transport is not None
        calls = [e.update_weights for e in self.engines]
        if self.mode == "delta":
            tensors = dict(gathered)
            self._record(tensors, hasher)
            with self.timer.phase("delta"):
                buckets, entries, self.delta_stats = self.delta.buckets(
                    tensors, self.bucket_bytes, transport.alignment
                )
            self._deliver(buckets, self._filler(entries), calls)
            return

        def fill(bucket: Bucket, buffer: torch.Tensor) -> None:
            tensors = dict(take_bucket_tensors(gathered, bucket))
            self._record(tensors, hasher)
            if self.mode == "full":
                for name, tensor in tensors.items():
                    self.delta.remember(name, tensor)
            self._filler(tensors)(bucket, buffer)

        buckets = list(self.buckets)
        if self.mode != "dense":
            buckets = [replace(b, mode=self.mode) for b in buckets]
        self._deliver(buckets, fill, calls)
        leftover = [name for name, _ in gathered]
        assert not leftover, f"gathered tensors missing from the bucket plan: {leftover}"

    def _deliver(self, buckets: Sequence[Bucket], fill: FillBucket, calls: list[Any]) -> None:
        """Send the buckets now; with `ahead`, fill them for the stage's turn to post (or,
        where the transport cannot fill ahead, leave their packing to that turn)."""
        assert self.transport is not None
        if not self.ahead:
            with self.timer.phase("transport"):
                self.transport.send_buckets(buckets, fill, calls)
        elif self.transport.fills_ahead:
            with self.timer.phase("transport"):
                self.transport.prefill(buckets, fill)
            self._prepared = (buckets, filled_ahead)
        else:
            self._prepared = (buckets, fill)

    def _cast(
        self, gathered: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in gathered:
            dtype = self.casts.get(name)
            yield name, tensor if dtype is None else tensor.to(dtype)

    def _record(self, tensors: dict[str, torch.Tensor], hasher: ThreadPoolExecutor | None) -> None:
        """With verification (`hasher` then exists): each distinct (dtype, slice) some engine
        worker serves of each tensor, digested once, on `hasher`'s thread (nothing writes the
        gathered tensors)."""
        if hasher is None or self.engine_layouts is None:
            return
        for name, tensor in tensors.items():
            targets = {layout[name] for workers in self.engine_layouts for layout in workers}

            def digests(tensor: torch.Tensor = tensor, targets: set = targets) -> dict:
                return {target: digest(tensor, *target) for target in targets}

            self._digests.append((name, hasher.submit(digests)))

    def _filler(self, tensors: dict[str, torch.Tensor]) -> Callable[[Bucket, torch.Tensor], None]:
        def fill(bucket: Bucket, buffer: torch.Tensor) -> None:
            with self.timer.phase("pack"):
                pack(tensors, bucket, buffer)
            self.num_buckets += 1
            self.num_bytes += bucket.nbytes

        return fill
