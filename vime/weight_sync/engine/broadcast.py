"""The `vime_broadcast` engine backend: the worker joins broadcast groups of its own (a TCPStore
rendezvous with the trainer's stage sender, never vLLM's default process group) and receives one
broadcast per bucket. The group is built by the `Communicator` plug-in the trainer names at init
(gloo on CPU buffers, NCCL on this worker's GPU). It can hold several groups at once, keyed by
`group_name` (one per trainer pipeline stage, each with that stage's sender as rank 0); each update
names the group its buckets come from.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from vime.cluster.addresses import HOST_IP_ENV
from vime.weight_sync.buckets import unpack
from vime.weight_sync.devices import Communicator, Pending, communicator_class
from vime.weight_sync.engine.base import BucketEngine, parse_buckets, worker_index
from vime.weight_sync.names import ABORT_KEY, DEFAULT_GROUP_NAME

POLL_S = 0.0005
STORE_POLL_EVERY = 20  # ask the sender's store every 10 ms while a broadcast is pending

# Under vLLM's logger: in a worker, vLLM configures handlers for "vllm" only.
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class BroadcastInitInfo(WeightTransferInitInfo):
    """Where the trainer's TCPStore listens, which ranks this engine's workers take and the
    communicator plug-in ("gloo" or "nccl").

    Worker i of the engine (see `worker_index`) joins as rank `rank_offset + i`; the trainer is
    rank 0 of `world_size`.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0
    group_name: str = DEFAULT_GROUP_NAME
    communicator: str = "gloo"
    shadow: bool = False  # weight_sync.shadow: load beside the served weights (engine.shadow)


@dataclass
class BroadcastUpdateInfo(WeightTransferUpdateInfo):
    """The buckets (Bucket.to_dict) rank 0 of `group_name` broadcasts next, one each, in order."""

    buckets: list[dict[str, Any]]
    group_name: str = DEFAULT_GROUP_NAME

    def __post_init__(self) -> None:
        self.parsed = parse_buckets(self.buckets)


def wait_for_sender(work: Pending, store: dist.Store, timeout_s: float) -> None:
    """Wait for one broadcast; fail fast when the sender gave up on the sync (it set ABORT_KEY in
    the group's store) or died (its store no longer answers), never wait out the timeout then."""
    deadline = time.monotonic() + timeout_s
    polls = 0
    while not work.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no bucket from the trainer within {timeout_s:g} s")
        polls += 1
        if polls % STORE_POLL_EVERY == 0:
            try:
                aborted = store.check([ABORT_KEY])
            except Exception as exc:  # noqa: BLE001 (any failure to reach it means the same)
                raise RuntimeError(
                    f"the trainer's rendezvous store stopped answering mid-sync (the trainer "
                    f"died?): {exc}"
                ) from exc
            if aborted:
                reason = store.get(ABORT_KEY).decode(errors="replace")
                raise RuntimeError(f"the trainer aborted this sync: {reason}")
        time.sleep(POLL_S)
    work.wait(timeout_s)


def connect_store(master_address: str, master_port: int, world_size: int, timeout_s: float):
    """A client of the TCPStore someone else hosts at `master_address:master_port`."""
    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def join_communicator(
    communicator_cls: type[Communicator],
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    group_name: str,
    device: torch.device,
) -> tuple[dist.Store, Communicator]:
    """(the group's store, the communicator): join group `group_name` whose TCPStore someone else
    hosts at `master_address:master_port`. The store (prefixed by the group's name) must outlive
    its group; its keys also carry the sender's abort (`wait_for_sender`)."""
    store = dist.PrefixStore(
        group_name, connect_store(master_address, master_port, world_size, timeout_s)
    )
    # Listen on this node's address (set by vime's launcher), not where the hostname points.
    communicator = communicator_cls.join(
        store,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        address=os.environ.get(HOST_IP_ENV) or None,
        device=device,
    )
    return store, communicator


