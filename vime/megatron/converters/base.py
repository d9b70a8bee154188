"""Name and layout mapping between a Megatron-core GPTModel and a Llama-style HF checkpoint.

Megatron names here are *full* names: unsharded tensors (as at TP=1), global layer indices (as at
PP=1) and global expert indices (as at EP=1), e.g. `decoder.layers.7.mlp.experts.local_experts.5
.linear_fc1.weight`. Sharding and gathering are `vime.megatron.sharding` / `gather`'s business;
converters are pure tensor functions and never talk to other ranks.

A family subclasses `DecoderConverter`, names its HF architecture and flips the feature flags.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vime.megatron.converters.layouts import merge_glu, merge_qkv, split_glu, split_qkv

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"

# megatron layer suffix -> (HF layer suffixes, layout); layouts: copy, qkv, glu
_LAYER_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "copy"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "copy"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "copy"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "copy"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "copy"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "copy"),
    "mlp.router.weight": (("mlp.gate.weight",), "copy"),
}
_EXPERT_RULES: dict[str, tuple[tuple[str, ...], str]] = {
    "linear_fc1": (("gate_proj.weight", "up_proj.weight"), "glu"),
    "linear_fc2": (("down_proj.weight",), "copy"),
}


@dataclass(frozen=True)
class ModelDims:
    """The sizes of a decoder, read once from the HF config."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    padded_vocab_size: int
    tie_word_embeddings: bool
    norm_epsilon: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_norm_topk_prob: bool = True


def _rope_theta(hf_config: Any) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported; only 'default' RoPE is")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("the HF config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


