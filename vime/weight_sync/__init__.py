"""Weight sync from trainer ranks into vLLM engines.

- `buckets`: the wire format (plan, pack, unpack), shared by trainer and engine.
- `transports`: the trainer half of each backend (gloo, shm, nccl, ipc), one interface.
- `vllm_extension`: the engine half of the vime backends (gloo, shm) plus checksum/metadata RPCs;
  imported by vLLM workers through `--worker-extension-cls`, never by the trainer.
- `session`: `run_sync_session`, the one function that orders pause, flush, start, send, finish
  and resume across trainer ranks.
- `update_from_distributed` / `update_from_tensor`: the updaters trainers use
  (`UpdateWeightFromDistributed`: gloo/nccl broadcast; `UpdateWeightFromTensor`: shm/ipc,
  colocated), sharing `updater.WeightUpdater`.
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

WORKER_EXTENSION_CLS = "vime.weight_sync.vllm_extension.VimeWorkerExtension"

__all__ = [
    "ALIGNMENT",
    "WORKER_EXTENSION_CLS",
    "Bucket",
    "TensorMeta",
    "check_against_engine",
    "pack",
    "plan_buckets",
    "tensor_digest",
    "unpack",
]
