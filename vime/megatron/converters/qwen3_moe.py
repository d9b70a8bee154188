"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, every layer a top-k softmax MoE.

Megatron `mlp.router.weight` is HF `mlp.gate.weight`; expert e's `linear_fc1` is
[gate_proj; up_proj] of HF `mlp.experts.{e}` (per-expert names, as checkpoints and vLLM store
them). No shared expert.
"""

from __future__ import annotations

from typing import Any

from vime.megatron.converters.qwen3 import Qwen3Converter


class Qwen3MoeConverter(Qwen3Converter):
    architecture = "Qwen3MoeForCausalLM"
    moe = True

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        sparse_step = getattr(hf_config, "decoder_sparse_step", 1)
        dense_layers = list(getattr(hf_config, "mlp_only_layers", None) or [])
        if sparse_step != 1 or dense_layers:
            raise ValueError(
                f"{cls.architecture}: only all-MoE decoders are supported; got "
                f"decoder_sparse_step={sparse_step}, mlp_only_layers={dense_layers}"
            )
