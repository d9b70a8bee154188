"""Qwen2 (Qwen2ForCausalLM): bias on q/k/v only, dense SwiGLU MLP."""

from __future__ import annotations

from vime.megatron.converters.base import DecoderConverter


class Qwen2Converter(DecoderConverter):
    architecture = "Qwen2ForCausalLM"
    qkv_bias = True
