"""Make megatron-core 0.16.1 run on a CPU-only machine (tests, CI, laptops).

megatron-core assumes a CUDA device in a handful of places even when every tensor it is given lives
on the CPU. `apply_cpu_shims()` patches exactly those places and nothing else; it does nothing when
CUDA is available, so the same code path runs unchanged on GPUs.

    from vime.megatron.cpu_shims import apply_cpu_shims
    apply_cpu_shims()  # before building a GPTModel or running a schedule
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types

import torch

logger = logging.getLogger(__name__)

_APPLIED = False


def _current_device() -> str:
    return "cpu"


def _synchronize(device: object = None) -> None:
    del device


@contextlib.contextmanager
def _noop_fork(self, name: str = "model-parallel-rng"):
    del self, name
    yield


def _noop_add(self, name: str, seed: int) -> None:
    # Record the name only; there is no CUDA generator state to keep.
    self._is_initialized = True
    self.states_[name] = None
    self.seeds_.add(seed)


def _with_tensor_cuda_as_identity(method):
    """Run `method` with `Tensor.cuda()` returning the tensor itself (scoped to the call)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        tensor_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *_, **__: tensor
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = tensor_cuda

    return wrapper


def _on_cpu(kwargs: dict) -> dict:
    if str(kwargs.get("device", "")).startswith("cuda"):
        kwargs["device"] = "cpu"
    return kwargs


class _TorchWithCpuDefaultDevice(types.ModuleType):
    """`torch` as seen by one megatron module, with `zeros(..., device="cuda")` and
    `tensor(..., device="cuda")` built on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        return torch.zeros(*args, **_on_cpu(kwargs))

    @staticmethod
    def tensor(*args, **kwargs):
        return torch.tensor(*args, **_on_cpu(kwargs))


_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):
    """`Tensor.type()` as megatron's optimizer expects it of a CUDA tensor."""
    name = _TENSOR_TYPE(self, *args, **kwargs)
    if args or kwargs or ".cuda." in name:
        return name
    return name.replace("torch.", "torch.cuda.", 1)


def _with_cuda_type_names(method):
    """Run `method` with `Tensor.type()` naming CPU tensors as CUDA ones (scoped to the call)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        torch.Tensor.type = _cuda_type_name
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.type = _TENSOR_TYPE

    return wrapper


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron's no-apex multi-tensor L2 norm, on the tensors' device (it builds it on cuda)."""
    del chunk_size, noop_flag, per_tensor, args
    norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def apply_cpu_shims() -> None:
    """Patch megatron-core for CPU; idempotent, and a no-op when CUDA is available.

    Shims, and why each is needed (megatron-core 0.16.1, torch 2.13 CPU):
    - `torch.cuda.current_device` returns "cpu": megatron passes it as `device=` when it allocates
      buffers (TP all-gather outputs, p2p shape tensors, router scores, rotary frequencies), and
      the real function raises without a CUDA driver.
    - `torch.cuda.synchronize` is a no-op: pipeline p2p calls it after every send/recv batch.
    - `CudaRNGStatesTracker.add` / `.fork` keep no generator state and fork into a null context:
      the tracker saves and restores CUDA RNG state around every dropout and every weight init,
      which needs a CUDA generator. vime trains with dropout 0 and loads weights from a
      checkpoint, so there is no randomness to track.
    - `pipeline_parallel/schedules.py` and `transformer/moe/moe_utils.py` see a `torch` whose
      `zeros(..., device="cuda")` allocates on the CPU: the schedules' `total_num_tokens` counter
      and the MoE aux-loss tracker are created with a hard-coded "cuda" device.
    - `moe_utils.te_general_gemm = None` when Transformer Engine is absent: the MoE router's gating
      linear tests `te_general_gemm is not None`, but the name is only defined when TE imports
      (NameError otherwise; a megatron-core 0.16.1 bug that is not CPU-specific).
    - `LanguageModule.setup_embeddings_and_output_layer` runs with `Tensor.cuda()` as identity:
      with tied embeddings and PP>1 it moves the last stage's embedding copy to CUDA before the
      initial all-reduce over the embedding group.
    - megatron's optimizer (`get_megatron_optimizer`, falling back to torch's AdamW without TE or
      apex): `optimizer.py` and `clip_grads.py` see the same CPU-device `torch` (the bf16 scale
      `_scale_one`, the grad-norm and zero counters are built with device="cuda"); the no-apex L2
      norm `clip_grads.l2_norm_impl` computes on the tensors' device; and the distributed
      optimizer's constructor and `clip_grad_by_total_norm_fp32` see CPU tensors named as CUDA
      ones by `Tensor.type()` (they accept only `torch.cuda.*Tensor` type names).
    Not a shim, but required on CPU: megatron builds its default causal mask on "cuda"
    (`transformer/utils.get_default_causal_mask`), so callers pass an explicit attention mask
    (see `vime.megatron.model.causal_attention_mask`).
    """
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    megatron_random.CudaRNGStatesTracker.fork = _noop_fork
    megatron_random.CudaRNGStatesTracker.add = _noop_add
    LanguageModule.setup_embeddings_and_output_layer = _with_tensor_cuda_as_identity(
        LanguageModule.setup_embeddings_and_output_layer
    )
    torch_view = _TorchWithCpuDefaultDevice()
    schedules.torch = torch_view
    moe_utils.torch = torch_view
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _apply_optimizer_shims(torch_view)
    _APPLIED = True
    logger.info("applied megatron-core CPU shims")


def _apply_optimizer_shims(torch_view: types.ModuleType) -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as optimizer_module

    optimizer_module.torch = torch_view
    clip_grads.torch = torch_view
    clip_grads.l2_norm_impl = _l2_norm
    optimizer_cls = distrib_optimizer.DistributedOptimizer
    optimizer_cls.__init__ = _with_cuda_type_names(optimizer_cls.__init__)
    optimizer_module.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(
        clip_grads.clip_grad_by_total_norm_fp32
    )
