"""Whether an engine worker can load an update beside its served weights (`weight_sync.shadow`):
on CPU, eager, and with room for one more copy of the weights (`required_bytes`, against
MemAvailable and the cgroup's limit), refused with what to change otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

# Of MemAvailable, what a shadow load may plan to take (the rest: headroom for decoding).
MEMORY_HEADROOM = 0.9


def required_bytes(model: torch.nn.Module) -> int:
    """Bytes one more copy of `model`'s weights takes (each parameter and buffer once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in seen or tensor.is_meta:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    # vLLM's CPU backend keeps each linear weight (and the embedding's, for a head) packed in a
    # kernel of its own (`cpu_linear`); a repacked linear layer keeps an empty `weight`.
    for module in model.modules():
        weight = module._parameters.get("weight")
        if getattr(module, "cpu_linear", None) is None or weight is None:
            continue
        numel = weight.numel() if weight.ndim == 2 else 0
        if weight.numel() == 0:
            rows = getattr(module, "output_size_per_partition", 0)
            cols = getattr(module, "input_size_per_partition", 0)
            numel = rows * cols
        total += numel * weight.element_size()
    return total


def available_bytes() -> int | None:
    """MemAvailable of this machine, less for a cgroup limit below it (None: unknown)."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as limit_file:
            limit = limit_file.read().strip()
        with open("/sys/fs/cgroup/memory.current") as current_file:
            current = int(current_file.read().strip())
        if limit != "max" and available is not None:
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return available


def check_can_shadow(model: torch.nn.Module, model_config: Any, device: Any) -> int:
    """Raise ValueError naming what stands in the way of a shadow load; else its bytes."""
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"weight_sync.shadow loads beside the served weights on CPU engines only (this "
            f"worker runs on {device}; it has never run on a GPU): set weight_sync.shadow false"
        )
    if not getattr(model_config, "enforce_eager", False):
        raise ValueError(
            "weight_sync.shadow needs an eager engine (engine.enforce_eager: true): a compiled "
            "or captured model holds the served tensors, which the swap replaces"
        )
    need = required_bytes(model)
    have = available_bytes()
    if have is not None and need > MEMORY_HEADROOM * have:
        raise ValueError(
            f"weight_sync.shadow needs {need / 2**30:.2f} GiB for a second copy of the weights "
            f"on this engine worker, and {have / 2**30:.2f} GiB is available (MemAvailable, "
            f"cgroup limit; {MEMORY_HEADROOM:.0%} of it may be planned): set weight_sync.shadow "
            "false or give the engine more memory"
        )
    return need
