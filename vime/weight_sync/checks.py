"""What the updater checks against the engines: before any byte moves, and after a sync.

- `check_engines`: every worker of every engine serves the trainer's HF names, dtypes and shapes
  (a tensor may be sent narrower when the cast is exact, or cast to a narrower float the engine
  serves), runs the backend of the transport's
  shape, and sits on a device the transport's plug-in can reach (a GPU for nccl and ipc); every
  rank raises the same ValueError otherwise. Each worker's device id comes back for placement.
- `verify_engines`: every worker's digest (XXH3-128) of its part of each tensor equals the
  trainer's digest of the same slice (weight_sync.verify_checksums).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vime.config.weight_sync import WeightSyncConfig
from vime.megatron.gather import HFWeightMeta
from vime.utils.collectives import broadcast_object
from vime.weight_sync.buckets import (
    ROUNDING_CASTS,
    check_against_engine,
    dtype_from_name,
    dtype_name,
    tensor_digest,
)
from vime.weight_sync.names import ENGINE_BACKENDS
from vime.weight_sync.session import WeightSyncError, call_engines
from vime.weight_sync.shards import Shard, WorkerLayout, worker_layout

logger = logging.getLogger(__name__)

# What one engine worker serves of a tensor: its dtype name and its slice (None: all of it).
Served = tuple[str, Shard | None]


def digest(tensor: torch.Tensor, dtype: str, shard: Shard | None) -> str:
    """The digest a worker serving `shard` of `tensor` in `dtype` must report."""
    part = tensor if shard is None else shard.take(tensor)
    return tensor_digest(part.to(dtype_from_name(dtype)))


@dataclass(frozen=True)
class EngineFacts:
    """What `check_engines` found, per engine, per worker."""

    layouts: list[list[WorkerLayout]]  # HF name -> served dtype and slice
    devices: list[list[str]]  # device ids (`vime.weight_sync.devices.device_id`)


def check_engines(
    engines: Sequence[Any],
    metadata: list[HFWeightMeta],
    *,
    kind: str,
    plugin: str,
    group: Any,
    timeout_s: float,
) -> EngineFacts:
    """Compare the trainer's HF names, dtypes and shapes with every engine's; no bytes move.

    Rank 0 first reads how each engine was started (GET /server_info: its weight-transfer
    backend must receive transport `kind`, its workers tp x pp x dp), then asks every worker of
    every engine (vime_weight_metadata, vime_device_id over collective_rpc) and tells every rank
    the verdict, so all ranks raise the same ValueError naming the worker and the mismatched
    tensors. A tensor may be sent narrower than the engine serves it when the cast is exact
    (vLLM's CPU build keeps some tensors of bfloat16 models in float32). `plugin` (nccl, ipc:
    GPU) must reach every worker's device. Each worker's served dtypes and slices (tensor
    parallelism) and device come back, for placement and `verify_engines`.
    """
    problem: str | None = None
    facts: list[Any] = []
    if dist.get_rank(group) == 0:
        specs = [(m.name, m.dtype, m.shape) for m in metadata]
        backend = ENGINE_BACKENDS[kind]

        def check(engine: Any) -> tuple[list[WorkerLayout], list[str]]:
            # What the engine was started with, before any group is built or byte sent.
            layout = engine.transfer_layout()
            if layout["backend"] != backend:
                raise ValueError(
                    f"the engine runs weight-transfer backend {layout['backend']!r}, which does "
                    f"not receive weight_sync.transport {kind!r}: start it with vime's worker "
                    f'extension and --weight-transfer-config \'{{"backend": "{backend}"}}\''
                )
            devices = [str(d) for d in engine.collective_rpc("vime_device_id")]
            if plugin in ("nccl", "ipc"):
                on_cpu = [w for w, device in enumerate(devices) if not device.startswith("cuda:")]
                if on_cpu:
                    raise ValueError(
                        f"workers {on_cpu} run on {devices[on_cpu[0]]}, but transport {kind!r} "
                        f"moves GPU buffers ({plugin}): run the engines on GPUs, or set "
                        f"weight_sync.transport.device: cpu on a machine without one"
                    )
            workers = engine.collective_rpc("vime_weight_metadata")
            if len(workers) != layout["world_size"] or len(devices) != len(workers):
                raise ValueError(
                    f"{len(workers)} workers answered, the engine's parallel config has "
                    f"{layout['world_size']}"
                )
            layouts = []
            for worker, expected in enumerate(workers):
                try:
                    check_against_engine(
                        specs, expected, allow_lossless_casts=True, allow_rounding_casts=True
                    )
                    layouts.append(worker_layout(expected))
                except ValueError as exc:
                    raise ValueError(f"worker {worker}: {exc}") from None
            # A trainer that died mid-sync may have left an update open (vLLM then refuses
            # every start); the engine is still paused, so the first sync decides what it serves.
            ended = engine.collective_rpc("vime_end_open_update")
            if any(isinstance(w, dict) and w.get("ended") is True for w in ended):
                logger.warning(
                    "engine %d: ended a weight update an earlier trainer left open",
                    list(engines).index(engine),
                )
            return layouts, devices

        try:
            facts = call_engines(engines, "check", check, timeout_s=timeout_s)
        except WeightSyncError as exc:
            problem = str(exc)
    problem, facts = broadcast_object((problem, facts), group)
    if problem is not None:
        raise ValueError(f"trainer weights do not fit the engines, nothing was sent: {problem}")
    return EngineFacts(
        layouts=[layouts for layouts, _ in facts],
        devices=[devices for _, devices in facts],
    )


def verify_engines(
    engines: Sequence[Any],
    engine_layouts: list[list[WorkerLayout]],
    sent: dict[str, dict[Served, str]],
    version: int,
    config: WeightSyncConfig,
) -> None:
    """Every engine worker's digest of its part of each tensor this sender sent must equal
    the trainer's digest of the same slice (the engines' digests from `config.verify_source`,
    each engine's answer within `config.transfer_timeout_s`)."""

    def compare(engine: Any) -> None:
        layouts = engine_layouts[list(engines).index(engine)]
        for worker, served in enumerate(
            engine.collective_rpc("vime_weight_checksums", kwargs={"source": config.verify_source})
        ):
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

    call_engines(engines, "verify", compare, timeout_s=config.transfer_timeout_s)
    logger.debug("verified %d tensors on %d engines", len(sent), len(engines))


def wire_dtypes(
    metadata: list[HFWeightMeta], layouts: list[list[WorkerLayout]]
) -> dict[str, torch.dtype]:
    """{HF name: the dtype to send it in} for the tensors an engine serves in a narrower float
    than the trainer holds (an fp32 trainer, a bf16 engine): the sender rounds them first, so the
    bytes sent, served and digested are the cast ones."""
    casts = {}
    for meta in metadata:
        served = {layout[meta.name][0] for workers in layouts for layout in workers}
        narrower = sorted(served & ROUNDING_CASTS.get(dtype_name(meta.dtype), frozenset()))
        if narrower:
            casts[meta.name] = dtype_from_name(narrower[0])
    return casts
