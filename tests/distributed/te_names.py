"""A local-spec GPTModel presented under Transformer Engine spec names (Transformer Engine cannot be
installed on a CPU machine, so the TE layout is checked by names).

The renames follow megatron-core 0.16.1's TE spec as its source builds it
(`models/gpt/gpt_layer_specs.py::get_gpt_layer_with_transformer_engine_spec`,
`extensions/transformer_engine.py`):
- `input_layernorm` is IdentityOp; the norm is TELayerNormColumnParallelLinear's, named
  `self_attention.linear_qkv.layer_norm_weight`;
- a dense layer's `pre_mlp_layernorm` is IdentityOp; the norm is `mlp.linear_fc1.layer_norm_weight`
  (an MoE layer keeps its own `pre_mlp_layernorm`, a TENorm);
- TEGroupedMLP (moe_grouped_gemm) holds expert i's fc1/fc2 as `mlp.experts.linear_fc1.weight<i>`
  / `mlp.experts.linear_fc2.weight<i>` (TE GroupedLinear registers `weight{i}`);
- every other name (qkv, proj, q/k norms, router and its expert_bias, shared experts, final norm,
  embedding, output layer) is the same in both specs.
The tensors are the model's own (same storage), so a gather through this view must give the
local-spec gather's tensors bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_LOCAL_EXPERT = re.compile(
    r"^(decoder\.layers\.\d+\.)mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"
)


def te_name(name: str, *, moe_layer: bool) -> str:
    """The TE spec's name of a local-spec parameter name."""
    match = _LOCAL_EXPERT.match(name)
    if match is not None:
        prefix, expert, linear = match.groups()
        return f"{prefix}mlp.experts.{linear}.weight{expert}"
    if name.endswith(".input_layernorm.weight"):
        return name.replace(
            ".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"
        )
    if name.endswith(".pre_mlp_layernorm.weight") and not moe_layer:
        return name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
    return name


class TENamedModel(torch.nn.Module):
    """Forwards everything to a GPTModel but names its tensors as the TE spec would."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_gpt", gpt)  # not a submodule: its names must not show
        self._moe = getattr(gpt.config, "num_moe_experts", None) is not None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_gpt"], name)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator:
        for name, param in self.__dict__["_gpt"].named_parameters(
            prefix, recurse, remove_duplicate
        ):
            yield te_name(name, moe_layer=self._moe), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator:
        yield from self.__dict__["_gpt"].named_buffers(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator:
        return self.__dict__["_gpt"].parameters(recurse)
