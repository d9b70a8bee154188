"""Where the bytes of a sync may go, decided from device ids before any byte moves.

Every trainer rank and every engine worker has a device id (`vime.weight_sync.devices`): a GPU's
UUID, a CPU stand-in ("cpu:<n>"), or the shared host ("cpu"). Pure functions over those:

- `check_broadcast_placement`: an NCCL broadcast group (a stage's sender + every engine worker)
  has at most one member per distinct device: NCCL cannot run two ranks of one group on one GPU.
- `plan_spreads` (collective): both checks over every trainer rank, and for a colocated transport
  whose engine workers sit on other devices than a stage's sender, the stage's `Spread` groups.
- `plan_holders`: the colocated shape, one *holder* rank per engine device, the rank whose
  buffers the engine workers on that device open (the stage's sender where it sits there);
  refused when an engine worker's device has no trainer rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.weight_sync.devices import is_distinct
from vime.weight_sync.transports.colocated import Spread


@dataclass(frozen=True)
class RankPlace:
    """One trainer rank: its global rank, pipeline stage, whether it sends its stage, device."""

    rank: int
    pp_rank: int
    is_sender: bool
    device: str


def _where(engine: int, worker: int) -> str:
    return f"engine {engine} worker {worker}"


def check_broadcast_placement(
    senders: Sequence[RankPlace], worker_devices: Sequence[Sequence[str]]
) -> None:
    """ValueError naming the members when two members of one stage's group share a device."""
    for sender in senders:
        members = [
            (f"trainer rank {sender.rank} (pp stage {sender.pp_rank} sender)", sender.device)
        ]
        members += [
            (_where(e, w), device)
            for e, devices in enumerate(worker_devices)
            for w, device in enumerate(devices)
        ]
        seen: dict[str, str] = {}
        for who, device in members:
            if not is_distinct(device):
                continue
            if device in seen:
                raise ValueError(
                    f"{seen[device]} and {who} are both on device {device}, in the broadcast "
                    f"group of pp stage {sender.pp_rank}: one group cannot hold two ranks on one "
                    "device (NCCL refuses it). Give the engines devices the trainer's senders do "
                    "not use (engine.device_ids), or use weight_sync.transport ipc for engines "
                    "that share the trainer's GPUs"
                )
            seen[device] = who


def plan_holders(
    ranks: Sequence[RankPlace], worker_devices: Sequence[Sequence[str]]
) -> dict[int, dict[str, int]]:
    """{pp stage: {engine device: the rank whose buffers its workers open}}; ValueError when an
    engine worker's device has no trainer rank."""
    on_device: dict[str, list[RankPlace]] = {}
    for place in sorted(ranks, key=lambda p: p.rank):
        on_device.setdefault(place.device, []).append(place)
    needed: list[str] = []
    for e, devices in enumerate(worker_devices):
        for w, device in enumerate(devices):
            if device not in on_device:
                raise ValueError(
                    f"{_where(e, w)} is on device {device}, where no trainer rank runs (trainer "
                    f"devices: {sorted(on_device)}): a colocated transport (shm, ipc) hands each "
                    "engine worker a buffer of a trainer rank on its own device. Place the "
                    "engines on the trainer's devices, or use weight_sync.transport nccl (gloo)"
                )
            if device not in needed:
                needed.append(device)
    holders: dict[int, dict[str, int]] = {}
    for sender in (p for p in ranks if p.is_sender):
        holders[sender.pp_rank] = {
            device: sender.rank if sender.device == device else on_device[device][0].rank
            for device in needed
        }
    return holders


def plan_spreads(
    mine: RankPlace,
    worker_devices: Sequence[Sequence[str]],
    *,
    kind: str,
    sync_shape: str,
    device: torch.device,
    group: Any,
    timeout_s: float,
    groups: dict[tuple[int, ...], tuple[Any, Any]],
) -> dict[int, Spread]:
    """{pp stage: this rank's part in the stage's spread} for a colocated transport; {} for a
    broadcast one (after its placement check). Collective over every rank of `group` and of
    the default group (new groups, created once per member set and kept in `groups`); the same
    answer on every rank, or the same ValueError."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    senders = sorted((p for p in everyone if p.is_sender), key=lambda p: p.pp_rank)
    if sync_shape == "broadcast":
        if kind == "nccl":  # gloo's pairs are TCP sockets: any number per device
            check_broadcast_placement(senders, worker_devices)
        return {}
    holders = plan_holders(everyone, worker_devices)
    spreads = {}
    for sender in senders:
        members = tuple(sorted({sender.rank, *holders[sender.pp_rank].values()}))
        if members == (sender.rank,):
            continue  # every engine worker sits on the sender's device
        if members not in groups:  # every rank creates every group, in the same order
            timeout = timedelta(seconds=timeout_s)
            control = dist.new_group(list(members), backend="gloo", timeout=timeout)
            data = control
            if device.type == "cuda":
                data = dist.new_group(list(members), backend="nccl", timeout=timeout)
            groups[members] = (data, control)
        data, control = groups[members]
        if mine.rank in members:
            spreads[sender.pp_rank] = Spread(
                data=data,
                control=control,
                sender=sender.rank,
                rank=mine.rank,
                holds=mine.rank in holders[sender.pp_rank].values(),
                timeout_s=timeout_s,
            )
    return spreads
