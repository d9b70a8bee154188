"""Qwen3 (Qwen3ForCausalLM): per-head RMSNorm on q and k, no biases, dense SwiGLU MLP."""

from __future__ import annotations

from typing import Any

from vime.megatron.converters.base import DecoderConverter


class Qwen3Converter(DecoderConverter):
    architecture = "Qwen3ForCausalLM"
    qk_layernorm = True

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        if getattr(hf_config, "attention_bias", False):
            raise ValueError(f"{cls.architecture}: attention_bias=True is not supported")
