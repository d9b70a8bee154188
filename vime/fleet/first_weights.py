"""Rank 0 of a fleet change: a joiner's first weights, copied from a serving engine
(`fleet.first_weights: engine`, `vime.weight_sync.peer_copy`), so the step's sync stays a delta
for every engine instead of a full one.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from vime.cluster.addresses import node_address
from vime.config import TrainConfig
from vime.weight_sync.peer_copy import copy_from_peer

logger = logging.getLogger(__name__)


def copies_from_peer(config: TrainConfig) -> bool:
    """Whether joiners may get their first weights from a live engine (only delta syncs keep
    what it sends)."""
    delta = bool(getattr(config.weight_sync.transport, "delta", False))
    return config.fleet.first_weights != "trainer" and delta


def delta_is_cheaper(sync_s: dict[str, list[float]]) -> bool:
    """fleet.first_weights=auto: whether this job's delta syncs paused the engines for less time
    than its full syncs (medians; True while either is unmeasured). A peer copy keeps the join
    step's sync a delta; the trainer's way makes it full."""
    full, delta = sync_s.get("full"), sync_s.get("delta")
    if not full or not delta:
        return True
    return statistics.median(delta) < statistics.median(full)


def copy_to_joiners(
    config: TrainConfig, engines: Any, joiners: list[int], sources: list[int], version: int
) -> list[float] | None:
    """Copy to each of `joiners` the weights of one of `sources` (serving engines; one on the
    joiner's machine first) as weight `version`. Seconds per copy; None when one failed (the
    caller then makes the step's sync full for every engine)."""
    if not sources:
        logger.warning("fleet: no serving engine to copy weights to joiners %s from", joiners)
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
            report = copy_from_peer(
                engines.handles[source],
                engines.handles[joiner],
                address=address,
                version=version,
                bucket_bytes=config.weight_sync.update_weight_buffer_size,
                timeout_s=config.weight_sync.transfer_timeout_s,
            )
        except Exception as exc:  # noqa: BLE001 (any failure: a full sync brings them up instead)
            logger.error(
                "fleet: copying engine %d from engine %d failed (%s); this step's sync "
                "is full for every engine",
                joiner,
                source,
                exc,
            )
            return None
        seconds.append(report.seconds)
        logger.info(
            "fleet: engine %d copied from engine %d as version %d: %.1f MB in %.2f s (the "
            "source sent for %.2f s), checksums equal",
            joiner,
            source,
            version,
            report.bytes / 1e6,
            report.seconds,
            report.send_s,
        )
    return seconds
