"""Weight sync from trainer ranks into vLLM engines.

- `buckets`: the wire format (plan, pack, unpack), shared by trainer and engine.
- `transports`: the trainer half of each backend (gloo, shm, nccl, ipc), one interface.
- `vllm_extension`: the engine half (the vime backends `vime_broadcast` and `vime_colocated`)
  plus checksum/metadata RPCs;
  imported by vLLM workers through `--worker-extension-cls`, never by the trainer.
- `session`: `run_sync_session`, one sync across trainer ranks, top to bottom: rank 0 pauses
  every engine (keep) and flushes caches, start, each pipeline stage's send in turn, finish with
  the new weight version, rank 0 resumes.
- `updater`: `WeightUpdater`, what trainers use: checks the engines, plans buckets, runs the
  session over the transport `weight_sync.transport` names (gloo/nccl: a broadcast group per
  pipeline stage, UpdateWeightFromDistributed; shm/ipc: buffers the colocated engines open,
  UpdateWeightFromTensor).
"""

from vime.weight_sync.buckets import (
    ALIGNMENT,
    Bucket,
    TensorMeta,
    check_against_engine,
    pack,
    plan_buckets,
    tensor_digest,
    unpack,
)

__all__ = [
    "ALIGNMENT",
    "Bucket",
    "TensorMeta",
    "check_against_engine",
    "pack",
    "plan_buckets",
    "tensor_digest",
    "unpack",
]
