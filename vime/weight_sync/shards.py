"""Which slice of a whole HF tensor an engine worker holds: what both halves of the checks share.

An engine worker with tensor parallelism serves part of some tensors (`engine.readback` finds
which). It reports each part as a `Shard` of the whole tensor; the trainer, which sends whole
tensors, takes the same slice of what it sent to compare digests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shard:
    """The slice [start, stop) along `dim` of a whole HF tensor that one worker holds."""

    dim: int
    start: int
    stop: int

    def to_list(self) -> list[int]:
        return [self.dim, self.start, self.stop]

    @classmethod
    def from_list(cls, value: Iterable[int] | None) -> Shard | None:
        return None if value is None else cls(*map(int, value))

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This slice of the whole tensor."""
        return tensor.narrow(self.dim, self.start, self.stop - self.start)

    def __str__(self) -> str:
        return f"dim {self.dim} [{self.start}:{self.stop}]"


# What one worker serves of each HF tensor: name -> (dtype name, its slice or None for all of it).
WorkerLayout = dict[str, tuple[str, Shard | None]]


def worker_layout(metadata: Iterable[Mapping[str, Any]]) -> WorkerLayout:
    """A worker's `vime_weight_metadata` answer as a layout; ValueError on a slice out of range."""
    layout: WorkerLayout = {}
    for entry in metadata:
        shard = Shard.from_list(entry.get("shard"))
        if shard is not None:
            shape = list(entry["shape"])
            # start == stop: a worker holding none of it (vocab rows that are all padding).
            in_range = 0 <= shard.dim < len(shape) and 0 <= shard.start <= shard.stop
            if not (in_range and shard.stop <= shape[shard.dim]):
                raise ValueError(
                    f"{entry['name']}: the worker reports slice {shard} of a tensor of shape "
                    f"{shape}"
                )
        layout[entry["name"]] = (entry["dtype"], shard)
    return layout
