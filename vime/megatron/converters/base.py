"""Name and layout mapping between a Megatron-core GPTModel and a Llama-style HF checkpoint.

Megatron names here are *canonical full* names: local-spec module names (a Transformer Engine
model's fused norms and grouped experts are renamed to these first, see
`vime.megatron.param_names`), unsharded tensors (as at TP=1), global layer indices (as at PP=1)
and global expert indices (as at EP=1), e.g.
`decoder.layers.7.mlp.experts.local_experts.5.linear_fc1.weight`. Sharding and gathering are
`vime.megatron.sharding` / `gather`'s business; converters are pure tensor functions and never
talk to other ranks.

A family subclasses `DecoderConverter`, names its HF architecture and flips the feature flags;
`layer_params` is the one table of what a decoder layer holds, read by the name mapping, the
shapes and the round trip alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vime.megatron.converters.layouts import merge_glu, merge_qkv, split_glu, split_qkv

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"


@dataclass(frozen=True)
class LayerParam:
    """One parameter of a decoder layer: its Megatron suffix and full shape, the HF tensors it is
    built from (suffixes under `model.layers.<i>.`) and how (copy, qkv, glu)."""

    suffix: str
    shape: tuple[int, ...]
    hf_suffixes: tuple[str, ...]
    layout: str = "copy"


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
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert


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
    """Megatron GPTModel (RMSNorm, SwiGLU, RoPE) <-> HF Llama-style decoder."""

    architecture: ClassVar[str] = ""
    qkv_bias: ClassVar[bool] = False
    qk_layernorm: ClassVar[bool] = False
    moe: ClassVar[bool] = False
    # MoE only: a shared expert beside the routed ones, its HF module prefix, and whether a
    # sigmoid gate (megatron's moe_shared_expert_gate) scales its output.
    shared_expert_prefix: ClassVar[str] = ""
    shared_expert_gate: ClassVar[bool] = False

    def __init__(self, hf_config: Any, *, padded_vocab_size: int | None = None) -> None:
        self.check_config(hf_config)
        self.hf_config = hf_config
        vocab_size = int(hf_config.vocab_size)
        padded = vocab_size if padded_vocab_size is None else int(padded_vocab_size)
        if padded < vocab_size:
            raise ValueError(f"padded_vocab_size={padded} is smaller than vocab_size={vocab_size}")
        num_heads = int(hf_config.num_attention_heads)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
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
            **(self.moe_dims(hf_config) if self.moe else {}),
        )
        self._layer_table = {param.suffix: param for param in self.layer_params()}

    @classmethod
    def check_config(cls, hf_config: Any) -> None:
        """Raise ValueError for HF config features this converter does not map."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{cls.architecture}: hidden_act={act!r}; only 'silu' is supported")
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError(f"{cls.architecture}: use_sliding_window=True is not supported")
        if cls.moe:
            # Every decoder layer must be an MoE layer (Qwen-style config names).
            sparse_step = getattr(hf_config, "decoder_sparse_step", 1)
            dense_layers = list(getattr(hf_config, "mlp_only_layers", None) or [])
            if sparse_step != 1 or dense_layers:
                raise ValueError(
                    f"{cls.architecture}: only all-MoE decoders are supported; got "
                    f"decoder_sparse_step={sparse_step}, mlp_only_layers={dense_layers}"
                )

    @classmethod
    def moe_dims(cls, hf_config: Any) -> dict[str, Any]:
        """The MoE fields of ModelDims (Qwen-style config names; families override)."""
        return {
            "num_experts": int(hf_config.num_experts),
            "moe_ffn_hidden_size": int(hf_config.moe_intermediate_size),
            "moe_router_topk": int(hf_config.num_experts_per_tok),
            "moe_norm_topk_prob": bool(hf_config.norm_topk_prob),
        }

    # ---- the table ----------------------------------------------------------------------------

    def layer_params(self) -> list[LayerParam]:
        """Every parameter of one decoder layer (canonical Megatron suffixes), in module order."""
        d = self.dims
        qkv_rows = (d.num_attention_heads + 2 * d.num_query_groups) * d.head_dim
        params = [
            LayerParam("input_layernorm.weight", (d.hidden_size,), ("input_layernorm.weight",)),
            LayerParam(
                "self_attention.linear_proj.weight",
                (d.hidden_size, d.num_attention_heads * d.head_dim),
                ("self_attn.o_proj.weight",),
            ),
            LayerParam(
                "self_attention.linear_qkv.weight",
                (qkv_rows, d.hidden_size),
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                "qkv",
            ),
        ]
        if self.qkv_bias:
            params.append(
                LayerParam(
                    "self_attention.linear_qkv.bias",
                    (qkv_rows,),
                    ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                    "qkv",
                )
            )
        if self.qk_layernorm:
            params.append(
                LayerParam(
                    "self_attention.q_layernorm.weight", (d.head_dim,), ("self_attn.q_norm.weight",)
                )
            )
            params.append(
                LayerParam(
                    "self_attention.k_layernorm.weight", (d.head_dim,), ("self_attn.k_norm.weight",)
                )
            )
        params.append(
            LayerParam(
                "pre_mlp_layernorm.weight", (d.hidden_size,), ("post_attention_layernorm.weight",)
            )
        )
        params.extend(
            self.moe_params() if self.moe else self.mlp_params("mlp.", "mlp.", d.ffn_hidden_size)
        )
        return params

    def mlp_params(self, prefix: str, hf_prefix: str, ffn_hidden_size: int) -> list[LayerParam]:
        """A gated MLP: Megatron `<prefix>linear_fc1` ([gate; up]) and `linear_fc2`."""
        hidden = self.dims.hidden_size
        return [
            LayerParam(
                f"{prefix}linear_fc1.weight",
                (2 * ffn_hidden_size, hidden),
                (f"{hf_prefix}gate_proj.weight", f"{hf_prefix}up_proj.weight"),
                "glu",
            ),
            LayerParam(
                f"{prefix}linear_fc2.weight",
                (hidden, ffn_hidden_size),
                (f"{hf_prefix}down_proj.weight",),
            ),
        ]

    def moe_params(self) -> list[LayerParam]:
        """Router, routed experts (global indices) and the shared expert of an MoE layer."""
        d = self.dims
        params = [
            LayerParam("mlp.router.weight", (d.num_experts, d.hidden_size), ("mlp.gate.weight",))
        ]
        params.extend(self.router_extra_params())
        for expert in range(d.num_experts):
            params.extend(
                self.mlp_params(
                    f"mlp.experts.local_experts.{expert}.",
                    f"mlp.experts.{expert}.",
                    d.moe_ffn_hidden_size,
                )
            )
        if d.shared_expert_ffn_hidden_size:
            params.extend(
                self.mlp_params(
                    "mlp.shared_experts.",
                    self.shared_expert_prefix,
                    d.shared_expert_ffn_hidden_size,
                )
            )
            if self.shared_expert_gate:
                params.append(
                    LayerParam(
                        "mlp.shared_experts.gate_weight",
                        (1, d.hidden_size),
                        ("mlp.shared_expert_gate.weight",),
                    )
                )
        return params

    def router_extra_params(self) -> list[LayerParam]:
        """Router tensors beside its weight (e.g. an expert bias); none by default."""
        return []

    # ---- names and shapes -------------------------------------------------------------------

    def megatron_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every full Megatron tensor of a PP=1 model (canonical names), in module order.

        With tied embeddings `output_layer.weight` is not listed: at PP=1 it does not exist, and
        at PP>1 the last stage's copy maps to no HF tensor (see `to_hf`).
        """
        d = self.dims
        shapes: list[tuple[str, tuple[int, ...]]] = [
            (EMBEDDING, (d.padded_vocab_size, d.hidden_size))
        ]
        for layer in range(d.num_layers):
            shapes.extend(
                (f"decoder.layers.{layer}.{param.suffix}", param.shape)
                for param in self._layer_table.values()
            )
        shapes.append((FINAL_NORM, (d.hidden_size,)))
        if not d.tie_word_embeddings:
            shapes.append((OUTPUT_LAYER, (d.padded_vocab_size, d.hidden_size)))
        return shapes

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The full shape of a canonical Megatron name (ValueError if it maps to nothing)."""
        if name in (EMBEDDING, OUTPUT_LAYER):
            self._rule(name)
            return (self.dims.padded_vocab_size, self.dims.hidden_size)
        if name == FINAL_NORM:
            return (self.dims.hidden_size,)
        layer_match = _LAYER.match(name)
        if layer_match is not None and int(layer_match.group(1)) < self.dims.num_layers:
            param = self._layer_table.get(layer_match.group(2))
            if param is not None:
                return param.shape
        raise self._unmapped(name)

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
            param = self._layer_table.get(suffix)
            if layer < self.dims.num_layers and param is not None:
                hf_prefix = f"model.layers.{layer}."
                return tuple(hf_prefix + n for n in param.hf_suffixes), param.layout
        raise self._unmapped(name)

    def _unmapped(self, name: str) -> ValueError:
        return ValueError(f"{self.architecture}: no HF mapping for Megatron parameter {name!r}")

    def maps(self, name: str) -> bool:
        """Whether the canonical full Megatron name has an HF mapping here."""
        try:
            self._rule(name)
        except ValueError:
            return False
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
