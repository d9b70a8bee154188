"""The distributed shape (`transport.kind` gloo | nccl): a pipeline stage's sender broadcasts each
packed bucket to every worker of every engine, over one group per stage.

The engines run vime's `vime_broadcast` backend (`vime.weight_sync.engine.broadcast`). The group is
built by a `Communicator` plug-in (`vime.weight_sync.devices`): gloo over TCP on CPU buffers, or
NCCL on the sender's GPU; everything else here (rendezvous, rank layout, bucket pipeline, deadlines,
failing fast on an engine's error, aborting a group that is out of step) is the same code for both.

Rank layout: the sender is rank 0; engine e's workers follow, from
`rank_offset = 1 + sum(engine_world_sizes[:e])`. The rendezvous is a TCPStore the sender listens
on (`master_address`, never every interface); the group's keys live under its `group_name`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from vime.utils.rendezvous import listening_store
from vime.weight_sync.buckets import Bucket
from vime.weight_sync.devices import Communicator, Pending, communicator_class
from vime.weight_sync.names import ABORT_KEY, DEFAULT_GROUP_NAME
from vime.weight_sync.transports.base import (
    EngineCall,
    FillBucket,
    InFlightCalls,
    Transport,
    check_engine_world_sizes,
)

logger = logging.getLogger(__name__)

POLL_S = 0.0005


class BroadcastTransport(Transport):
    """Rank 0 of a group of size 1 + all engine workers; one broadcast per bucket."""

    backend = "vime_broadcast"

    def __init__(
        self,
        *,
        engine_world_sizes: Sequence[int],
        communicator: str = "gloo",
        device: torch.device | str = "cpu",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = 600.0,
        shadow: bool = False,
    ):
        """`communicator`: the plug-in ("gloo" on CPU buffers, "nccl" on `device`, a GPU).
        `master_address` must be reachable from every engine worker; port 0 picks a free one."""
        super().__init__(timeout_s=timeout_s, shadow=shadow)
        self.engine_world_sizes = check_engine_world_sizes(engine_world_sizes)
        self.world_size = 1 + sum(self.engine_world_sizes)
        self.communicator_cls = communicator_class(communicator)
        self.device = torch.device(device)
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self._store: dist.TCPStore | None = None
        self._group: Communicator | None = None
        self._broken: str | None = None  # why the group can no longer be trusted
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in range(2)]

    def init_infos(self, port: int) -> list[dict[str, Any]]:
        """The init_info of each engine (BroadcastInitInfo on the engine side)."""
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
                    "communicator": self.communicator_cls.name,
                    "shadow": self.shadow,
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
        # The store (and gloo's pairs) listen on master_address only (the node's address).
        self._store = listening_store(
            self.master_address,
            self.master_port,
            world_size=self.world_size,
            timeout_s=self.timeout_s,
        )
        infos = self.init_infos(self._store.port)
        # Each engine blocks in init_weight_transfer_engine until the whole group has joined, so
        # the requests must be in flight while rank 0 joins.
        in_flight = [
            InFlightCalls([call], info, f"init_weight_transfer_engine (engine {i})")
            for i, (call, info) in enumerate(zip(init_calls, infos, strict=True))
        ]
        try:
            self._group = self.communicator_cls.join(
                dist.PrefixStore(self.group_name, self._store),
                rank=0,
                world_size=self.world_size,
                timeout_s=self.timeout_s,
                address=self.master_address,
                device=self.device,
            )
        except BaseException:
            for calls in in_flight:
                calls.abandon()
            raise
        for calls in in_flight:
            calls.wait(self.timeout_s)
        logger.info(
            "%s weight-sync group %r up: %d ranks via %s:%d",
            self.communicator_cls.name,
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
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
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
        if self._broken is not None:
            raise RuntimeError(
                f"the weight-sync group is out of step after an earlier failure ({self._broken}); "
                f"call connect() again"
            )
        if self._group is None:
            raise RuntimeError("BroadcastTransport is not connected: call connect() first")
        if len(update_calls) != len(self.engine_world_sizes):
            raise ValueError(
                f"{len(update_calls)} update calls for {len(self.engine_world_sizes)} engines"
            )
        update_info = {"buckets": [b.to_dict() for b in buckets], "group_name": self.group_name}
        if buffers is not None:
            for bucket, buffer in zip(buckets, buffers, strict=True):
                self._check_send_buffer(bucket, buffer)
        in_flight = InFlightCalls(update_calls, update_info, "update_weights")
        posted: list[tuple[Pending, int] | None] = [None, None]  # per staging slot
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
                posted[slot] = (self._group.broadcast(buffer[: bucket.nbytes]), bucket.index)
            for pending in sorted(filter(None, posted), key=lambda p: p[1]):
                self._wait(*pending, in_flight)
            in_flight.wait(self.timeout_s)
        except BaseException as exc:
            # Engines may be waiting in a broadcast we will never send, or we in one they will
            # never join: the next bucket would pair with the wrong receive. Abort the group
            # (never wait for its peers) and refuse to send on it until connect() rebuilt it.
            self._broken = f"{type(exc).__name__}: {exc}"
            in_flight.abandon()
            self._tell_receivers(self._broken)
            self._group.abort()
            self._group = None
            raise
        return update_info

    def _tell_receivers(self, reason: str) -> None:
        """Receivers waiting for a bucket stop at once instead of at their timeout."""
        assert self._store is not None
        try:
            dist.PrefixStore(self.group_name, self._store).set(ABORT_KEY, reason[:2000])
        except Exception:  # noqa: BLE001 (the sync's own error is the one to raise)
            logger.exception("could not tell the engines that the sync was aborted")

    def _wait(self, pending: Pending, bucket_index: int, in_flight: InFlightCalls) -> None:
        """Wait for one broadcast, failing fast if an engine rejects the update meanwhile.

        An engine that answered with an error will never join this broadcast; waiting for the
        group's timeout would only hide its error message.
        """
        deadline = time.monotonic() + self.timeout_s
        while not pending.done():
            in_flight.raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.communicator_cls.name} broadcast of bucket {bucket_index} not done "
                    f"within {self.timeout_s:g} s"
                )
            time.sleep(POLL_S)
        pending.wait(self.timeout_s)  # raises the broadcast's own error, if any

    def _check_send_buffer(self, bucket: Bucket, buffer: torch.Tensor) -> None:
        if (
            buffer.dtype != torch.uint8
            or buffer.device != self._buffers[0].device
            or not buffer.is_contiguous()
            or buffer.numel() < bucket.nbytes
        ):
            raise ValueError(
                f"{self.communicator_cls.name} sends a contiguous uint8 buffer on {self.device} "
                f"of >= {bucket.nbytes} bytes for bucket {bucket.index}; got {buffer.dtype} "
                f"{tuple(buffer.shape)} on {buffer.device}"
            )

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()
        self._store = None
        self._broken = None
