"""Weight sync from trainer ranks into vLLM engines.

- `buckets`: the wire format (plan, pack, unpack), shared by trainer and engine.
- `transports`: the trainer half of each backend (gloo, shm, nccl, ipc), one interface.
- `vllm_extension`: the engine half of the vime backends (gloo, shm) plus checksum/metadata RPCs;
  imported by vLLM workers through `--worker-extension-cls`, never by the trainer.
- `session`: `run_sync_session`, the seed's sequence (pause, flush, start, each stage's send,
  finish, resume) across trainer ranks, top to bottom.
- `updater`: `WeightUpdater`, what trainers use: checks the engines, plans buckets, runs the
  session over the transport `weight_sync.transport` names (gloo/nccl: the seed's
  UpdateWeightFromDistributed; shm/ipc: UpdateWeightFromTensor).
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
