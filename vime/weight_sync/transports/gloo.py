"""Gloo transport: trainer rank 0 broadcasts each packed bucket over TCP to the engines' workers.

Needs the engines started with `--weight-transfer-config '{"backend": "gloo"}'` (see
`vime.weight_sync.vllm_extension`). Works for CPU and GPU engines on any host the trainer can reach;
the group is its own TCPStore + ProcessGroupGloo, never a default process group.

Rank layout: the trainer is rank 0; engine e's workers follow, from
`rank_offset = 1 + sum(engine_world_sizes[:e])`.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from vime.utils.rendezvous import gloo_group, listening_store
from vime.weight_sync.buckets import Bucket
from vime.weight_sync.names import DEFAULT_GROUP_NAME
from vime.weight_sync.transports.base import (
    EngineCall,
    FillBucket,
    InFlightCalls,
    Transport,
    check_engine_world_sizes,
)

logger = logging.getLogger(__name__)

POLL_S = 0.0005


class GlooTransport(Transport):
    """Rank 0 of a gloo group of size 1 + all engine workers; one broadcast per bucket."""

    backend = "gloo"

    def __init__(
        self,
        *,
        engine_world_sizes: Sequence[int],
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = 600.0,
    ):
        """`master_address` must be reachable from every engine worker; port 0 picks a free one."""
        super().__init__(timeout_s=timeout_s)
        self.engine_world_sizes = check_engine_world_sizes(engine_world_sizes)
        self.world_size = 1 + sum(self.engine_world_sizes)
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store: dist.TCPStore | None = None
        self._group: dist.ProcessGroup | None = None
        self._unfinished: list[Any] = []  # broadcasts abandoned after an engine error
        self._broken: str | None = None  # why the group can no longer be trusted
        self._buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]

    def init_infos(self, port: int) -> list[dict[str, Any]]:
        """The init_info of each engine (GlooInitInfo on the engine side)."""
        infos = []
        rank_offset = 1
        for size in self.engine_world_sizes:
            infos.append(
                {
                    "master_address": self.master_address,
                    "master_port": port,
                    "rank_offset": rank_offset,
                    "world_size": self.world_size,
                    "timeout_s": self.timeout_s,
                    "group_name": self.group_name,
                }
            )
            rank_offset += size
        return infos

    def connect(self, init_calls: Sequence[EngineCall]) -> list[dict[str, Any]]:
        if len(init_calls) != len(self.engine_world_sizes):
            raise ValueError(
                f"{len(init_calls)} init calls for {len(self.engine_world_sizes)} engines"
            )
        self.close()
        # Store and gloo pairs listen on master_address only (the node's address), never on
        # every interface.
        self._store = listening_store(
            self.master_address,
            self.master_port,
            world_size=self.world_size,
            timeout_s=self.timeout_s,
        )
        infos = self.init_infos(self._store.port)
        # Each engine blocks in init_weight_transfer_engine until the whole group has joined, so
        # the requests must be in flight while rank 0 joins.
        executor_calls = [
            InFlightCalls([call], info, f"init_weight_transfer_engine (engine {i})")
            for i, (call, info) in enumerate(zip(init_calls, infos, strict=True))
        ]
        prefixed = dist.PrefixStore(self.group_name, self._store)
        try:
            self._group = gloo_group(
                prefixed,
                rank=0,
                world_size=self.world_size,
                timeout_s=self.timeout_s,
                address=self.master_address,
            )
        except BaseException:
            for in_flight in executor_calls:
                in_flight.abandon()
            raise
        for in_flight in executor_calls:
            in_flight.wait(self.timeout_s)
        logger.info(
            "gloo weight-sync group %r up: %d ranks via %s:%d",
            self.group_name,
            self.world_size,
            self.master_address,
            self._store.port,
        )
        return infos

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        return self._staging(0, bucket.nbytes)

    def _staging(self, slot: int, nbytes: int) -> torch.Tensor:
        # Two staging buffers, kept across syncs: bucket i+1 is packed into one while bucket i is
        # broadcast from the other. A slot is refilled only after its broadcast completed, and
        # the engines receive into buffers of their own.
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffers[slot][:nbytes]

    def send_bucket(
        self, bucket: Bucket, buffer: torch.Tensor, update_calls: Sequence[EngineCall]
    ) -> dict[str, Any]:
        return self._send([bucket], lambda b, buf: None, update_calls, buffers=[buffer])

    def send_buckets(
        self, buckets: Sequence[Bucket], fill: FillBucket, update_calls: Sequence[EngineCall]
    ) -> list[dict[str, Any]]:
        """All buckets in one update_weights request per engine, one broadcast each."""
        return [self._send(buckets, fill, update_calls, buffers=None)]

    def _send(
        self,
        buckets: Sequence[Bucket],
        fill: FillBucket,
        update_calls: Sequence[EngineCall],
        buffers: Sequence[torch.Tensor] | None,
    ) -> dict[str, Any]:
        if self._group is None:
            raise RuntimeError("GlooTransport is not connected: call connect() first")
        if self._broken is not None:
            raise RuntimeError(
                f"the gloo group is out of step after an earlier failure ({self._broken}); "
                f"call connect() again"
            )
        if len(update_calls) != len(self.engine_world_sizes):
            raise ValueError(
                f"{len(update_calls)} update calls for {len(self.engine_world_sizes)} engines"
            )
        update_info = {"buckets": [b.to_dict() for b in buckets], "group_name": self.group_name}
        options = dist.BroadcastOptions()
        options.rootRank = 0
        if buffers is not None:
            for bucket, buffer in zip(buckets, buffers, strict=True):
                _check_send_buffer(bucket, buffer)
        in_flight = InFlightCalls(update_calls, update_info, "update_weights")
        posted: list[tuple[Any, int] | None] = [None, None]  # per staging slot: (work, bucket)
        try:
            for position, bucket in enumerate(buckets):
                slot = position % 2
                previous = posted[slot]
                if previous is not None:  # the slot's previous broadcast must be done
                    self._wait(*previous, in_flight)
                    posted[slot] = None
                if buffers is None:
                    buffer = self._staging(slot, bucket.nbytes)
                    fill(bucket, buffer)  # while the other slot's broadcast is in flight
                else:
                    buffer = buffers[position]
                work = self._group.broadcast([buffer[: bucket.nbytes]], options)
                posted[slot] = (work, bucket.index)
            for pending in sorted(filter(None, posted), key=lambda p: p[1]):
                self._wait(*pending, in_flight)
        except BaseException as exc:
            # Engines may be waiting in a broadcast we will never send, or we in one they will
            # never join: the next bucket would pair with the wrong receive.
            self._broken = f"{type(exc).__name__}: {exc}"
            self._unfinished.extend(p[0] for p in posted if p is not None)
            in_flight.abandon()
            raise
        try:
            in_flight.wait(self.timeout_s)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise
        return update_info

    def _wait(self, work: Any, bucket_index: int, in_flight: InFlightCalls) -> None:
        """Wait for one broadcast, failing fast if an engine rejects the update meanwhile.

        An engine that answered with an error will never join this broadcast; waiting for the
        gloo timeout would only hide its error message.
        """
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            in_flight.raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"gloo broadcast of bucket {bucket_index} not done within {self.timeout_s:g} s"
                )
            time.sleep(POLL_S)
        work.wait(self._timeout)  # raises the broadcast's own error, if any

    def close(self) -> None:
        broken = bool(self._unfinished)
        doomed = [self._group, self._store, *self._unfinished]
        self._group, self._store, self._unfinished = None, None, []
        self._broken = None
        if broken:
            # A broadcast no engine will join keeps the group's destructor waiting for gloo's
            # timeout (abort/shutdown do not cut it short); let that happen off the caller's path.
            threading.Thread(target=_release, args=(doomed,), daemon=True).start()


def _release(objects: list[Any]) -> None:
    objects.clear()


def _check_send_buffer(bucket: Bucket, buffer: torch.Tensor) -> None:
    if (
        buffer.dtype != torch.uint8
        or buffer.device.type != "cpu"
        or not buffer.is_contiguous()
        or buffer.numel() < bucket.nbytes
    ):
        raise ValueError(
            f"gloo sends a contiguous CPU uint8 buffer of >= {bucket.nbytes} bytes for bucket "
            f"{bucket.index}; got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}"
        )
