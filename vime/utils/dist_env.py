"""The torch.distributed environment of a process started without torchrun."""

from __future__ import annotations

import os
from datetime import timedelta


def default_to_single_process() -> None:
    """Outside torchrun, make this process a world of one on loopback (torchrun sets these)."""
    from vime.utils.net import free_port

    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )


def init_process_group(timeout: timedelta) -> tuple[int, int]:
    """Join torchrun's world: NCCL on the GPU of this LOCAL_RANK when CUDA exists, else gloo.

    The device is set before anything touches CUDA (else every rank of a node uses cuda:0).
    Returns (rank, world size).
    """
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()
