"""The colocated shape (`transport.kind` shm | ipc): engines read each bucket from a buffer a
trainer rank on their own device filled; no bytes cross the network.

The engines run vime's `vime_colocated` backend (`vime.weight_sync.engine.colocated`). The buffer
and the handle that names it come from a `Handles` plug-in (`vime.weight_sync.devices`): a POSIX
shared-memory segment on CPU, a CUDA IPC handle on a GPU; everything else here is the same code.

Each update names one handle per device, {device id: handle}: an engine worker opens the one of
its own device. Where every engine worker sits on the stage sender's device (one GPU, or a CPU
host) the sender alone holds the buckets. Otherwise (N devices shared by trainer ranks and TP
engines) a `Spread` names one *holder* rank per engine device: the sender packs the stage's
buckets, broadcasts each to the holders over a trainer-side group, every holder exports its copy,
and the sender posts each bucket with all holders' handles.

Buffers are kept and refilled sync after sync: nothing is allocated after the first sync.
Invariant: a buffer is refilled only in a later sync than the one that filled it, never within a
sync. Within a sync an engine may still hold views of a bucket it has acknowledged (layerwise
reload keeps a layer's weights until the whole layer has arrived, possibly from a later bucket),
so every bucket of a sync has its own buffer; finish_weight_update releases all views. A buffer
that `UNUSED_SYNCS_KEPT` + 1 syncs in a row did not use is dropped by both sides at the end of
the last of them (a delta sync has fewer buckets than a full one: a full sync now and then keeps
its buffers, and a delta sync does not unmap a model's worth of them inside its pause; all-delta
syncs drop them once). The engine counts only syncs that read a buffer, so it drops no sooner
than the trainer: the trainer never refills a buffer an engine let go. After a failed sync
engines may not have let go: `discard()` (called on any error here, and by the updater when a
session fails) drops every buffer, and the next sync starts with new ones.
A handle's name (a segment's path) is released as soon as every engine acknowledged its bucket.

Without a spread, sending is pipelined: bucket i+1 is packed while the engines load bucket i.
Or every bucket is filled before the engines pause (`prefill`, weight_sync.pack_before_pause):
the buffers are kept anyway, and between syncs no engine reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from vime.weight_sync.buckets import Bucket, buffers_to_drop
from vime.weight_sync.devices import Handles
from vime.weight_sync.transports.base import (
    EngineCall,
    FillBucket,
    InFlightCalls,
    Transport,
    filled_ahead,
)

logger = logging.getLogger(__name__)


@dataclass
class _Buffer:
    tensor: torch.Tensor  # writable, the whole buffer
    handle: dict[str, Any] | None  # None: a sender's staging buffer no engine opens


@dataclass(frozen=True)
class Spread:
    """How one stage's buckets reach the holder ranks of the other engine devices.

    `data`: a group over the sender and the holders that broadcasts buffers on the device (gloo
    on CPU, NCCL on GPU); `control`: a gloo group over the same ranks for bucket descriptions and
    handles. Ranks are global; `sender` is the stage's sender, `holds` whether this rank holds.
    """

    data: Any
    control: Any
    sender: int
    rank: int
    holds: bool
    timeout_s: float

    @property
    def is_sender(self) -> bool:
        return self.rank == self.sender


class ColocatedTransport(Transport):
    """One reusable buffer per bucket and one update_weights request per bucket."""

    backend = "vime_colocated"
    fills_ahead = True

    def __init__(
        self,
        *,
        handles: Handles,
        device_id: str,
        device: torch.device | str = "cpu",
        spread: Spread | None = None,
        timeout_s: float = 600.0,
        shadow: bool = False,
    ):
        """`device_id`: this rank's device (`devices.device_id`); its buffers' handles are keyed
        by it. `spread`: the stage's holders, when engine workers sit on other devices too."""
        super().__init__(timeout_s=timeout_s, shadow=shadow)
        self.handles = handles
        self.device_id = device_id
        self.device = torch.device(device)
        self.spread = spread
        self._buffers: dict[int, _Buffer] = {}  # bucket index -> its buffer
        self._unused_syncs: dict[int, int] = {}  # bucket index -> syncs in a row without it
        self._prefilled: list[int] | None = None  # the indices `prefill` filled for this sync

    def connect(self, init_calls: Sequence[EngineCall]) -> list[dict[str, Any]]:
        self.discard()  # engines that (re)join have opened none of the old buffers
        info = {"handles": self.handles.name, "shadow": self.shadow, "timeout_s": self.timeout_s}
        InFlightCalls(init_calls, info, "init_weight_transfer_engine").wait(self.timeout_s)
        return [info] * len(init_calls)

    @property
    def num_bytes_held(self) -> int:
        """Bytes the kept buffers pin (about one copy of the stage's weights)."""
        return sum(buffer.tensor.numel() for buffer in self._buffers.values())

    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's buffer (made on first use) as a writable view to pack into."""
        return self._buffer(bucket.index, bucket.nbytes, exported=True).tensor[: bucket.nbytes]

    def _buffer(self, index: int, nbytes: int, *, exported: bool) -> _Buffer:
        buffer = self._buffers.get(index)
        if buffer is None or buffer.tensor.numel() < nbytes:
            if buffer is not None:
                self._forget(buffer)
            if exported:
                tensor, handle = self.handles.allocate(nbytes)
                buffer = _Buffer(tensor, handle)
            else:
                buffer = _Buffer(torch.empty(nbytes, dtype=torch.uint8, device=self.device), None)
            self._buffers[index] = buffer
        return buffer

    def _update_info(self, bucket: Bucket, handles: dict[str, Any]) -> dict[str, Any]:
        return {"buckets": [{**bucket.to_dict(), "handles": handles}]}

    def send_bucket(
        self, bucket: Bucket, buffer: torch.Tensor, update_calls: Sequence[EngineCall]
    ) -> dict[str, Any]:
        own = self._buffers.get(bucket.index)
        if own is None or buffer.data_ptr() != own.tensor.data_ptr():
            raise ValueError(
                f"bucket {bucket.index}: the buffer is not this transport's for it; pack into "
                "buffer_for(bucket) and send that exact tensor"
            )
        try:
            return self._send_pipelined([bucket], lambda b, buf: None, update_calls)[0]
        except BaseException:
            self.discard()
            raise

    def prefill(self, buckets: Sequence[Bucket], fill: FillBucket) -> None:
        # Between two syncs no engine reads a buffer (finish released every view), so the
        # buffers this sync will post can be refilled while the engines still decode.
        self._prefilled = None
        exported = self.spread is None or self.spread.holds
        try:
            for bucket in buckets:
                self._fill(bucket, fill, exported=exported)
            self._synchronize()
        except BaseException:
            self.discard()
            raise
        self._prefilled = [bucket.index for bucket in buckets]

    def send_buckets(
        self, buckets: Sequence[Bucket], fill: FillBucket, update_calls: Sequence[EngineCall]
    ) -> list[dict[str, Any]]:
        prefilled, self._prefilled = self._prefilled, None
        if prefilled is not None:
            if [bucket.index for bucket in buckets] != prefilled:
                self.discard()
                raise ValueError(
                    f"send_buckets got buckets {[b.index for b in buckets]} after prefill filled "
                    f"{prefilled}: send exactly the buckets that were filled ahead"
                )
            fill = filled_ahead  # whatever the caller passed: the bytes are in
        try:
            if self.spread is None:
                infos = self._send_pipelined(buckets, fill, update_calls)
            else:
                infos = self._send_spread(buckets, fill, update_calls)
        except BaseException:
            self.discard()
            raise
        self._drop_unused({bucket.index for bucket in buckets if bucket.nbytes})
        return infos

    def _send_pipelined(
        self, buckets: Sequence[Bucket], fill: FillBucket, update_calls: Sequence[EngineCall]
    ) -> list[dict[str, Any]]:
        """Every engine worker on this rank's device: pack bucket i+1 while they load bucket i."""
        infos: list[dict[str, Any]] = []
        previous: tuple[dict[str, Any], InFlightCalls] | None = None
        try:
            for bucket in buckets:
                buffer = self._fill(bucket, fill, exported=True)
                handles = {self.device_id: buffer.handle} if buffer is not None else {}
                self._synchronize()
                if previous is not None:
                    self._acknowledged(*previous)
                    previous = None
                update_info = self._update_info(bucket, handles)
                previous = (handles, InFlightCalls(update_calls, update_info, "update_weights"))
                infos.append(update_info)
            if previous is not None:
                self._acknowledged(*previous)
        except BaseException:
            if previous is not None:
                previous[1].abandon()
            raise
        return infos

    def _fill(self, bucket: Bucket, fill: FillBucket, *, exported: bool) -> _Buffer | None:
        """Fill `bucket` into its buffer (made on first use). A bucket of no bytes (a delta's
        commit) needs no buffer: None, and its filler still runs (it counts the bucket)."""
        if not bucket.nbytes:
            fill(bucket, torch.empty(0, dtype=torch.uint8, device=self.device))
            return None
        buffer = self._buffer(bucket.index, bucket.nbytes, exported=exported)
        fill(bucket, buffer.tensor[: bucket.nbytes])
        return buffer

    def _acknowledged(self, handles: dict[str, Any], in_flight: InFlightCalls) -> None:
        in_flight.wait(self.timeout_s)
        for handle in handles.values():  # every engine has it open now
            self.handles.release(handle)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":  # packing copies must land before an engine reads
            torch.cuda.current_stream(self.device).synchronize()

    # ---- several engine devices: the sender and the holders --------------------------------

    def _send_spread(
        self, buckets: Sequence[Bucket], fill: FillBucket, update_calls: Sequence[EngineCall]
    ) -> list[dict[str, Any]]:
        """The sender: pack every bucket (the stage's other ranks gather meanwhile; a holder of
        this stage joins the spread only after its gathers), spread them, post each."""
        spread = self.spread
        assert spread is not None and spread.is_sender
        for bucket in buckets:
            fill(bucket, self._buffer(bucket.index, bucket.nbytes, exported=spread.holds).tensor)
        handles = self._spread(buckets)
        infos = []
        for bucket, per_device in zip(buckets, handles, strict=True):
            update_info = self._update_info(bucket, per_device)
            InFlightCalls(update_calls, update_info, "update_weights").wait(self.timeout_s)
            infos.append(update_info)
        self._control_barrier()  # every engine acknowledged: the holders release their names
        self._release_own(handles)
        return infos

    def hold(self) -> None:
        """A holder that is not the stage's sender: receive the stage's buckets into buffers of
        its own, export them, and keep them until every engine has acknowledged."""
        spread = self.spread
        assert spread is not None and spread.holds and not spread.is_sender
        try:
            described: list[Any] = [None]
            dist.broadcast_object_list(described, src=spread.sender, group=spread.control)
            buckets = [Bucket.from_dict(b) for b in described[0]]
            handles = self._spread(buckets)
            self._control_barrier()
        except BaseException:
            self.discard()
            raise
        self._release_own(handles)
        self._drop_unused({bucket.index for bucket in buckets if bucket.nbytes})

    def _spread(self, buckets: Sequence[Bucket]) -> list[dict[str, Any]]:
        """Run by the sender and every holder: the buckets' bytes to the holders, and each
        bucket's {device id: handle} of every holder, in bucket order."""
        spread = self.spread
        assert spread is not None
        if spread.is_sender:
            described: list[Any] = [[b.to_dict() for b in buckets]]
            dist.broadcast_object_list(described, src=spread.sender, group=spread.control)
        mine: list[dict[str, Any] | None] = []
        for bucket in buckets:
            if not bucket.nbytes:
                mine.append(None)
                continue
            buffer = self._buffer(bucket.index, bucket.nbytes, exported=spread.holds)
            work = dist.broadcast(
                buffer.tensor[: bucket.nbytes], src=spread.sender, group=spread.data, async_op=True
            )
            work.wait(timedelta(seconds=spread.timeout_s))
            mine.append(buffer.handle if spread.holds else None)
        self._synchronize()
        everyone: list[Any] = [None] * dist.get_world_size(spread.control)
        dist.all_gather_object(everyone, (self.device_id, mine), group=spread.control)
        per_bucket: list[dict[str, Any]] = [{} for _ in buckets]
        for device, handles in everyone:
            for position, handle in enumerate(handles):
                if handle is not None:
                    per_bucket[position][device] = handle
        return per_bucket

    def _release_own(self, handles: list[dict[str, Any]]) -> None:
        for per_device in handles:
            own = per_device.get(self.device_id)
            if own is not None:
                self.handles.release(own)

    def _control_barrier(self) -> None:
        spread = self.spread
        assert spread is not None
        work = dist.barrier(group=spread.control, async_op=True)
        work.wait(timedelta(seconds=spread.timeout_s))

    # ---- buffers ----------------------------------------------------------------------------

    def _drop_unused(self, used: set[int]) -> None:
        # The engines' rule too (they let go at finish): a buffer unused for more than
        # UNUSED_SYNCS_KEPT syncs in a row is dropped, so a later sync with more buckets makes
        # new buffers instead of refilling ones the engines let go.
        for index in buffers_to_drop(self._buffers, used, self._unused_syncs):
            self._forget(self._buffers.pop(index))

    def _forget(self, buffer: _Buffer) -> None:
        if buffer.handle is not None:
            self.handles.forget(buffer.handle)

    def discard(self) -> None:
        """Drop every buffer; the next sync makes new ones. Engines that still have a dropped
        buffer open keep its memory until they let go of it."""
        self._prefilled = None
        for buffer in self._buffers.values():
            self._forget(buffer)
        self._buffers.clear()
        self._unused_syncs.clear()

    def close(self) -> None:
        self.discard()
