"""The weight updater: checks the engines, plans buckets, runs the session, verifies.

Every trainer rank builds the same updater and calls `connect()` once, then `update_weights()`
after each optimizer step. Each pipeline stage's *pp sender* (its tp=cp=dp rank 0, see
`Topology.is_pp_sender`) gathers the stage's full HF tensors and moves them with a transport of
its own, built from `weight_sync.transport`, which also decides the seed's shape: gloo / nccl
are UpdateWeightFromDistributed (one broadcast group per stage, named `vime-pp_K`, of world size
1 + all engines' workers; engine e's workers at rank offset 1 + the workers of engines before
it), shm / ipc are UpdateWeightFromTensor (colocated engines read the senders' buffers). Stages
take turns inside the session (`session.run_sync_session`).

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
from vime.weight_sync.buckets import (
    Bucket,
    check_against_engine,
    dtype_from_name,
    pack,
    plan_buckets,
    take_bucket_tensors,
    tensor_digest,
)
from vime.weight_sync.session import (
    CheckedSteps,
    SyncReport,
    WeightSyncError,
    call_engines,
    run_sync_session,
)
from vime.weight_sync.shards import Shard, WorkerLayout, worker_layout
from vime.weight_sync.transports import SenderPlace, Transport, make_transport
from vime.weight_sync.transports.ipc import check_ipc_placement

logger = logging.getLogger(__name__)


# What one engine worker serves of a tensor: its dtype name and its slice (None: all of it).
Served = tuple[str, Shard | None]


def _digest(tensor: torch.Tensor, dtype: str, shard: Shard | None) -> str:
    """The digest a worker serving `shard` of `tensor` in `dtype` must report."""
    part = tensor if shard is None else shard.take(tensor)
    return tensor_digest(part.to(dtype_from_name(dtype)))


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
        self.transport: Transport | None = None
        # Per engine, per worker: HF name -> the dtype it serves (may be wider than sent) and the
        # slice of the whole tensor it holds (tensor parallelism); read by check_engines.
        self.engine_layouts: list[list[WorkerLayout]] = []
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
    def shape(self) -> str:
        """The seed's name for what the transport does: UpdateWeightFrom{Distributed,Tensor}."""
        return f"UpdateWeightFrom{self.config.transport.shape.capitalize()}"

    def make_transport(self) -> Transport:
        """This sender's transport for `config.transport` (not yet connected)."""
        place = SenderPlace(
            pp_rank=self.topology.pp_rank,
            pp_size=self.topology.pp_size,
            engine_world_sizes=self.engine_world_sizes,
            bucket_bytes=self.config.update_weight_buffer_size,
            timeout_s=self.config.transfer_timeout_s,
        )
        return make_transport(self.config.transport, place)

    # ---- setup ------------------------------------------------------------------------------

    def check_engines(self) -> None:
        """Compare the trainer's HF names, dtypes and shapes with every engine's; no bytes move.

        Rank 0 first reads how each engine was started (GET /server_info: its weight-transfer
        backend must be `weight_sync.transport`, its workers tp x pp x dp), then asks every
        worker of every engine (vime_weight_metadata over collective_rpc) and tells every rank
        the verdict, so all ranks raise the same ValueError naming the worker and the mismatched
        tensors. A tensor may be sent narrower than the engine serves it when the cast is exact
        (vLLM's CPU build keeps some tensors of bfloat16 models in float32). Each worker's
        served dtypes and slices (tensor parallelism) are kept for `verify_checksums`.
        """
        problem: str | None = None
        served: list[list[WorkerLayout]] = []
        kind = self.config.transport.kind
        sender_gpus: list[str] = []
        if kind == "ipc":  # every stage sender's GPU, for the placement check
            mine = None
            if self.is_sender and torch.cuda.is_available():
                mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            everyone: list[Any] = [None] * dist.get_world_size(self.sync_group)
            dist.all_gather_object(everyone, mine, group=self.sync_group)
            sender_gpus = [gpu for gpu in everyone if gpu is not None]
        if dist.get_rank(self.sync_group) == 0:
            specs = [(m.name, m.dtype, m.shape) for m in self.metadata]

            def check(engine: Any) -> list[WorkerLayout]:
                # What the engine was started with, before any group is built or byte sent.
                layout = engine.transfer_layout()
                if layout["backend"] != kind:
                    raise ValueError(
                        f"the engine runs weight-transfer backend {layout['backend']!r} but "
                        f"weight_sync.transport is {kind!r}: start it with "
                        f'--weight-transfer-config \'{{"backend": "{kind}"}}\''
                    )
                if kind == "ipc":
                    gpus = engine.collective_rpc("vime_gpu_uuid")
                    check_ipc_placement(sender_gpus, gpus, self.engines.index(engine))
                workers = engine.collective_rpc("vime_weight_metadata")
                if len(workers) != layout["world_size"]:
                    raise ValueError(
                        f"{len(workers)} workers answered, the engine's parallel config has "
                        f"{layout['world_size']}"
                    )
                layouts = []
                for worker, expected in enumerate(workers):
                    try:
                        check_against_engine(specs, expected, allow_lossless_casts=True)
                        layouts.append(worker_layout(expected))
                    except ValueError as exc:
                        raise ValueError(f"worker {worker}: {exc}") from None
                return layouts

            try:
                served = call_engines(
                    self.engines, "check", check, timeout_s=self.config.transfer_timeout_s
                )
            except WeightSyncError as exc:
                problem = str(exc)
        verdict: list[Any] = [problem, served]
        dist.broadcast_object_list(verdict, group=self.sync_group, group_src=0)
        if verdict[0] is not None:
            raise ValueError(
                f"trainer weights do not fit the engines, nothing was sent: {verdict[0]}"
            )
        self.engine_layouts = verdict[1]

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

    def connect(self) -> None:
        """Share the stages' tensor lists, check the engines, plan this stage's buckets and join
        the engines, stage by stage."""
        self.share_metadata()
        self.check_engines()

        def join() -> None:
            if not self.is_sender:
                return
            self.transport = self.make_transport()
            self.buckets = plan_buckets(
                [(m.name, m.dtype, m.shape) for m in self.stage_metadata],
                self.config.update_weight_buffer_size,
                alignment=self.transport.alignment,
            )
            self.transport.connect([e.init_weight_transfer_engine for e in self.engines])

        step = CheckedSteps(self.sync_group, self.config.barrier_timeout_s, {}, "weight sync")
        for stage in range(self.topology.pp_size):  # stages take turns, as in a sync
            step("connect", join if stage == self.topology.pp_rank else None, f"pp stage {stage}")
        logger.log(
            logging.INFO if dist.get_rank(self.sync_group) == 0 else logging.DEBUG,
            "weight sync (%s, %s) connected to %d engines%s",
            self.shape,
            self.config.transport.kind,
            len(self.engines),
            f"; pp stage {self.topology.pp_rank} sends {len(self.buckets)} buckets"
            if self.is_sender
            else "",
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    # ---- one sync ------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, version: int | None = None) -> SyncReport:
        """Sync the model's current weights into every engine as `version` (None: the next one);
        call on every trainer rank. `weight_version` becomes `version` once the sync succeeded;
        after a failure it is unchanged (the engines may hold a mix: sync again)."""
        if self.is_sender and self.transport is None:
            raise RuntimeError("call connect() before update_weights()")
        version = self.weight_version + 1 if version is None else version
        self._send_timer.reset()
        sent: dict[str, dict[Served, str]] = {}  # name -> {(served dtype, slice): digest}
        counts = {"buckets": 0, "bytes": 0}
        verify = None
        if self.config.verify_checksums:
            verify = (lambda: self._verify(sent, version)) if self.is_sender else (lambda: None)
        try:
            report = run_sync_session(
                engines=self.engines,
                group=self.sync_group,
                weight_version=version,
                pp_rank=self.topology.pp_rank,
                pp_size=self.topology.pp_size,
                send_stage=lambda: self._send_stage(sent, counts),
                verify=verify,
                clear_cache=self.config.clear_cache_on_pause,
                call_timeout_s=self.config.transfer_timeout_s,
                barrier_timeout_s=self.config.barrier_timeout_s,
            )
        except WeightSyncError:
            if self.transport is not None:
                self.transport.discard()  # engines may still hold views of what was sent
            raise
        self.weight_version = version
        report.num_buckets, report.num_bytes = counts["buckets"], counts["bytes"]
        report.verified = verify is not None
        report.send_seconds = self._send_breakdown()
        return report

    def resync(self) -> SyncReport:
        """Push the current weights again under the version the engines should hold now (an
        engine restarted, or a resumed job's fresh engines): no new version."""
        return self.update_weights(version=self.weight_version)

    def _send_breakdown(self) -> dict[str, float]:
        """This rank's send phase split up: gather, convert, pack, checksum, transfer.

        "transfer" is the rest of the time inside the transport: moving the bytes, the engines'
        update_weights calls (their load included) and waiting for them.
        """
        seconds = dict(self._send_timer.seconds)
        inside = seconds.pop("transport", 0.0)
        own = sum(seconds.get(k, 0.0) for k in ("gather", "convert", "pack", "checksum"))
        if inside:
            seconds["transfer"] = max(0.0, inside - own)
        return seconds

    def _send_stage(self, sent: dict[str, dict[Served, str]], counts: dict[str, int]) -> None:
        assert self.plan is not None
        gathered = self.plan.gather(
            self.gather_groups, timeout=self._timeout, timer=self._send_timer
        )
        if not self.is_sender:
            for _ in gathered:  # takes part in the stage's gathers; yields nothing here
                pass
            return
        assert self.transport is not None
        record = self.config.verify_checksums
        timer = self._send_timer

        def fill(bucket: Bucket, buffer: torch.Tensor) -> None:
            tensors = dict(take_bucket_tensors(gathered, bucket))
            if record:
                with timer.phase("checksum"):
                    for name, tensor in tensors.items():
                        # Each distinct (dtype, slice) some engine worker serves, digested once.
                        targets = {
                            layout[name] for workers in self.engine_layouts for layout in workers
                        }
                        sent[name] = {target: _digest(tensor, *target) for target in targets}
            with timer.phase("pack"):
                pack(tensors, bucket, buffer)
            counts["buckets"] += 1
            counts["bytes"] += bucket.nbytes

        with timer.phase("transport"):
            self.transport.send_buckets(
                self.buckets, fill, [e.update_weights for e in self.engines]
            )
        leftover = [name for name, _ in gathered]
        assert not leftover, f"gathered tensors missing from the bucket plan: {leftover}"

    def _verify(self, sent: dict[str, dict[Served, str]], version: int) -> None:
        """Every engine worker's sha256 of its part of each tensor this sender sent must equal
        the trainer's digest of the same slice."""

        def compare(engine: Any) -> None:
            layouts = self.engine_layouts[self.engines.index(engine)]
            for worker, served in enumerate(engine.collective_rpc("vime_weight_checksums")):
                layout = layouts[worker]
                differ = sorted(
                    name if layout[name][1] is None else f"{name} ({layout[name][1]})"
                    for name, digests in sent.items()
                    if served.get(name) != digests[layout[name]]
                )
                if differ:
                    raise ValueError(
                        f"worker {worker} serves {len(differ)} tensors that differ from the "
                        f"trainer's after weight version {version}: {differ[:10]}"
                    )

        call_engines(self.engines, "verify", compare, timeout_s=self.config.transfer_timeout_s)
        logger.debug("verified %d tensors on %d engines", len(sent), len(self.engines))
