"""The weight updater: checks the engines, plans buckets, runs the session, verifies.

Every trainer rank builds the same updater and calls `connect()` once, then `update_weights()`
after each optimizer step. Each pipeline stage's *pp sender* (its tp=cp=dp rank 0, see
`Topology.is_pp_sender`) gathers the stage's full HF tensors and moves them with a transport of
its own, built from `weight_sync.transport` (`vime.weight_sync.transports`), in one of two shapes:
broadcast (gloo, nccl: one group per stage, named `vime-pp_K`, of world size 1 + all engines'
workers; engine e's workers at rank offset 1 + the workers of engines before it) or colocated
(shm, ipc: engine workers open buffers of the trainer rank on their own device; where engine
workers sit on several devices, a holder rank per device gets each bucket from the sender first).
Stages take turns inside the session (`session.run_sync_session`).

    updater = WeightUpdater(config=sync_config, engines=engines, model=model,
                            converter=converter, topology=topology,
                            gather_groups=GatherGroups.from_parallel_state(),
                            sync_group=gloo_group)
    updater.connect()                 # checks names/dtypes/shapes, then joins the engines
    report = updater.update_weights() # after each optimizer step, on every rank
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.config import WeightSyncConfig
from vime.megatron.converters import DecoderConverter
from vime.megatron.gather import GatherGroups, GatherPlan, HFWeightMeta
from vime.megatron.topology import Topology
from vime.utils.timing import PhaseTimer
from vime.weight_sync.buckets import Bucket, plan_buckets
from vime.weight_sync.checks import Served, check_engines, verify_engines, wire_dtypes
from vime.weight_sync.delta import DeltaEncoder, DeltaStats
from vime.weight_sync.devices import device_id, plugin_device
from vime.weight_sync.placement import RankPlace, plan_spreads
from vime.weight_sync.session import (
    CheckedSteps,
    SyncReport,
    WeightSyncError,
    resume_engines,
    run_sync_session,
)
from vime.weight_sync.shards import WorkerLayout
from vime.weight_sync.stage_send import StageSend
from vime.weight_sync.transports import SenderPlace, Spread, Transport, make_transport
from vime.weight_sync.transports.colocated import ColocatedTransport

logger = logging.getLogger(__name__)


class WeightUpdater:
    """Pushes a Megatron model's weights into vLLM engines over `config.transport`."""

    def __init__(
        self,
        *,
        config: WeightSyncConfig,
        engines: Sequence[Any],
        model: torch.nn.Module | Sequence[torch.nn.Module],
        converter: DecoderConverter,
        topology: Topology,
        gather_groups: GatherGroups,
        sync_group: Any,
        weight_version: int = 0,
    ):
        """`engines`: objects with VLLMEngine's control methods, the same engines on every rank.

        `model`: this rank's model chunk, or its list of chunks (virtual pipeline stages), wrapped
        (DDP, Float16Module) or not; local-spec or Transformer Engine layer names.
        `sync_group`: a gloo process group over all trainer ranks (its rank 0 drives the engines).
        `weight_version`: the version the engines serve now; each sync adds one.
        """
        if not engines:
            raise ValueError("no engines to update")
        self.config = config
        self.engines = list(engines)
        self.model = model
        self.converter = converter
        self.topology = topology
        self.gather_groups = gather_groups
        self.sync_group = sync_group
        self.weight_version = weight_version
        # What this rank gathers and sends; a model vime cannot map is reported by connect() on
        # every rank at once (a rank raising alone would leave the others waiting).
        self.plan: GatherPlan | None = None
        self._plan_error: str | None = None
        try:
            self.plan = GatherPlan(model, converter=converter, topology=topology)
        except ValueError as exc:
            self._plan_error = f"trainer rank {dist.get_rank()}: {exc}"
        # Every stage's HF tensors in sending order (stage 0 first), shared by connect().
        self.metadata: list[HFWeightMeta] = []
        # weight_sync.transport.delta: what this sender last sent, and whether every engine
        # holds exactly that (the same on every rank; false after a reconnect or a failure).
        self.delta = DeltaEncoder()
        self._delta_valid = False
        self.delta_stats: DeltaStats | None = None
        self.transport: Transport | None = None
        # Colocated, engine workers on several devices: per pp stage this rank holds buckets for
        # (and does not send), its receiving transport.
        self.holding: dict[int, ColocatedTransport] = {}
        self._spread_groups: dict[tuple[int, ...], tuple[Any, Any]] = {}  # members -> groups
        # A failed sync leaves groups out of step: every rank reconnects before the next one.
        self._needs_connect = False
        # Per engine, per worker: HF name -> the dtype it serves (may be wider than sent) and the
        # slice of the whole tensor it holds (tensor parallelism); read by check_engines.
        self.engine_layouts: list[list[WorkerLayout]] = []
        self.engine_devices: list[list[str]] = []  # per engine, per worker: its device id
        self.casts: dict[str, torch.dtype] = {}  # HF name -> the narrower dtype it is sent in
        self.buckets: list[Bucket] = []
        self._timeout = timedelta(seconds=config.transfer_timeout_s)
        self._send_timer = PhaseTimer()

    @property
    def engine_world_sizes(self) -> list[int]:
        """Each engine's workers, as check_engines found them (the broadcast groups' layout)."""
        return [len(workers) for workers in self.engine_layouts]

    @property
    def is_sender(self) -> bool:
        return self.topology.is_pp_sender

    @property
    def stage_metadata(self) -> list[HFWeightMeta]:
        """The HF tensors this rank's pipeline stage sends, in sending order."""
        return [m for m in self.metadata if m.pp_stage == self.topology.pp_rank]

    @property
    def sync_shape(self) -> str:
        """ "broadcast" (gloo, nccl) or "colocated" (shm, ipc)."""
        return self.config.transport.sync_shape

    @property
    def device(self) -> torch.device:
        """Where this rank's buffers live (`devices.plugin_device`)."""
        return plugin_device(self.config.transport.plugin)

    @property
    def device_id(self) -> str:
        return device_id(self.device)

    def make_transport(self, stage: int, spread: Spread | None = None) -> Transport:
        """This rank's transport for pipeline stage `stage` (not yet connected)."""
        place = SenderPlace(
            pp_rank=stage,
            engine_world_sizes=self.engine_world_sizes,
            timeout_s=self.config.transfer_timeout_s,
            device=self.device,
            device_id=self.device_id,
            spread=spread,
        )
        return make_transport(self.config.transport, place, shadow=self.config.shadow)

    # ---- setup ------------------------------------------------------------------------------

    def share_metadata(self) -> None:
        """Every rank gets every stage's HF tensors (each pp sender lists its own, from the
        model); raises ValueError on every rank, naming every unmapped tensor of every rank,
        when some rank's model cannot be mapped. Collective over the sync group."""
        mine = None
        if self.plan is not None and self.is_sender:
            mine = self.plan.stage_metadata()
        everyone: list[Any] = [None] * dist.get_world_size(self.sync_group)
        shared = (self._plan_error, self.topology.pp_rank, mine)
        dist.all_gather_object(everyone, shared, group=self.sync_group)
        errors = sorted({error for error, _, _ in everyone if error is not None})
        if errors:
            raise ValueError("; ".join(errors))
        stages = sorted((pp_rank, meta) for _, pp_rank, meta in everyone if meta is not None)
        self.metadata = [m for _, stage in stages for m in stage]
        counts = collections.Counter(m.name for m in self.metadata)
        twice = sorted(name for name, count in counts.items() if count > 1)
        if twice:
            raise ValueError(f"HF tensors sent by more than one pipeline stage: {twice[:10]}")

    def reset_delta(self) -> None:
        """With transport.delta: make the next sync full (the engines' weights are unknown, or
        a full one is wanted, e.g. to measure it)."""
        self.delta.reset()
        self._delta_valid = False

    def connect(self, keep_delta: bool = False) -> None:
        """Share the stages' tensor lists, check the engines, plan this stage's buckets and join
        the engines, stage by stage. `keep_delta`: every engine holds what this updater last
        sent (the next sync may be a delta); else the next sync is full."""
        if not keep_delta:
            self.reset_delta()  # new or restarted engines hold no baseline
        self.share_metadata()
        facts = check_engines(  # names, dtypes, shapes, backends and devices; nothing moves
            self.engines,
            self.metadata,
            kind=self.config.transport.kind,
            plugin=self.config.transport.plugin,
            group=self.sync_group,
            timeout_s=self.config.transfer_timeout_s,
        )
        self.engine_layouts, self.engine_devices = facts.layouts, facts.devices
        self.casts = wire_dtypes(self.metadata, self.engine_layouts)  # e.g. fp32 -> bf16
        here = RankPlace(dist.get_rank(), self.topology.pp_rank, self.is_sender, self.device_id)
        spreads = plan_spreads(  # where the bytes may go; colocated: the holders' groups
            here,
            self.engine_devices,
            kind=self.config.transport.kind,
            sync_shape=self.sync_shape,
            device=self.device,
            group=self.sync_group,
            timeout_s=self.config.transfer_timeout_s,
            groups=self._spread_groups,
        )

        def join() -> None:
            if not self.is_sender:
                return
            self.transport = self.make_transport(
                self.topology.pp_rank, spreads.get(self.topology.pp_rank)
            )
            self.buckets = plan_buckets(
                [(m.name, self.casts.get(m.name, m.dtype), m.shape) for m in self.stage_metadata],
                self.config.update_weight_buffer_size,
                alignment=self.transport.alignment,
            )
            self.transport.connect([e.init_weight_transfer_engine for e in self.engines])

        step = CheckedSteps(self.sync_group, self.config.barrier_timeout_s, {}, "weight sync")
        for stage in range(self.topology.pp_size):  # stages take turns, as in a sync
            step("connect", join if stage == self.topology.pp_rank else None, f"pp stage {stage}")
        for stage, spread in spreads.items():
            if spread.holds and not spread.is_sender:
                holder = self.make_transport(stage, spread)
                assert isinstance(holder, ColocatedTransport)
                self.holding[stage] = holder
        self._needs_connect = False
        logger.log(
            logging.INFO if dist.get_rank(self.sync_group) == 0 else logging.DEBUG,
            "weight sync (%s, %s) connected to %d engines%s%s",
            self.sync_shape,
            self.config.transport.kind,
            len(self.engines),
            f"; pp stage {self.topology.pp_rank} sends {len(self.buckets)} buckets"
            if self.is_sender
            else "",
            f"; holds buckets of pp stages {sorted(self.holding)}" if self.holding else "",
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        for holder in self.holding.values():
            holder.close()
        self.holding = {}

    # ---- one sync ------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, version: int | None = None) -> SyncReport:
        """Sync the model's current weights into every engine as `version` (None: the next one);
        call on every trainer rank. `weight_version` becomes `version` once the sync succeeded;
        after a failure it is unchanged (the engines may hold a mix: sync again).

        With `transport.delta` a sync sends only what changed since the last one, except the
        first, those after a reconnect and those after a failure, which are full. A delta that
        fails is never half-applied (an engine loads a delta only at its commit, and a failed
        update gives every layer it did not load its previous tensors back): the engines stay
        paused on the previous weights while this rank reconnects and sends the same version in
        full, and resume only after that (or after it failed too)."""
        if self.is_sender and self.transport is None and not self._needs_connect:
            raise RuntimeError("call connect() before update_weights()")
        version = self.weight_version + 1 if version is None else version
        if self._needs_connect:  # the last sync failed: rebuild every group before this one
            self.close()
            self.connect()
        # Every rank takes the same mode: the encoder's validity is the same on every rank (it
        # is set only after a sync every rank saw succeed, reset by every failure or reconnect).
        mode = "dense"
        if self.config.transport.delta:
            mode = "delta" if self._delta_valid else "full"
        began = time.monotonic()
        try:
            report = self._sync(version, mode)
        except WeightSyncError as failed:
            if mode != "delta":
                raise
            report = self._repair(version, failed)  # paused through both, unless it failed
            if failed.phase != "prepare":  # before any engine call
                report.paused_s = (time.monotonic() - began) if report.paused_s else 0.0
        self.weight_version = version
        return report

    def _sync(self, version: int, mode: str) -> SyncReport:
        """One session in `mode` (see `StageSend`); a failed delta leaves the engines paused."""
        self._send_timer.reset()
        ahead = self.config.prepares_ahead(mode)
        send = StageSend(
            mode=mode,
            plan=self.plan,
            gather_groups=self.gather_groups,
            pp_rank=self.topology.pp_rank,
            transport=self.transport if self.is_sender else None,
            holding=self.holding,
            buckets=self.buckets,
            engines=self.engines,
            engine_layouts=self.engine_layouts if self.config.verify_checksums else None,
            delta=self.delta,
            casts=self.casts,
            bucket_bytes=self.config.update_weight_buffer_size,
            timeout=self._timeout,
            timer=self._send_timer,
            ahead=ahead,
        )
        verify = None
        if self.config.verify_checksums:
            verify = (
                (lambda: self._verify(send.sent, version)) if self.is_sender else (lambda: None)
            )
        try:
            report = run_sync_session(
                engines=self.engines,
                group=self.sync_group,
                weight_version=version,
                pp_size=self.topology.pp_size,
                stage_part=send.part,
                verify=verify,
                prepare=send.prepare if ahead else None,
                clear_cache=self.config.clear_cache_on_pause,
                shadow=self.config.shadow,
                call_timeout_s=self.config.transfer_timeout_s,
                barrier_timeout_s=self.config.barrier_timeout_s,
                resume_on_failure=mode != "delta",
            )
        except WeightSyncError:
            for transport in (self.transport, *self.holding.values()):
                if transport is not None:
                    transport.discard()  # engines may still hold views of what was sent
            self.reset_delta()  # the engines' weights are unknown now: the next sync is full
            self._needs_connect = True
            raise
        if mode != "dense":
            self._delta_valid = True
            report.delta = mode
            self.delta_stats = send.delta_stats
            if send.delta_stats is not None:
                report.changed_fraction = send.delta_stats.changed_fraction
                report.full_bytes = send.delta_stats.full_bytes
        report.num_buckets, report.num_bytes = send.num_buckets, send.num_bytes
        report.verified = verify is not None
        report.send_seconds = self._send_breakdown()
        return report

    def _repair(self, version: int, failed: WeightSyncError) -> SyncReport:
        """After a failed delta (engines paused on the previous weights, whole): rebuild the
        transports (a broken broadcast group is out of step; a gloo engine first waits out its
        receive timeout, `transfer_timeout_s`) and send `version` in full, which resumes them."""
        rank = dist.get_rank(self.sync_group)
        logger.log(
            logging.WARNING if rank == 0 else logging.DEBUG,
            "weight version %d: delta sync failed (%s); the engines %s the previous weights "
            "until the same version has gone in full",
            version,
            failed,
            "serve" if failed.phase == "prepare" else "stay paused on",
        )
        try:
            self.close()
            self.connect()
            report = self._sync(version, "full")
        except BaseException as exc:
            resume_engines(self.engines, self.sync_group, self.config.transfer_timeout_s)
            if isinstance(exc, Exception):
                # An engine that died fails the repair too (its check, on every rank): this is
                # the sync's failure, for the caller's fault tolerance to restart the engine.
                raise failed from exc
            raise
        report.repaired = True
        return report

    def resync(self) -> SyncReport:
        """Push the current weights again under the version the engines should hold now (an
        engine restarted, or a resumed job's fresh engines): no new version."""
        return self.update_weights(version=self.weight_version)

    def _send_breakdown(self) -> dict[str, float]:
        """This rank's send split up: gather, convert, pack, checksum, and "transfer", the rest
        of its time in the transport (moving bytes, the engines' update calls and their load)."""
        seconds = dict(self._send_timer.seconds)
        inside = seconds.pop("transport", 0.0)
        own = sum(seconds.get(k, 0.0) for k in ("gather", "convert", "pack", "checksum"))
        if inside:
            seconds["transfer"] = max(0.0, inside - own)
        return seconds

    def _verify(self, sent: dict[str, dict[Served, str]], version: int) -> None:
        verify_engines(self.engines, self.engine_layouts, sent, version, self.config)