class BroadcastWeightTransferEngine(BucketEngine):
    """Receives buckets by broadcast from rank 0 of a named group (any host the trainer reaches).

    Holds one group per `group_name`: initialising a name again replaces that group only (the
    old one is aborted: it may be out of step after a failed sync).
    """

    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # group_name -> (store, communicator, timeout_s); the store must outlive its group.
        self._groups: dict[str, tuple[dist.Store, Communicator, float]] = {}
        # Receive buffers by their place in a sync, kept across syncs (about one model copy).
        self._pool: list[torch.Tensor] = []
        self._num_received = 0

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        rank = init_info.rank_offset + worker_index(self.parallel_config)
        if not 0 < rank < init_info.world_size:
            raise ValueError(
                f"worker rank {rank} (rank_offset {init_info.rank_offset} + worker index) is "
                f"outside 1..{init_info.world_size - 1}; rank 0 is the trainer"
            )
        communicator_cls = communicator_class(init_info.communicator)
        self.set_shadow_mode(init_info.shadow, init_info.timeout_s)
        device = (
            torch.device(self.device) if communicator_cls.name == "nccl" else torch.device("cpu")
        )
        old = self._groups.pop(init_info.group_name, None)
        if old is not None:
            old[1].abort()
        store, communicator = join_communicator(
            communicator_cls,
            init_info.master_address,
            init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            group_name=init_info.group_name,
            device=device,
        )
        self._groups[init_info.group_name] = (store, communicator, init_info.timeout_s)
        logger.info(
            "joined %s group %r as rank %d of %d via %s:%d",
            communicator_cls.name,
            init_info.group_name,
            rank,
            init_info.world_size,
            init_info.master_address,
            init_info.master_port,
        )

    def receive_weights(self, update_info: BroadcastUpdateInfo) -> None:
        if self._shadow is not None:
            # Loading beside the served weights: receive on the load thread too, so that the
            # worker's busy loop goes on decoding while the bytes arrive (this call returns at
            # once; the sender's broadcast waits for the receive, and a failure fails the load).
            self._shadow.run_on_load_thread(lambda: self._receive_buckets(update_info))
            return
        self._receive_buckets(update_info)

    def _receive_buckets(self, update_info: BroadcastUpdateInfo) -> None:
        if update_info.group_name not in self._groups:
            raise RuntimeError(
                f"weight transfer group {update_info.group_name!r} not initialized "
                f"(have {sorted(self._groups)}): call init_weight_transfer_engine with that "
                "group_name first"
            )
        store, group, timeout_s = self._groups[update_info.group_name]
        buckets = update_info.parsed

        def post(position: int) -> tuple[torch.Tensor, Pending]:
            buffer = self._receive_buffer(buckets[position].nbytes, group.device)
            return buffer, group.broadcast(buffer)

        pending: tuple[torch.Tensor, Pending] | None
        try:
            pending = post(0)
            for position, bucket in enumerate(buckets):
                began = time.perf_counter()
                assert pending is not None  # posted for every bucket before its turn
                buffer, work = pending
                wait_for_sender(work, store, timeout_s)
                self._count("receive", began)
                # The next bucket arrives (on the communicator's threads or stream) while this
                # one loads.
                pending = post(position + 1) if position + 1 < len(buckets) else None
                self._receive(bucket, unpack(buffer, bucket))
        except BaseException:
            # Out of step with the sender: drop the group (the trainer reconnects) and buffers
            # a half-received bucket may still be written into.
            self._groups.pop(update_info.group_name)
            group.abort()
            self._pool.clear()
            raise

    def _receive_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """The sync's next receive buffer, kept for the same place in later syncs.

        Never reused within a sync (views may be held until finish_weight_update); reused in
        later ones, so no page is allocated or faulted in after the first sync.
        """
        position = self._num_received
        self._num_received += 1
        if position == len(self._pool):
            self._pool.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
        elif self._pool[position].numel() < nbytes or self._pool[position].device != device:
            self._pool[position] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._pool[position][:nbytes]

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self._num_received = 0

    def shutdown(self) -> None:
        for _, group, _ in self._groups.values():
            group.abort()
        self._groups.clear()
        self._pool.clear()
