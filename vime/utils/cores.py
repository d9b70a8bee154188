"""Which CPU cores a single local engine leaves to the rest of the host. Imports nothing of vime."""

from __future__ import annotations


def spare_core(cores: list[int], num_local_engines: int, engine_workers: int) -> int | None:
    """The core one local engine leaves free for its API server and a colocated trainer: the
    last of `cores`, when that engine has more cores than workers (as vLLM's "auto" binding
    does); None when several engines share the host, or there is no core to spare."""
    if num_local_engines == 1 and len(cores) > engine_workers:
        return cores[-1]
    return None
