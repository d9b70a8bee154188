"""Llama (LlamaForCausalLM): no biases, no q/k norm, dense SwiGLU MLP."""

from __future__ import annotations

from typing import Any

from vime.megatron.converters.base import DecoderConverter


class LlamaConverter(DecoderConverter):
    architecture = "LlamaForCausalLM"

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        super().check_config(hf_config)
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, flag, False):
                raise ValueError(f"{cls.architecture}: {flag}=True is not supported")
