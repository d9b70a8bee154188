"""The torch.distributed environment of a process started without torchrun."""

from __future__ import annotations

import os


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
