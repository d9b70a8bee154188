"""Megatron <-> HF converters, looked up by the HF architecture name (config.architectures[0]).

    from vime.megatron.converters import get_converter
    converter = get_converter(hf_config, padded_vocab_size=512)
    hf_pairs = converter.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", qkv)

The registry is explicit: a new family adds one module and one line here.
"""

from __future__ import annotations

from typing import Any

from vime.megatron.converters.base import DecoderConverter, ModelDims
from vime.megatron.converters.llama import LlamaConverter
from vime.megatron.converters.mistral import MistralConverter
from vime.megatron.converters.qwen2 import Qwen2Converter
from vime.megatron.converters.qwen2_moe import Qwen2MoeConverter
from vime.megatron.converters.qwen3 import Qwen3Converter
from vime.megatron.converters.qwen3_moe import Qwen3MoeConverter

CONVERTERS: dict[str, type[DecoderConverter]] = {
    "LlamaForCausalLM": LlamaConverter,
    "MistralForCausalLM": MistralConverter,
    "Qwen2ForCausalLM": Qwen2Converter,
    "Qwen2MoeForCausalLM": Qwen2MoeConverter,
    "Qwen3ForCausalLM": Qwen3Converter,
    "Qwen3MoeForCausalLM": Qwen3MoeConverter,
}


def architecture_of(hf_config: Any) -> str:
    """The single HF architecture name of a config."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if len(architectures) != 1:
        raise ValueError(
            f"expected exactly one entry in config.architectures, got {architectures}; "
            f"registered: {sorted(CONVERTERS)}"
        )
    return architectures[0]


def get_converter(hf_config: Any, *, padded_vocab_size: int | None = None) -> DecoderConverter:
    """The converter of an HF config; ValueError for an architecture that is not registered."""
    architecture = architecture_of(hf_config)
    if architecture not in CONVERTERS:
        raise ValueError(
            f"no Megatron converter for architecture {architecture!r}; "
            f"registered: {sorted(CONVERTERS)}"
        )
    return CONVERTERS[architecture](hf_config, padded_vocab_size=padded_vocab_size)


__all__ = ["CONVERTERS", "DecoderConverter", "ModelDims", "architecture_of", "get_converter"]
