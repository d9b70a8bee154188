"""Trainer checkpoints with megatron-core's distributed checkpointing.

One checkpoint is a directory `<checkpoint_dir>/step_<K>` written by all trainer ranks together
(`megatron.core.dist_checkpointing`, torch_dist format): the model's sharded state dict, the AdamW
state sharded like the parameters it belongs to, the frozen KL reference when there is one (after
SFT it is the SFT model, not the initial checkpoint), and a common part (`TrainingState`: the next
step to run, the weight version the engines were synced to; torch's RNG state).

A checkpoint is complete once megatron has written its `metadata.json`, last; `latest_checkpoint`
ignores directories without one (a job killed mid-save). Tensors are saved under global keys and
offsets, so another TP layout can read them; only resuming in the same layout is tested.

    save_checkpoint(trainer, root, TrainingState(next_step=K, weight_version=V))
    state = load_checkpoint(trainer, latest_checkpoint(root))
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vime.config import complete_checkpoints

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step_(\d+)$")
_REFERENCE = "reference."


@dataclass(frozen=True)
class TrainingState:
    """What a resumed job needs besides the tensors; the data position is `next_step` (a step's
    prompts depend only on its index and rollout.shuffle_seed)."""

    next_step: int
    weight_version: int


def _sharded_state(
    trainer: Any, with_optimizer: bool = True, with_reference: bool = True
) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_state = _chunks_state(trainer.model)
    state: dict[str, Any] = {"model": model_state}
    if trainer.reference is not None and with_reference:
        # The KL reference is not always the initial checkpoint (after SFT it is the SFT model).
        state["reference"] = _chunks_state(trainer.reference, prefix=_REFERENCE)
    if not with_optimizer:
        return state
    optimizer = trainer.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    _ensure_optimizer_state(optimizer)
    optim_state = optimizer.state_dict()
    # AdamW's per-parameter "step" is a scalar: kept apart (trainer.num_steps), not sharded.
    optim_state_to_sharding_state(
        optim_state, get_param_id_to_sharded_param_map(model_state, params), exclude_keys=("step",)
    )
    state["optimizer"] = optim_state
    return state


def _chunks_state(chunks: list[Any], prefix: str = "") -> dict[str, Any]:
    """The chunks' sharded state dicts, as megatron names them: one chunk's as it is, several
    under model0, model1, ... (each chunk's keys already hold global layer numbers)."""
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict(prefix=prefix)
    return {f"model{i}": chunk.sharded_state_dict(prefix=prefix) for i, chunk in enumerate(chunks)}


def _load_chunks(chunks: list[Any], state: dict[str, Any], prefix: str = "") -> None:
    if len(chunks) == 1:
        states = [state]
    else:
        states = [state[f"model{i}"] for i in range(len(chunks))]
    for chunk, chunk_state in zip(chunks, states, strict=True):
        chunk.load_state_dict({k.removeprefix(prefix): v for k, v in chunk_state.items()})


def _ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW state for every parameter (zeros before its first step), so that a checkpoint taken
    or loaded before any step has the same tensors as a later one."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def save_checkpoint(trainer: Any, root: str | Path, state: TrainingState, keep: int = 2) -> Path:
    """Write step_<next_step> under `root` on every rank (collective); keep the newest `keep`."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    path = root / f"step_{state.next_step}"
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)  # an incomplete one from a killed save
        path.mkdir(parents=True)
    dist.barrier()
    sharded = _sharded_state(trainer)
    sharded["training_state"] = asdict(state)
    sharded["rng_state"] = torch.get_rng_state()
    dist_checkpointing.save(sharded, str(path))
    _stop_write_results_manager()
    dist.barrier()
    if dist.get_rank() == 0:
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    logger.info("saved checkpoint %s (weight version %d)", path, state.weight_version)
    return path


def _stop_write_results_manager() -> None:
    """End the process megatron's torch_dist writer leaves running after a save.

    `filesystem_async._get_write_results_queue` starts a multiprocessing Manager (a spawned server
    process) on the first save and keeps it for the life of the rank; a SIGKILLed rank would leave
    it running forever. The save is synchronous and complete here, so it is shut down now (the
    next save starts a new one): the process exists only while a save runs.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    if queue is None:
        return
    filesystem_async._results_queue = None
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()


def load_checkpoint(trainer: Any, path: str | Path, with_optimizer: bool = True) -> TrainingState:
    """Load `path` into the trainer's model (and optimizer) on every rank (collective)."""
    from megatron.core import dist_checkpointing

    saved_keys = dist_checkpointing.load_tensors_metadata(str(path)).keys()
    with_reference = any(key.startswith(_REFERENCE) for key in saved_keys)
    if trainer.reference is not None and not with_reference:
        logger.warning(
            "%s holds no KL reference (saved without grpo.kl_coef, or by an older vime): the "
            "reference stays the initial weights of engine.model_path",
            path,
        )
    template = _sharded_state(trainer, with_optimizer, with_reference)
    loaded = dist_checkpointing.load(template, str(path))
    _load_chunks(trainer.model, loaded["model"])
    if trainer.reference is not None and with_reference:
        _load_chunks(trainer.reference, loaded["reference"], prefix=_REFERENCE)
    state = TrainingState(**loaded["training_state"])
    if not with_optimizer:
        return state
    optim_state = loaded["optimizer"]
    for param_state in optim_state["state"].values():
        param_state["step"] = torch.tensor(float(state.next_step))
    trainer.optimizer.load_state_dict(optim_state)
    trainer.num_steps = state.next_step
    torch.set_rng_state(loaded["rng_state"])
    logger.info("resumed from %s: next step %d, weight version %d", path, *asdict(state).values())
    return state
