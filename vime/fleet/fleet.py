"""An elastic rollout fleet (`fleet:`): engines join and leave while the job runs, nothing lost
(docs/failures.md says it for users).

Requests come from `fleet.schedule`, `fleet.scale_up` and the request file (vime.job.
fleet_requests). At each step's safe point, before its sync, every rank calls `before_sync`;
rank 0 decides and broadcasts one plan, every rank applies it:

- **join**: rank 0 launches the engines in the background (Ray actors, a placement group of
  their own). Once up, they are admitted at the next safe point: every rank attaches; with
  delta syncs a serving engine copies its weights to them (fleet.first_weights,
  vime.fleet.first_weights); the weight sync reconnects (groups and rank offsets rebuilt, no
  trainer restart) and the step's sync (a delta if they got a peer copy, else full for every
  engine) brings them to the trainer's weights. They get requests after it (`after_sync`).
- **leave (drain)**: no new request at once; those in flight finish there, synced every step.
  At the first safe point where none is left (or after fleet.drain_timeout_s, when the rest are
  handed over: cancelled, resubmitted elsewhere), it leaves every later sync and ends.
- **preemption** (engine.preemption_drain_s > 0): rank 0's poller finds a keeper's notice
  (vime.utils.preemption; vime.fleet.preemption) and drains the engine at once; what it
  holds when PREEMPT_MARGIN_S of its time is left is handed over.

No sync sees a fleet change midway; indices are never reused.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from vime.config import TrainConfig
from vime.fleet.first_weights import copies_from_peer, copy_to_joiners, delta_is_cheaper
from vime.fleet.preemption import PreemptionWatch
from vime.fleet.requests import read_requests
from vime.fleet.stats import FleetStats
from vime.utils.collectives import broadcast_object

logger = logging.getLogger(__name__)


@dataclass
class _Launch:
    """Rank 0: engines being launched for a join."""

    first_index: int
    count: int
    requested_at: float
    future: Future


class Fleet:
    """Every rank: `before_sync(step)` / `after_sync()` around each step's sync."""

    def __init__(
        self,
        config: TrainConfig,
        engines: Any,  # vime.plugin.RolloutEngines
        sync: Any,  # vime.plugin.WeightSync
        run_dir: Path,
        *,
        client: Any = None,  # rank 0: the GenerationClient
        watchdog: Any = None,  # rank 0: the EngineWatchdog
        recovery: Any = None,  # rank 0 with fault tolerance: the EngineRecovery
    ) -> None:
        self.config = config
        self.engines, self.sync = engines, sync
        self.run_dir = run_dir
        self.client, self.watchdog, self.recovery = client, watchdog, recovery
        self.rank = dist.get_rank(engines.group)
        self.stats = FleetStats()
        self._requests_read = 0  # lines of the requests file already taken
        self._launches: list[_Launch] = []  # rank 0, in index order
        self._next_index = len(engines.urls)
        self._draining: dict[int, float] = {}  # rank 0: index -> leave requested (monotonic)
        self._admitted: list[tuple[int, float]] = []  # (index, requested at) to serve after sync
        self._admitting: list[_Launch] = []  # rank 0: launches admitted at this safe point
        self._executor: ThreadPoolExecutor | None = None
        # Rank 0: the preemption poller and the safe point share _draining and the stats.
        self._lock = threading.Lock()
        self._handed: set[int] = set()  # engines whose requests were handed over
        self._batch_waits: list[float] = []  # rank 0: seconds the trainer waited, per step
        self._drained_now: set[int] = set()  # rank 0: drains begun at this safe point
        self._sync_s: dict[str, list[float]] = {}  # rank 0: seconds of "full" / "delta" syncs
        self._preemption: PreemptionWatch | None = None
        if self.rank == 0 and engines.launched and engines.config.preemption_drain_s > 0:
            self._preemption = PreemptionWatch(
                engines,
                client,
                watchdog,
                self.stats,
                self._lock,
                drain=self._drain,
                draining=lambda index: index in self._draining,
                handed=self._handed,
            )
            self._preemption.start()

    # ---- every rank -------------------------------------------------------------------------

    def before_sync(self, step: int) -> None:
        """The safe point before step `step`'s sync: apply rank 0's plan (collective)."""
        plan = None
        if self.rank == 0:
            with self._lock:
                waits = self._take_requests(step)
            for launch in waits:  # outside the lock: the preemption poller goes on meanwhile
                launch.future.exception()  # until it is up or failed
            self._lock.acquire()  # held until the plan is applied: the poller sees no half fleet
        try:
            if self.rank == 0:
                plan = self._plan()
            plan = broadcast_object(plan, self.engines.group)
            if plan is not None:
                self._apply(step, plan)
        finally:
            if self.rank == 0:
                self._lock.release()

    def _apply(self, step: int, plan: dict[str, Any]) -> None:
        # Rank 0 keeps its launched engines' Ray handles (they are not broadcast).
        handles = [h for launch in self._admitting for h in launch.future.result()[0]]
        indices = self.engines.admit(plan["urls"], plan["infos"], handles)
        for index in plan["retire"]:
            self.engines.retire(index)
        copied = not indices  # leavers alone: the others still hold the last sync's tensors
        if indices and copies_from_peer(self.config):
            copied = broadcast_object(self._copy_to_joiners(indices), self.engines.group)
        # Groups and rank offsets for the new fleet; unless every engine holds the last sync's
        # tensors (a peer copy), the next sync is full.
        self.sync.reconnect(keep_delta=copied)
        if self.rank == 0:
            self._after_plan(indices, plan)
        logger.log(
            logging.INFO if self.rank == 0 else logging.DEBUG,
            "fleet before step %d: joined %s, left %s; engines %s",
            step,
            indices,
            plan["retire"],
            self.engines.active(),
        )

    def _copy_to_joiners(self, joiners: list[int]) -> bool | None:
        """Rank 0: copy serving engines' weights to the joiners (None on other ranks)."""
        if self.rank != 0:
            return None
        if self.config.fleet.first_weights == "auto" and not delta_is_cheaper(self._sync_s):
            logger.info(
                "fleet: joiners %s get a full sync (fleet.first_weights=auto: this job's full "
                "syncs were faster than its delta syncs)",
                joiners,
            )
            return False
        seconds = copy_to_joiners(
            self.config, self.engines, joiners, self.client.serving(), self.sync.weight_version
        )
        self.stats.peer_copy_s += seconds or []
        return seconds is not None

    def note_batch_wait(self, wait_s: float) -> None:
        """Rank 0: how long the trainer waited for this step's batch (fleet.scale_up)."""
        self._batch_waits.append(wait_s)

    def note_sync(self, report: Any) -> None:
        """Rank 0: a sync's mode and seconds (fleet.first_weights=auto compares full and delta
        ones)."""
        if report is not None and report.delta in ("full", "delta"):
            self._sync_s.setdefault(report.delta, []).append(report.total_s)

    def after_sync(self, report: Any = None) -> None:
        """Rank 0: engines admitted at this step's safe point now hold its weights: serve."""
        if self.rank != 0:
            return
        self.note_sync(report)
        for index, requested_at in self._admitted:
            self.client.mark_up(index)
            if self.watchdog is not None:
                self.watchdog.watch(index)
            self.stats.join_to_serve_s.append(time.monotonic() - requested_at)
            logger.info(
                "engine %d serves (%.1f s after it was asked for)",
                index,
                self.stats.join_to_serve_s[-1],
            )
        self._admitted = []

    def metrics(self) -> dict[str, float]:
        """Rank 0's figures for this step's metrics row."""
        serving = len(self.client.serving()) if self.client is not None else 0
        return self.stats.metrics(size=len(self.engines.active()), serving=serving)

    def summary(self) -> dict[str, Any]:
        return self.stats.summary()

    def close(self) -> None:
        """Rank 0: engines still launching are ended once up (the job is over)."""
        if self._preemption is not None:
            self._preemption.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for launch in self._launches:
            launch.future.add_done_callback(_shutdown_launched)

    # ---- rank 0 -----------------------------------------------------------------------------

    def _take_requests(self, step: int) -> list[_Launch]:
        """Start the launches and drains asked for by now; the launches to wait for."""
        waits = []
        self._drained_now = set()
        for join, leave, wait in self._new_requests(step):
            if join and self._launch(join) and wait:
                waits.append(self._launches[-1])
            for index in leave:
                if self._drain(index):
                    self._drained_now.add(index)
        waits += self._scale_up()
        return waits

    def _plan(self) -> dict[str, Any] | None:
        """What changes at this safe point (None: nothing). Nothing while an engine is being
        restarted (fault tolerance): the reconnect needs every engine up."""
        if self.recovery is not None and self.recovery.pending():
            return None
        launches, retire = self._ready_launches(), self._finished_drains()
        if not launches and not retire:
            return None
        for index in retire:  # before it ends: its end is no failure
            if self.watchdog is not None:
                self.watchdog.unwatch(index)
        urls = [url for launch in launches for url in launch.future.result()[1]]
        infos = [info for launch in launches for info in launch.future.result()[2]]
        self._admitting = launches
        return {"urls": urls, "infos": infos, "retire": retire}

    def _scale_up(self) -> list[_Launch]:
        """fleet.scale_up: launch engines when the trainer kept waiting for its batches (one
        launch at a time; none beyond fleet.max_engines). The launch to wait for, if any."""
        policy = self.config.fleet.scale_up
        if policy is None or self._launches or not policy.is_behind(self._batch_waits):
            return []
        # Leavers count until they are gone (they still hold their node's resources).
        count = min(policy.add, self.config.fleet.max_engines - len(self.engines.active()))
        if count <= 0:
            return []
        waits = ", ".join(f"{w:.2f}" for w in self._batch_waits[-policy.steps :])
        logger.info(
            "fleet: rollouts behind (the trainer waited %s s for its last %d batches): "
            "launching %d",
            waits,
            policy.steps,
            count,
        )
        self._batch_waits = []  # the next launch needs as many slow steps again
        self.stats.scale_ups += 1
        return [self._launches[-1]] if self._launch(count) and policy.wait else []

    def _after_plan(self, indices: list[int], plan: dict[str, Any]) -> None:
        for launch in self._admitting:
            self._launches.remove(launch)
        slots = [launch.requested_at for launch in self._admitting for _ in range(launch.count)]
        for index, requested_at in zip(indices, slots, strict=True):
            # Known to the client (marked down) and the watchdog, not yet served or watched.
            if self.client.add_engine(self.engines.urls[index]) != index or (
                self.watchdog is not None and self.watchdog.add(self.engines.urls[index]) != index
            ):
                raise RuntimeError(f"fleet: engine {index} got another index in the client")
            self._admitted.append((index, requested_at))
            self.stats.joins += 1
        for index in plan["retire"]:
            began = self._draining.pop(index)
            self.stats.leaves += 1
            self.stats.drain_s.append(time.monotonic() - began)
            logger.info(
                "engine %d left (%.1f s after it was asked to)", index, self.stats.drain_s[-1]
            )
        self._admitting = []
        self._batch_waits = []  # fleet.scale_up judges the fleet as it is now
        described = [
            {**engine, "left": index in self.engines.retired}
            for index, engine in enumerate(self.engines.describe())
        ]
        (self.run_dir / "engines.json").write_text(json.dumps(described, indent=2))

    def _new_requests(self, step: int) -> list[tuple[int, list[int], bool]]:
        """(join, leave, wait) of the schedule's changes for `step` and the new file lines."""
        schedule = self.config.fleet.schedule
        found = [(c.join, list(c.leave), c.wait) for c in schedule if c.step == step]
        asked, self._requests_read = read_requests(self.run_dir, self._requests_read)
        return found + [(join, leave, False) for join, leave in asked]

    def _launch(self, count: int) -> bool:
        """Start launching `count` engines in the background; False if refused."""
        from vime.cluster.addresses import node_address
        from vime.engines.ray_engine import launch_engines

        if not self.engines.launched:
            logger.error("fleet: a join of %d refused: the engines are external", count)
            return False
        planned = len(self.engines.active()) + sum(launch.count for launch in self._launches)
        if planned + count > self.config.fleet.max_engines:
            logger.error(
                "fleet: a join of %d refused: %d engines running or launching, "
                "fleet.max_engines=%d",
                count,
                planned,
                self.config.fleet.max_engines,
            )
            return False
        engine = self.engines.config.model_copy(update={"num_engines": count})
        cluster = self.config.cluster
        first = self._next_index
        self._next_index += count
        if self._executor is None:
            self._executor = ThreadPoolExecutor(2, thread_name_prefix="vime-fleet")
        future = self._executor.submit(
            launch_engines,
            engine,
            cluster,
            node_address=node_address(cluster.node_address, cluster.interface),
            log_dir=str(self.run_dir / "engines"),
            call_timeout_s=self.config.weight_sync.transfer_timeout_s,
            first_rank=first,
        )
        self._launches.append(_Launch(first, count, time.monotonic(), future))
        logger.info("fleet: launching %d engine(s) as %d..%d", count, first, first + count - 1)
        return True

    def _ready_launches(self) -> list[_Launch]:
        """Launches that are up, in index order (a later one waits for an earlier one)."""
        ready = []
        for launch in self._launches:
            if not launch.future.done():
                break
            error = launch.future.exception()
            if error is not None:  # the job goes on with the engines it has
                logger.error(
                    "fleet: engines %d..%d did not start: %s",
                    launch.first_index,
                    launch.first_index + launch.count - 1,
                    error,
                )
                if launch is self._launches[-1]:
                    self._next_index -= launch.count  # indices stay those of the job's engines
                continue
            ready.append(launch)
        failed = [x for x in self._launches if x.future.done() and x.future.exception()]
        self._launches = [x for x in self._launches if x not in failed]
        return ready

    def _drain(self, index: int) -> bool:
        """Engine `index` takes no new request from now and leaves once it holds none."""
        active = self.engines.active()
        if index not in active or index in self._draining:
            logger.error(
                "fleet: engine %d cannot leave: active %s, draining %s",
                index,
                active,
                sorted(self._draining),
            )
            return False
        if len(active) - len(self._draining) <= 1:
            logger.error("fleet: engine %d is the last serving engine; it stays", index)
            return False
        self.client.drain(index)
        self._draining[index] = time.monotonic()
        logger.info(
            "fleet: engine %d drains (%d requests in flight)",
            index,
            self.client.num_in_flight(index),
        )
        return True

    def _finished_drains(self) -> list[int]:
        done = []
        timeout_s = self.config.fleet.drain_timeout_s
        for index, began in self._draining.items():
            if index in self._drained_now:
                continue  # its drain may not have reached the client yet
            left = self.client.num_in_flight(index)
            if left and time.monotonic() - began > timeout_s and index not in self._handed:
                # Cancelled there and resubmitted from scratch to the engines that serve.
                self._handed.add(index)
                self.stats.handed_over += left
                self.client.mark_down(index)
                logger.warning("fleet: engine %d: %d requests handed over", index, left)
                left = 0
            if left == 0:
                done.append(index)
        return done


def _shutdown_launched(future: Future) -> None:
    if future.exception() is None:
        for handle in future.result()[0]:
            handle.shutdown()
