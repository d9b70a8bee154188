"""A joining engine's first weights copied from a live one, engine to engine, the trainer untouched.

With `weight_sync.transport.delta` every engine worker keeps the HF-named tensors of its last
sync (`delta.Baseline`: whole tensors, in the dtype sent, exactly what the trainer's delta encoder
holds for it). The source engine's worker 0 broadcasts them over a gloo group of its own (rank 0)
to every worker of the joiner (ranks 1..n); each joiner worker loads them as a full sync would
(vLLM's layerwise reload, `BucketEngine`) and keeps them as its own baseline, so the trainer's
next delta applies to the joiner as to every other engine. The rendezvous (a TCPStore) is the
caller's; the gloo pairs listen on each engine's node address. Works with either backend
(gloo or shm): only the worker's transfer engine's load and baseline are used.

The source serves on while it sends: a collective_rpc runs between the engine's steps, so its
generation waits for the send (about one copy of the model over TCP), nothing else.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from vime.weight_sync.buckets import dtype_name, pack, unpack
from vime.weight_sync.devices import Communicator
from vime.weight_sync.devices.cpu import GlooCommunicator
from vime.weight_sync.engine.base import BucketEngine, parse_buckets, worker_index
from vime.weight_sync.engine.broadcast import join_communicator

PEER_COPY_GROUP = "vime-peer-copy"


def _join(info: dict[str, Any], rank: int) -> tuple[dist.Store, Communicator]:
    return join_communicator(
        GlooCommunicator,
        info["master_address"],
        int(info["master_port"]),
        rank=rank,
        world_size=int(info["world_size"]),
        timeout_s=float(info["timeout_s"]),
        group_name=PEER_COPY_GROUP,
        device=torch.device("cpu"),
    )


def peer_copy_tensors(engine: BucketEngine, parallel_config: Any) -> dict[str, Any]:
    """What worker 0 of a source engine can send: {"valid", "tensors": [[name, dtype, shape]]}
    (other workers: {} ; they send nothing)."""
    if worker_index(parallel_config) != 0:
        return {}
    baseline = engine.baseline
    tensors = [[n, dtype_name(t.dtype), list(t.shape)] for n, t in baseline.tensors().items()]
    return {"valid": baseline.whole, "tensors": tensors}


def send_peer_copy(
    engine: BucketEngine, parallel_config: Any, info: dict[str, Any]
) -> dict[str, float]:
    """Worker 0 of the source: broadcast the baseline in `info["buckets"]`, rank 0 of the copy's
    group. Other workers return at once."""
    if worker_index(parallel_config) != 0:
        return {}
    baseline = engine.baseline
    if not baseline.whole:
        raise RuntimeError("this engine's weights are not a whole synced version: no peer copy")
    began = time.perf_counter()
    buckets = parse_buckets(info["buckets"])
    _store, group = _join(info, rank=0)
    tensors = baseline.tensors()
    buffer = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8)
    sent = 0
    for bucket in buckets:
        group.broadcast(pack(tensors, bucket, buffer)).wait(float(info["timeout_s"]))
        sent += bucket.nbytes
    return {"bytes": float(sent), "seconds": time.perf_counter() - began}


def receive_peer_copy(worker: Any, info: dict[str, Any]) -> dict[str, float]:
    """Every worker of the joiner: receive the source's baseline and load it as a full sync
    (start, load, finish through the worker, so vLLM's session bookkeeping holds)."""
    engine: BucketEngine = worker.weight_transfer_engine
    rank = int(info["rank_offset"]) + worker_index(worker.parallel_config)
    buckets = [dataclasses.replace(b, mode="full") for b in parse_buckets(info["buckets"])]
    began = time.perf_counter()
    _store, group = _join(info, rank=rank)
    worker.start_weight_update()
    try:
        for bucket in buckets:
            # A buffer per bucket: layerwise reload may keep views until finish.
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
            group.broadcast(buffer).wait(float(info["timeout_s"]))
            engine._receive(bucket, unpack(buffer, bucket))
    except BaseException:
        engine._end_failed_update()
        engine.reset_weight_update_target()
        worker._weight_update_active = False
        raise
    worker.finish_weight_update()
    return {"bytes": float(sum(b.nbytes for b in buckets)), "seconds": time.perf_counter() - began}
