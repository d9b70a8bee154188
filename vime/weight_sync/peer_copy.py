"""Copy a live engine's weights into a joining one (the caller's side; the engines' side is
`vime.weight_sync.engine.peer_copy`): the trainer's weights are not gathered or sent again.

The source must hold a whole synced version as HF tensors (`weight_sync.transport.delta`
keeps them on every engine worker); the joiner must have as many workers (the same engine
config). After the copy the joiner holds the source's version, label included, verified by
comparing every worker's served checksums with the source's; and it keeps the same tensors as
its delta baseline, so the trainer's next delta applies to it as to every other engine.

    report = copy_from_peer(source, joiner, address="10.0.0.5", version=7,
                         bucket_bytes=512 << 20, timeout_s=600)
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from vime.utils.rendezvous import listening_store
from vime.weight_sync.buckets import plan_buckets


class PeerCopyError(RuntimeError):
    """The copy could not be made or checked; the joiner must get a full sync instead."""


@dataclass(frozen=True)
class PeerCopyReport:
    bytes: int
    seconds: float  # from asking the source to the joiner verified
    send_s: float  # the source's worker 0 sending (its generation waits this long)


def copy_from_peer(
    source: Any,
    joiner: Any,
    *,
    address: str,
    version: int,
    bucket_bytes: int,
    timeout_s: float,
) -> PeerCopyReport:
    """Copy `source`'s weights (VLLMEngine or its Ray handle) into `joiner` and label them
    `version`. `address`: where the rendezvous listens (both engines must reach it)."""
    began = time.monotonic()
    head = source.collective_rpc("vime_peer_copy_source", timeout_s=timeout_s)
    offer = head[0] if head else None
    if not offer or not offer.get("valid") or not offer.get("tensors"):
        raise PeerCopyError(
            "the source holds no whole synced version as HF tensors (no delta baseline: "
            "weight_sync.transport.delta off, or its last update failed)"
        )
    workers = joiner.get_world_size()
    if workers != source.get_world_size():
        raise PeerCopyError(
            f"the joiner has {workers} workers, the source "
            f"{source.get_world_size()}: not the same engine config"
        )
    buckets = [
        replace(b, mode="full")
        for b in plan_buckets([(n, d, tuple(s)) for n, d, s in offer["tensors"]], bucket_bytes)
    ]
    store = listening_store(address, 0, world_size=1 + workers, timeout_s=timeout_s)
    info = json.dumps(
        {
            "master_address": address,
            "master_port": store.port,
            "world_size": 1 + workers,
            "rank_offset": 1,
            "timeout_s": timeout_s,
            "buckets": [b.to_dict() for b in buckets],
        }
    )
    # Both block until the last bucket crossed: they run at once, each bounded by timeout_s.
    call_s = timeout_s
    with ThreadPoolExecutor(2, thread_name_prefix="vime-peer-copy") as pool:
        sent = pool.submit(source.collective_rpc, "vime_peer_copy_send", [info], timeout_s=call_s)
        got = pool.submit(joiner.collective_rpc, "vime_peer_copy_receive", [info], timeout_s=call_s)
        try:
            send_stats = sent.result()[0]
            got.result()
        except Exception as exc:
            raise PeerCopyError(f"the peer copy's transfer failed: {exc}") from exc
    del store  # the rendezvous is over once both joined
    joiner.update_weight_version(str(version))
    want = source.collective_rpc("vime_weight_checksums", timeout_s=timeout_s)
    have = joiner.collective_rpc("vime_weight_checksums", timeout_s=timeout_s)
    differ = sorted(
        {name for w, h in zip(want, have, strict=True) for name in w if w[name] != h.get(name)}
    )
    if differ:
        raise PeerCopyError(f"the joiner serves other weights than the source: {differ[:10]}")
    return PeerCopyReport(
        bytes=sum(b.nbytes for b in buckets),
        seconds=time.monotonic() - began,
        send_s=float(send_stats.get("seconds", 0.0)),
    )
