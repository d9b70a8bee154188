"""Reading back what an engine worker serves, under HF names: for the pre-send metadata check
and the post-sync checksums (`VimeWorkerExtension`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def hf_named_parameters(
    model: torch.nn.Module, materialize: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights the model serves, under checkpoint (HF) names.

    vLLM fuses some checkpoint tensors (q/k/v into qkv_proj, gate/up into gate_up_proj, per the
    model's `packed_modules_mapping`) and pads vocab rows; this splits and trims them back. With
    `materialize=False` the tensors are meta tensors (names, dtypes and shapes only, no compute).
    Only for tensor-parallel size 1, where every worker holds whole tensors.
    """
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tp_size = get_tensor_model_parallel_world_size()
    if tp_size != 1:
        raise ValueError(
            f"HF-named weights need whole tensors; this engine has tensor-parallel size "
            f"{tp_size}. Compare with POST /weight_checker instead."
        )
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    seen: set[int] = set()  # a tied lm_head shares the embedding's parameter: list it once
    for module_name, module in model.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        parent = module_name[: -len(leaf)]
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            tensor = _served_tensor(module, param_name, param, materialize)
            if leaf in packed and hasattr(module, "output_sizes"):
                dim = getattr(param, "output_dim", 0)
                parts = tensor.split(list(module.output_sizes), dim=dim)
                for sub_name, part in zip(packed[leaf], parts, strict=True):
                    yield f"{parent}{sub_name}.{param_name}", part
            elif isinstance(module, VocabParallelEmbedding):
                yield full_name, tensor[: module.num_embeddings]
            else:
                yield full_name, tensor


def _served_tensor(
    module: torch.nn.Module, param_name: str, param: torch.Tensor, materialize: bool
) -> torch.Tensor:
    """`param` itself, except for linear weights that vLLM's CPU backend moved into a kernel.

    On CPU, vLLM repacks each linear weight into a oneDNN/SGL kernel and leaves an empty
    `weight`. The served matrix is read back through the kernel itself, from identity rows: each
    output element is a single product with 1.0, so the result is exact.
    """
    cpu_linear = getattr(module, "cpu_linear", None)
    if param_name != "weight" or param.numel() != 0 or cpu_linear is None:
        return param if materialize else torch.empty(param.shape, dtype=param.dtype, device="meta")
    rows = getattr(module, "output_size_per_partition", None) or module.output_size
    cols = getattr(module, "input_size_per_partition", None) or module.input_size
    if not materialize:
        return torch.empty((rows, cols), dtype=param.dtype, device="meta")
    transposed = torch.empty((cols, rows), dtype=param.dtype)
    chunk = 1024
    with torch.no_grad():
        for start in range(0, cols, chunk):
            stop = min(start + chunk, cols)
            identity = torch.zeros((stop - start, cols), dtype=param.dtype)
            identity[torch.arange(stop - start), torch.arange(start, stop)] = 1
            transposed[start:stop] = cpu_linear(identity, param, None)
    return transposed.t()
