"""Rank 0 of a fleet change: seed the joiners from serving engines (`fleet.seed: engine`), so
the step's sync stays a delta for every engine instead of a full one (`vime.weight_sync.seed`).
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from vime.cluster.addresses import node_address
from vime.config import TrainConfig
from vime.weight_sync.seed import seed_engine

logger = logging.getLogger(__name__)


def seeds_from_engine(config: TrainConfig) -> bool:
    """Whether joiners may be seeded by a live engine (only delta syncs keep what it sends)."""
    delta = bool(getattr(config.weight_sync.transport, "delta", False))
    return config.fleet.seed != "trainer" and delta


def delta_is_cheaper(sync_s: dict[str, list[float]]) -> bool:
    """fleet.seed=auto: whether this job's delta syncs paused the engines for less time than its
    full syncs (medians; True while either is unmeasured). A seed keeps the join step's sync a
    delta; the trainer's way makes it full."""
    full, delta = sync_s.get("full"), sync_s.get("delta")
    if not full or not delta:
        return True
    return statistics.median(delta) < statistics.median(full)


def seed_joiners(
    config: TrainConfig, engines: Any, joiners: list[int], sources: list[int], version: int
) -> list[float] | None:
    """Seed each of `joiners` from one of `sources` (serving engines; one on the joiner's machine
    first) with weight `version`. Seconds per seed; None when one failed (the caller then
    makes the step's sync full for every engine)."""
    if not sources:
        logger.warning("fleet: no serving engine to seed joiners %s from", joiners)
        return None
    transport = config.weight_sync.transport
    address = getattr(transport, "master_address", None) or node_address(
        config.cluster.node_address, config.cluster.interface
    )
    machines = engines.machines()
    seconds: list[float] = []
    for joiner in joiners:
        near = [s for s in sources if machines[s] == machines[joiner]]
        source = (near or sources)[len(seconds) % len(near or sources)]
        try:
            report = seed_engine(
                engines.handles[source],
                engines.handles[joiner],
                address=address,
                version=version,
                bucket_bytes=config.weight_sync.update_weight_buffer_size,
                timeout_s=config.weight_sync.transfer_timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 (any failure: a full sync seeds them instead)
            logger.error(
                "fleet: seeding engine %d from engine %d failed (%s); this step's sync "
                "is full for every engine",
                joiner,
                source,
                exc,
            )
            return None
        seconds.append(report.seconds)
        logger.info(
            "fleet: engine %d seeded from engine %d as version %d: %.1f MB in %.2f s (the "
            "source sent for %.2f s), checksums equal",
            joiner,
            source,
            version,
            report.bytes / 1e6,
            report.seconds,
            report.send_s,
        )
    return seconds
