"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2 attention (q/k/v bias), every layer a top-k softmax MoE
with one shared expert whose output a sigmoid gate scales.

Megatron `mlp.router.weight` is HF `mlp.gate.weight`; routed expert e's `linear_fc1` is
[gate_proj; up_proj] of HF `mlp.experts.{e}` (per-expert names, as checkpoints and vLLM store
them); `mlp.shared_experts.linear_fc1/fc2` is HF `mlp.shared_expert.*` and
`mlp.shared_experts.gate_weight` ([1, hidden]) is HF `mlp.shared_expert_gate.weight`.
Routing: softmax over all experts, top-k, renormalised only with norm_topk_prob (megatron's
moe_router_pre_softmax when it is off).
"""

from __future__ import annotations

from typing import Any

from vime.megatron.converters.base import DecoderConverter


class Qwen2MoeConverter(DecoderConverter):
    architecture = "Qwen2MoeForCausalLM"
    qkv_bias = True
    moe = True
    shared_expert_prefix = "mlp.shared_expert."
    shared_expert_gate = True

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        if not getattr(hf_config, "qkv_bias", True):
            raise ValueError(f"{cls.architecture}: qkv_bias=False is not supported")
        if not getattr(hf_config, "shared_expert_intermediate_size", 0):
            raise ValueError(f"{cls.architecture}: shared_expert_intermediate_size must be > 0")

    @classmethod
    def moe_dims(cls, hf_config: Any) -> dict[str, Any]:
        return {
            **super().moe_dims(hf_config),
            "shared_expert_ffn_hidden_size": int(hf_config.shared_expert_intermediate_size),
        }