class DecoderConverter:
    """Megatron GPTModel (local spec, RMSNorm, SwiGLU, RoPE) <-> HF Llama-style decoder."""

    architecture: ClassVar[str] = ""
    qkv_bias: ClassVar[bool] = False
    qk_layernorm: ClassVar[bool] = False
    moe: ClassVar[bool] = False

    def __init__(self, hf_config: Any, *, padded_vocab_size: int | None = None) -> None:
        self.check_config(hf_config)
        self.hf_config = hf_config
        vocab_size = int(hf_config.vocab_size)
        padded = vocab_size if padded_vocab_size is None else int(padded_vocab_size)
        if padded < vocab_size:
            raise ValueError(f"padded_vocab_size={padded} is smaller than vocab_size={vocab_size}")
        num_heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        moe_fields: dict[str, Any] = {}
        if self.moe:
            moe_fields = {
                "num_experts": int(hf_config.num_experts),
                "moe_ffn_hidden_size": int(hf_config.moe_intermediate_size),
                "moe_router_topk": int(hf_config.num_experts_per_tok),
                "moe_norm_topk_prob": bool(hf_config.norm_topk_prob),
            }
        self.dims = ModelDims(
            num_layers=int(hf_config.num_hidden_layers),
            hidden_size=int(hf_config.hidden_size),
            num_attention_heads=num_heads,
            num_query_groups=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(hf_config.intermediate_size),
            vocab_size=vocab_size,
            padded_vocab_size=padded,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            norm_epsilon=float(hf_config.rms_norm_eps),
            rope_theta=_rope_theta(hf_config),
            max_position_embeddings=int(hf_config.max_position_embeddings),
            **moe_fields,
        )

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Raise ValueError for HF config features this converter does not map."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{cls.architecture}: hidden_act={act!r}; only 'silu' is supported")
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError(f"{cls.architecture}: use_sliding_window=True is not supported")

    # ---- names and shapes -------------------------------------------------------------------

    def megatron_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every full Megatron parameter of a PP=1 model, in GPTModel.named_parameters() order.

        With tied embeddings `output_layer.weight` is not listed: at PP=1 it does not exist, and
        at PP>1 the last stage's copy maps to no HF tensor (see `to_hf`).
        """
        d = self.dims
        qkv_rows = (d.num_attention_heads + 2 * d.num_query_groups) * d.head_dim
        shapes: list[tuple[str, tuple[int, ...]]] = [
            (EMBEDDING, (d.padded_vocab_size, d.hidden_size))
        ]
        for layer in range(d.num_layers):
            prefix = f"decoder.layers.{layer}."
            layer_shapes = [
                ("input_layernorm.weight", (d.hidden_size,)),
                (
                    "self_attention.linear_proj.weight",
                    (d.hidden_size, d.num_attention_heads * d.head_dim),
                ),
                ("self_attention.linear_qkv.weight", (qkv_rows, d.hidden_size)),
            ]
            if self.qkv_bias:
                layer_shapes.append(("self_attention.linear_qkv.bias", (qkv_rows,)))
            if self.qk_layernorm:
                layer_shapes.append(("self_attention.q_layernorm.weight", (d.head_dim,)))
                layer_shapes.append(("self_attention.k_layernorm.weight", (d.head_dim,)))
            layer_shapes.append(("pre_mlp_layernorm.weight", (d.hidden_size,)))
            if self.moe:
                layer_shapes.append(("mlp.router.weight", (d.num_experts, d.hidden_size)))
                for expert in range(d.num_experts):
                    expert_prefix = f"mlp.experts.local_experts.{expert}."
                    layer_shapes.append(
                        (
                            expert_prefix + "linear_fc1.weight",
                            (2 * d.moe_ffn_hidden_size, d.hidden_size),
                        )
                    )
                    layer_shapes.append(
                        (
                            expert_prefix + "linear_fc2.weight",
                            (d.hidden_size, d.moe_ffn_hidden_size),
                        )
                    )
            else:
                layer_shapes.append(
                    ("mlp.linear_fc1.weight", (2 * d.ffn_hidden_size, d.hidden_size))
                )
                layer_shapes.append(("mlp.linear_fc2.weight", (d.hidden_size, d.ffn_hidden_size)))
            shapes.extend((prefix + name, shape) for name, shape in layer_shapes)
        shapes.append((FINAL_NORM, (d.hidden_size,)))
        if not d.tie_word_embeddings:
            shapes.append((OUTPUT_LAYER, (d.padded_vocab_size, d.hidden_size)))
        return shapes

    def _rule(self, name: str) -> tuple[tuple[str, ...], str]:
        """(HF names, layout) of a full Megatron name; layouts: copy, qkv, glu, vocab."""
        if name == EMBEDDING:
            return ("model.embed_tokens.weight",), "vocab"
        if name == FINAL_NORM:
            return ("model.norm.weight",), "copy"
        if name == OUTPUT_LAYER:
            if self.dims.tie_word_embeddings:
                return ("model.embed_tokens.weight",), "vocab"
            return ("lm_head.weight",), "vocab"
        layer_match = _LAYER.match(name)
        if layer_match is not None:
            layer, suffix = int(layer_match.group(1)), layer_match.group(2)
            hf_prefix = f"model.layers.{layer}."
            if layer < self.dims.num_layers:
                expert_match = _EXPERT.match(suffix)
                if expert_match is not None and self.moe:
                    expert = int(expert_match.group(1))
                    if expert < self.dims.num_experts:
                        hf_names, layout = _EXPERT_RULES[expert_match.group(2)]
                        expert_prefix = f"{hf_prefix}mlp.experts.{expert}."
                        return tuple(expert_prefix + n for n in hf_names), layout
                elif suffix in _LAYER_RULES and self._has_layer_param(suffix):
                    hf_names, layout = _LAYER_RULES[suffix]
                    return tuple(hf_prefix + n for n in hf_names), layout
        raise ValueError(f"{self.architecture}: no HF mapping for Megatron parameter {name!r}")

    def _has_layer_param(self, suffix: str) -> bool:
        if suffix == "self_attention.linear_qkv.bias":
            return self.qkv_bias
        if suffix.startswith(("self_attention.q_layernorm", "self_attention.k_layernorm")):
            return self.qk_layernorm
        if suffix == "mlp.router.weight":
            return self.moe
        if suffix.startswith("mlp.linear_fc"):
            return not self.moe
        return True

    def hf_names(self, name: str) -> tuple[str, ...]:
        """The HF tensors the full Megatron parameter `name` is built from."""
        return self._rule(name)[0]

    @staticmethod
    def is_glu(name: str) -> bool:
        """Whether a parameter is a gated fc1 ([gate; up]); TP shard r is then [gate_r; up_r]."""
        return name.endswith("linear_fc1.weight")

    # ---- conversion -------------------------------------------------------------------------

    def to_hf(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A full Megatron parameter -> its HF (name, tensor) pairs; vocab padding is dropped."""
        hf_names, layout = self._rule(name)
        if name == OUTPUT_LAYER and self.dims.tie_word_embeddings:
            return []  # the last PP stage's copy of the tied embedding
        if layout == "qkv":
            parts = split_qkv(
                tensor,
                num_attention_heads=self.dims.num_attention_heads,
                num_query_groups=self.dims.num_query_groups,
            )
            return list(zip(hf_names, parts, strict=True))
        if layout == "glu":
            return list(zip(hf_names, split_glu(tensor), strict=True))
        if layout == "vocab":
            return [(hf_names[0], tensor[: self.dims.vocab_size])]
        return [(hf_names[0], tensor)]

    def to_megatron(
        self, name: str, hf_tensor: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """Build the full Megatron parameter `name` from HF tensors (a mapping or a getter)."""
        get = hf_tensor.__getitem__ if isinstance(hf_tensor, Mapping) else hf_tensor
        hf_names, layout = self._rule(name)
        parts = [get(hf_name) for hf_name in hf_names]
        if layout == "qkv":
            return merge_qkv(*parts, num_query_groups=self.dims.num_query_groups)
        if layout == "glu":
            return merge_glu(*parts)
        if layout == "vocab":
            (embedding,) = parts
            num_pad = self.dims.padded_vocab_size - embedding.shape[0]
            if num_pad == 0:
                return embedding
            padding = embedding.new_zeros((num_pad, *embedding.shape[1:]))
            return torch.cat([embedding, padding], dim=0)
        return parts[0]

    # ---- whole state dicts (tests, offline conversion) ----------------------------------------

    def hf_to_megatron_state_dict(
        self, hf_state: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Full HF state dict -> full Megatron state dict (PP=1 names)."""
        return {name: self.to_megatron(name, hf_state) for name, _ in self.megatron_shapes()}

    def megatron_to_hf_state_dict(
        self, state: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Full Megatron state dict -> HF state dict."""
        hf_state: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            hf_state.update(self.to_hf(name, tensor))
        return hf_state
