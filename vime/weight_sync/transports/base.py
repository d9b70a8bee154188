"""The trainer half of a weight-sync backend: one interface, one module per backend.

A transport moves packed buckets (see `vime.weight_sync.buckets`) into engines whose server runs
the matching `--weight-transfer-config` backend. It does not speak HTTP itself: the caller passes
one callable per engine that performs the engine's POST (e.g. `VLLMEngine.update_weights`), and the
transport runs them on threads while it does its own half of the data movement, since a broadcast
only completes once the engines' `update_weights` handlers are receiving.

    transport.connect([e.init_weight_transfer_engine for e in engines])
    # per sync, between start_weight_update and finish_weight_update on every engine:
    transport.send_buckets(buckets, lambda b, buf: pack(state_dict, b, buf),
                           [e.update_weights for e in engines])
    transport.close()

Plan the buckets with `alignment=transport.alignment`.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Self

import torch

from vime.weight_sync.buckets import ALIGNMENT, Bucket

logger = logging.getLogger(__name__)

EngineCall = Callable[[Any], Any]
"""POSTs one payload to one engine and returns once the engine has answered (raises on error)."""

FillBucket = Callable[[Bucket, torch.Tensor], Any]
"""Writes a bucket's tensors into the given buffer, e.g. `lambda b, buf: pack(sd, b, buf)`."""


def filled_ahead(bucket: Bucket, buffer: torch.Tensor) -> None:
    """The fill to pass `send_buckets` for buckets `Transport.prefill` filled: nothing to do."""


class InFlightCalls:
    """The same payload posted to every engine, each on its own thread, awaited with a deadline."""

    def __init__(self, calls: Sequence[EngineCall], payload: Any, what: str):
        if not calls:
            raise ValueError(f"{what}: no engine calls given")
        self.what = what
        self._executor = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="vime-sync")
        self._futures: list[Future] = [self._executor.submit(call, payload) for call in calls]

    def raise_if_failed(self) -> None:
        """Raise now if an engine already answered with an error (instead of hanging later)."""
        for future in self._futures:
            if future.done() and future.exception() is not None:
                self.abandon()
                raise future.exception()  # type: ignore[misc]

    def wait(self, timeout_s: float) -> list[Any]:
        """Every engine's answer; TimeoutError naming the call if one takes longer."""
        deadline = time.monotonic() + timeout_s
        results = []
        for index, future in enumerate(self._futures):
            remaining = max(0.0, deadline - time.monotonic())
            try:
                results.append(future.result(timeout=remaining))
            except TimeoutError as exc:
                self.abandon()
                raise TimeoutError(
                    f"{self.what}: engine {index} did not answer within {timeout_s:g} s"
                ) from exc
            except BaseException:
                self.abandon()
                raise
        self._executor.shutdown(wait=True)
        return results

    def abandon(self) -> None:
        """Stop waiting for the calls (on an error of our own half)."""
        # Never join here: a thread may be blocked in an engine call that can no longer finish
        # (its peer broadcast failed); joining would turn an error into a hang.
        self._executor.shutdown(wait=False, cancel_futures=True)


def check_engine_world_sizes(engine_world_sizes: Sequence[int]) -> list[int]:
    """Each engine's worker count (GET /get_world_size), all positive; a ValueError otherwise."""
    if not engine_world_sizes or any(n <= 0 for n in engine_world_sizes):
        raise ValueError(
            "engine_world_sizes must list each engine's worker count (GET /get_world_size), "
            f"all positive; got {list(engine_world_sizes)}"
        )
    return list(engine_world_sizes)


class Transport(ABC):
    """Moves packed buckets from this trainer process into the engines' workers."""

    backend: ClassVar[str]
    """The engine-side backend name, as in `--weight-transfer-config '{"backend": ...}'`."""

    alignment: ClassVar[int] = ALIGNMENT
    """The bucket alignment the engine side reads; pass it to `plan_buckets`."""

    def __init__(self, *, timeout_s: float = 600.0, shadow: bool = False):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        # weight_sync.shadow: engines load each update beside the served weights (told at init).
        self.shadow = shadow

    @abstractmethod
    def connect(self, init_calls: Sequence[EngineCall]) -> list[dict[str, Any]]:
        """Rendezvous with the engines: post each its init_info (one call per engine).

        Returns the init_info payloads, in engine order.
        """

    @abstractmethod
    def buffer_for(self, bucket: Bucket) -> torch.Tensor:
        """A uint8 buffer of at least bucket.nbytes to pack the bucket into before `send_bucket`."""

    fills_ahead: ClassVar[bool] = False
    """Whether `prefill` works: the transport keeps one buffer per bucket from sync to sync."""

    def prefill(self, buckets: Sequence[Bucket], fill: FillBucket) -> None:
        """Fill every bucket's buffer now (before the engines pause); the next `send_buckets`
        of the same buckets then only posts them. Transports with `fills_ahead` only."""
        raise NotImplementedError(
            f"{type(self).__name__} refills one buffer per bucket in flight and cannot fill a "
            "sync's buckets ahead (weight_sync.pack_before_pause applies to shm and ipc)"
        )

    @abstractmethod
    def send_bucket(
        self, bucket: Bucket, buffer: torch.Tensor, update_calls: Sequence[EngineCall]
    ) -> dict[str, Any]:
        """Deliver one packed bucket, one update_weights call per engine; return the update_info.

        Returns once every engine has acknowledged, after which `buffer` may be refilled.
        """

    def send_buckets(
        self, buckets: Sequence[Bucket], fill: FillBucket, update_calls: Sequence[EngineCall]
    ) -> list[dict[str, Any]]:
        """Deliver all buckets; the default is one `send_bucket` (and one request) per bucket."""
        infos = []
        for bucket in buckets:
            buffer = self.buffer_for(bucket)
            fill(bucket, buffer)
            infos.append(self.send_bucket(bucket, buffer, update_calls))
        return infos

    def discard(self) -> None:
        """After a failed sync: drop any buffer an engine might still read (none by default)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds (groups, buffers, segments). Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
