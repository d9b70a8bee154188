"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, every layer a top-k softmax MoE.

Megatron `mlp.router.weight` is HF `mlp.gate.weight`; expert e's `linear_fc1` is
[gate_proj; up_proj] of HF `mlp.experts.{e}` (per-expert names, as checkpoints and vLLM store
them). No shared expert.
"""

from __future__ import annotations

from vime.megatron.converters.qwen3 import Qwen3Converter


class Qwen3MoeConverter(Qwen3Converter):
    architecture = "Qwen3MoeForCausalLM"
    moe = True
