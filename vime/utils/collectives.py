"""Collectives among a job's own trainer ranks that torch leaves to its callers."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def broadcast_object(obj: Any, group: Any = None, src: int = 0) -> Any:
    """Group rank `src`'s `obj` on every rank of `group` (None: the default group).

    torch pickles it: use it between the job's own ranks only, never with anything that comes
    from outside the job."""
    holder = [obj]
    dist.broadcast_object_list(holder, group=group, group_src=src)
    return holder[0]
