"""What the fleet counts, for the job's metrics and summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class FleetStats:
    joins: int = 0
    leaves: int = 0
    handed_over: int = 0  # requests cancelled on a leaver and resubmitted elsewhere
    preempted: int = 0  # engines that got a preemption notice (SIGTERM to their keeper)
    scale_ups: int = 0  # launches fleet.scale_up asked for
    join_to_serve_s: list[float] = field(default_factory=list)  # request -> first request sent
    peer_copy_s: list[float] = field(default_factory=list)  # a joiner's copy from a live engine
    drain_s: list[float] = field(default_factory=list)  # leave request -> the engine ended

    def metrics(self, *, size: int, serving: int) -> dict[str, float]:
        """This step's row: the fleet's `size` (engines attached) and `serving` ones, and the
        counts so far."""
        return {
            "fleet/size": float(size),
            "fleet/serving": float(serving),
            "fleet/joins": float(self.joins),
            "fleet/leaves": float(self.leaves),
            "fleet/handed_over": float(self.handed_over),
            "fleet/preempted": float(self.preempted),
            "fleet/scale_ups": float(self.scale_ups),
            "fleet/peer_copied": float(len(self.peer_copy_s)),
        }

    def summary(self) -> dict[str, Any]:
        stats = asdict(self)
        for key in ("join_to_serve_s", "drain_s", "peer_copy_s"):
            stats[key] = [round(s, 2) for s in stats[key]]
        return {f"fleet_{key}": value for key, value in stats.items()}
