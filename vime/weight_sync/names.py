"""Names both halves of the vime backends agree on: trainer transports and the engine extension.

Kept apart from the transports so that a vLLM worker importing the engine half
(`vime.weight_sync.vllm_extension`) imports no trainer code.
"""

from __future__ import annotations

import re

DEFAULT_GROUP_NAME = "vime-weight-sync"
"""The broadcast backend's group when the trainer names none (each pp stage names its own)."""

ABORT_KEY = "vime-abort"
"""Set in a broadcast group's store by its sender when it gives up on a sync: receivers stop
waiting for buckets that will never come."""

BROADCAST_BACKEND = "vime_broadcast"
"""The engines' --weight-transfer-config backend for transport kinds gloo and nccl."""
COLOCATED_BACKEND = "vime_colocated"
"""... and for shm and ipc."""
ENGINE_BACKENDS = {"gloo": BROADCAST_BACKEND, "nccl": BROADCAST_BACKEND}
ENGINE_BACKENDS |= {"shm": COLOCATED_BACKEND, "ipc": COLOCATED_BACKEND}
"""Transport kind -> the engine backend that receives it (one receiver per sync shape)."""

LOAD_CORES_ENV = "VIME_SYNC_LOAD_CORES"
"""The server's environment variable naming the CPU cores a worker may load weights on during a
sync (engine.cpu_sync_load_cores)."""

SHM_DIR = "/dev/shm"
SEGMENT_MODE = 0o600
# vime's segment names: <prefix>-<creator pid>-<8 hex>-<n>. The engine maps nothing else, and the
# start-up sweep removes only these (of this user, whose creator is gone).
SEGMENT_PREFIX = re.compile(r"vime(-pp_\d+)?")
SEGMENT_NAME = re.compile(r"(?P<prefix>vime(-pp_\d+)?)-(?P<pid>\d+)-[0-9a-f]{8}-\d+")


def check_segment_name(name: str) -> None:
    if not SEGMENT_NAME.fullmatch(name):
        raise ValueError(
            f"shm segment name {name!r} is not one of vime's "
            "(vime[-pp_K]-<pid>-<8 hex>-<n>): the shm backend maps nothing else"
        )
