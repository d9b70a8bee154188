"""The `gloo` engine backend: the worker joins torch.distributed gloo groups of its own (a
TCPStore rendezvous with the trainer, never vLLM's default process group) and receives one
broadcast per bucket. It can hold several groups at once, keyed by `group_name` (one per trainer
pipeline stage, each with that stage's sender as rank 0); each update names the group its
buckets come from.
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
from vime.utils.rendezvous import gloo_group
from vime.weight_sync.buckets import unpack
from vime.weight_sync.engine.base import BucketEngine, parse_buckets, worker_index
from vime.weight_sync.names import DEFAULT_GROUP_NAME

# Under vLLM's logger: in a worker, vLLM configures handlers for "vllm" only.
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's TCPStore listens and which ranks this engine's workers take.

    Worker i of the engine (see `worker_index`) joins as rank `rank_offset + i`; the trainer is
    rank 0 of `world_size`.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0
    group_name: str = DEFAULT_GROUP_NAME


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The buckets (Bucket.to_dict) rank 0 of `group_name` broadcasts next, one each, in order."""

    buckets: list[dict[str, Any]]
    group_name: str = DEFAULT_GROUP_NAME

    def __post_init__(self) -> None:
        self.parsed = parse_buckets(self.buckets)


def join_group(
    master_address: str,
    master_port: int,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    group_name: str,
) -> tuple[dist.Store, dist.ProcessGroup]:
    """(store, group): join the gloo group `group_name` whose TCPStore someone else hosts at
    `master_address:master_port`. The store must outlive its group."""
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # Listen on this node's address (set by vime's launcher), not where the hostname points.
    group = gloo_group(
        dist.PrefixStore(group_name, store),
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        address=os.environ.get(HOST_IP_ENV) or None,
    )
    return store, group


class GlooWeightTransferEngine(BucketEngine):
    """Receives buckets by gloo broadcast from rank 0 of a named group (CPU, TCP; any host).

    Holds one group per `group_name`: initialising a name again replaces that group only.
    """

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # group_name -> (store, group, timeout); the store must outlive its group.
        self._groups: dict[str, tuple[dist.Store, dist.ProcessGroup, datetime.timedelta]] = {}
        # Receive buffers by their place in a sync, kept across syncs (about one model copy).
        self._pool: list[torch.Tensor] = []
        self._num_received = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + worker_index(self.parallel_config)
        if not 0 < rank < init_info.world_size:
            raise ValueError(
                f"worker rank {rank} (rank_offset {init_info.rank_offset} + worker index) is "
                f"outside 1..{init_info.world_size - 1}; rank 0 is the trainer"
            )
        self._groups.pop(init_info.group_name, None)
        store, group = join_group(
            init_info.master_address,
            init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            group_name=init_info.group_name,
        )
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        self._groups[init_info.group_name] = (store, group, timeout)
        logger.info(
            "joined gloo group %r as rank %d of %d via %s:%d",
            init_info.group_name,
            rank,
            init_info.world_size,
            init_info.master_address,
            init_info.master_port,
        )

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if update_info.group_name not in self._groups:
            raise RuntimeError(
                f"gloo weight transfer group {update_info.group_name!r} not initialized "
                f"(have {sorted(self._groups)}): call init_weight_transfer_engine with that "
                "group_name first"
            )
        _, group, timeout = self._groups[update_info.group_name]
        options = dist.BroadcastOptions()
        options.rootRank = 0
        buckets = update_info.parsed

        pending: tuple[torch.Tensor, Any] | None

        def post(position: int) -> tuple[torch.Tensor, Any]:
            buffer = self._receive_buffer(buckets[position].nbytes)
            return buffer, group.broadcast([buffer], options)

        try:
            pending = post(0)
            for position, bucket in enumerate(buckets):
                began = time.perf_counter()
                assert pending is not None  # posted for every bucket before its turn
                buffer, work = pending
                work.wait(timeout)
                self._count("receive", began)
                # The next bucket arrives (on gloo's threads) while this one loads.
                pending = post(position + 1) if position + 1 < len(buckets) else None
                self._receive(bucket, unpack(buffer, bucket))
        except BaseException:
            self._pool.clear()
            raise

    def _receive_buffer(self, nbytes: int) -> torch.Tensor:
        """The sync's next receive buffer, kept for the same place in later syncs.

        Never reused within a sync (views may be held until finish_weight_update); reused in
        later ones, so no page is allocated or faulted in after the first sync.
        """
        position = self._num_received
        self._num_received += 1
        if position == len(self._pool):
            self._pool.append(torch.empty(nbytes, dtype=torch.uint8))
        elif self._pool[position].numel() < nbytes:
            self._pool[position] = torch.empty(nbytes, dtype=torch.uint8)
        return self._pool[position][:nbytes]

    def start_weight_update(self) -> None:
        super().start_weight_update()
        self._num_received = 0

    def shutdown(self) -> None:
        self._groups.clear()
        self._pool.clear()
