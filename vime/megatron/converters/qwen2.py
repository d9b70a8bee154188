"""Qwen2 (Qwen2ForCausalLM): bias on q/k/v only, dense SwiGLU MLP."""

from __future__ import annotations

from typing import Any

from vime.megatron.converters.base import DecoderConverter


class Qwen2Converter(DecoderConverter):
    architecture = "Qwen2ForCausalLM"
    qkv_bias = True

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError(f"{cls.architecture}: use_sliding_window=True is not supported")
