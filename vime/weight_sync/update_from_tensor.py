"""UpdateWeightFromTensor: colocated engines read buckets the stage senders wrote on their host.

For engines on the trainer's host. Each pipeline stage's sender writes its own buckets and posts
them to every engine; stages take turns, so one engine never loads two stages' buckets at once.

Transports (`weight_sync.transport`): `shm` (CPU; a fresh POSIX shared-memory segment per bucket,
engines started with the vime `shm` backend) or `ipc` (GPU; CUDA IPC handles to vLLM's own IPC
backend; the engine workers must sit on the sender's GPU).
"""

from __future__ import annotations

from vime.weight_sync.transports import IpcTransport, ShmTransport, Transport
from vime.weight_sync.updater import WeightUpdater


class UpdateWeightFromTensor(WeightUpdater):
    """Same-host weight sync (shm on CPU, CUDA IPC on GPU); see the module docstring."""

    mode = "tensor"

    def make_transport(self) -> Transport:
        config = self.config
        if config.transport == "shm":
            return ShmTransport(
                prefix=f"vime-pp_{self.topology.pp_rank}", timeout_s=config.transfer_timeout_s
            )
        if config.transport == "ipc":
            return IpcTransport(timeout_s=config.transfer_timeout_s)
        raise ValueError(
            f"mode 'tensor' sends with transport 'shm' or 'ipc', not {config.transport!r}"
        )
