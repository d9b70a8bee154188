"""Rank 0 of an elastic fleet: preemption notices (a SIGTERM to an engine's keeper, see
vime.utils.preemption) drain the engine at once; what it still holds when PREEMPT_MARGIN_S of
its time is left is handed over (cancelled there, resubmitted elsewhere).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from vime.fleet.stats import FleetStats

logger = logging.getLogger("vime.fleet.fleet")

# A preempted engine's requests still in flight this long before its keeper ends it are handed
# over (cancelled there, resubmitted elsewhere): one probe interval and a resubmit fit in it.
PREEMPT_MARGIN_S = 10.0


class PreemptionWatch:
    """Rank 0's poller of the fleet's engines for preemption notices. It shares the fleet's
    `lock` (held while the fleet changes), `stats` and `handed` (engines whose requests were
    handed over), and drains through the fleet's `drain(index)` (False: it could not)."""

    def __init__(
        self,
        engines: Any,  # vime.plugin.RolloutEngines
        client: Any,  # vime.engines.generation.GenerationClient
        watchdog: Any,  # vime.engines.watchdog.EngineWatchdog or None
        stats: FleetStats,
        lock: threading.Lock,
        *,
        drain: Callable[[int], bool],
        draining: Callable[[int], bool],
        handed: set[int],
    ) -> None:
        self.engines, self.client, self.watchdog = engines, client, watchdog
        self.stats = stats
        self._lock = lock
        self._drain = drain
        self._draining = draining
        self._handed = handed
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(
            target=self._poll_preemption, daemon=True, name="vime-fleet-preempt"
        ).start()

    def stop(self) -> None:
        self._stop.set()

    def _poll_preemption(self) -> None:
        """Rank 0's thread: drain engines whose keeper got a SIGTERM (a preemption notice); hand
        their requests over when PREEMPT_MARGIN_S is all that is left of their time."""
        interval_s = self.engines.config.watchdog_interval_s
        noticed: set[int] = set()
        while not self._stop.wait(interval_s):
            try:
                for index in self.engines.active():
                    self._check_preemption(index, noticed)
            except Exception:  # noqa: BLE001 (the poller must outlive one bad read)
                logger.exception("fleet: preemption poll failed")

    def _check_preemption(self, index: int, noticed: set[int]) -> None:
        try:
            notice = self.engines.handles[index].preemption_notice()
        except Exception as exc:  # noqa: BLE001 (a dead engine: the watchdog's business)
            logger.debug("engine %d: no preemption notice read: %s", index, exc)
            return
        if notice is None:
            return
        with self._lock:
            if index not in noticed:
                noticed.add(index)
                self.stats.preempted += 1
                logger.warning(
                    "fleet: engine %d got a preemption notice (%.0f s left)",
                    index,
                    notice["left_s"],
                )
                if not self._drain(index):
                    # The last serving engine: it ends with its grace, a failure the watchdog
                    # reports (fault tolerance restarts it).
                    return
                if self.watchdog is not None:
                    self.watchdog.unwatch(index)  # its end is no failure
            if (
                self._draining(index)
                and index not in self._handed
                and notice["left_s"] < PREEMPT_MARGIN_S
            ):
                left = self.client.num_in_flight(index)
                self._handed.add(index)
                self.stats.handed_over += left
                self.client.mark_down(index)  # cancelled there, resubmitted elsewhere
                logger.warning("fleet: preempted engine %d: %d requests handed over", index, left)
