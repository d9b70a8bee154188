"""The device plug-in interfaces (`Communicator`, `Handles`) and device ids; see the package.

A *device id* names where a process's buffers live: "cuda:<GPU UUID>" on a GPU; on CPU "cpu"
(the host's memory, shared by every process) or "cpu:<n>" when `VIME_DEVICE_ID` (a trainer rank)
or `VIME_DEVICE_IDS` (an engine, one id per worker) stand in for GPUs, so the placement rules of a
multi-GPU job run on CPU too. This module imports no trainer code (engine workers import it).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol, Self

import torch
import torch.distributed as dist

TRAINER_DEVICE_ENV = "VIME_DEVICE_ID"
"""On CPU: the device id number a trainer rank stands on (a GPU's stand-in); unset: "cpu"."""
ENGINE_DEVICES_ENV = "VIME_DEVICE_IDS"
"""On CPU: comma-separated device id numbers of an engine's workers, by local rank."""

HOST = "cpu"  # the host's memory: every CPU process reaches it, it is not a distinct device


def device_id(device: torch.device, local_index: int = 0) -> str:
    """Where buffers on `device` live: "cuda:<UUID>", "cpu:<n>" (a CPU stand-in) or "cpu".

    `local_index`: an engine worker's local rank (picks its entry of VIME_DEVICE_IDS)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_properties(device).uuid}"
    engine_ids = os.environ.get(ENGINE_DEVICES_ENV)
    if engine_ids:
        ids = engine_ids.split(",")
        if local_index >= len(ids):
            raise ValueError(
                f"{ENGINE_DEVICES_ENV}={engine_ids!r} names {len(ids)} devices, worker "
                f"{local_index} has none: give one per worker"
            )
        return f"{HOST}:{ids[local_index].strip()}"
    own = os.environ.get(TRAINER_DEVICE_ENV)
    return f"{HOST}:{own.strip()}" if own else HOST


def is_distinct(device: str) -> bool:
    """Whether `device` is one device of several (a GPU, a CPU stand-in), not the shared host."""
    return device != HOST


class Pending(Protocol):
    """One posted broadcast."""

    def done(self) -> bool: ...
    def wait(self, timeout_s: float) -> None: ...


class Communicator(ABC):
    """One stage's broadcast group, seen from one member; rank 0 is the trainer's sender."""

    name: ClassVar[str]

    def __init__(self, device: torch.device):
        self.device = device  # where the buffers it broadcasts must live

    @classmethod
    @abstractmethod
    def join(
        cls,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        address: str | None,
        device: torch.device,
    ) -> Self:
        """Join the group whose rendezvous is `store` (already prefixed by the group's name);
        returns once every member joined, or raises after `timeout_s`."""

    @abstractmethod
    def broadcast(self, buffer: torch.Tensor) -> Pending:
        """Post rank 0's `buffer` to every member (asynchronous)."""

    @abstractmethod
    def abort(self) -> None:
        """After a failure: drop the group without waiting for any member (a broadcast that no
        peer will join must not hold the caller)."""

    def close(self) -> None:
        """Release the group after a clean run."""
        self.abort()


class Handles(ABC):
    """How a uint8 buffer one process fills is opened by another on the same device."""

    name: ClassVar[str]

    @abstractmethod
    def __init__(self, device: torch.device, *, prefix: str = "vime"):
        """Buffers on `device`; `prefix` names them where names are visible (shm segments)."""

    @abstractmethod
    def allocate(self, nbytes: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """(a writable uint8 buffer of `nbytes`, the JSON handle that names it)."""

    def release(self, handle: dict[str, Any]) -> None:  # noqa: B027 (optional)
        """Every engine that needs the buffer has opened it (its name may go now)."""

    def forget(self, handle: dict[str, Any]) -> None:  # noqa: B027 (optional)
        """The buffer is dropped: no later sync refills it."""

    @staticmethod
    @abstractmethod
    def open(handle: dict[str, Any], nbytes: int, device: torch.device) -> torch.Tensor:
        """Engine side: a read-only uint8 view of the first `nbytes` of the handle's buffer."""

    @staticmethod
    @abstractmethod
    def key(handle: dict[str, Any]) -> str:
        """What identifies the buffer, to keep it open from one sync to the next."""
