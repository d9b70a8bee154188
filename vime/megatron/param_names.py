"""What a user's Megatron model holds to sync, under canonical names: any spec, any wrapping, VPP.

Megatron-core builds the same GPTModel under two sets of names. The local layer spec has
`input_layernorm.weight`, `pre_mlp_layernorm.weight` and `mlp.experts.local_experts.<i>.*`
(SequentialMLP). The Transformer Engine spec fuses each norm into the linear after it
(`self_attention.linear_qkv.layer_norm_weight`, and for dense MLPs
`mlp.linear_fc1.layer_norm_weight`) and holds grouped experts as one tensor per local expert
(`mlp.experts.linear_fc1.weight<i>`, TEGroupedMLP). Every other name (shared experts, router,
q/k norms, biases) is the same in both. `canonical_suffix` renames TE's to the local spec's, so
converters know one set of names.

A model arrives as Megatron hands it: one chunk or a list of chunks (one per virtual pipeline
stage), each maybe wrapped in DDP / Float16Module. `sync_tensors(model, ...)` lists this rank's
tensors to sync (parameters, and the router's persistent `expert_bias` buffer) with their
canonical full names (global layer index), how each is sharded, and its full shape, checked
against the converter; every name the converter cannot map is collected and raised at once
(`UnmappedParametersError`), before any byte moves.

How a tensor is sharded is read from its role, not from attributes: megatron sets
`tensor_model_parallel` / `partition_dim` only while it initialises weights, and TE's grouped
experts carry a wrong `partition_dim` when expert parallelism is on.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vime.megatron.converters.base import EMBEDDING, OUTPUT_LAYER, DecoderConverter
from vime.megatron.topology import Topology

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")

# Transformer Engine spec suffix (within a layer) -> local spec suffix.
_TE_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r"input_layernorm.\1"),
    (re.compile(r"^mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r"pre_mlp_layernorm.\1"),
    (
        re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$"),
        r"mlp.experts.local_experts.\3.\1.\2",
    ),
)
# Canonical layer suffixes split over tensor parallelism: column-parallel (dim 0) and
# row-parallel (dim 1) linears; matched after an expert prefix is removed.
_COLUMN_PARALLEL = re.compile(
    r"^(self_attention\.linear_qkv|(mlp\.|mlp\.shared_experts\.)?linear_fc1)\.(weight|bias)$"
)
_ROW_PARALLEL = re.compile(
    r"^(self_attention\.linear_proj|(mlp\.|mlp\.shared_experts\.)?linear_fc2)\.weight$"
)
# Buffers that are weights the engine serves (the rest are caches and counters).
_SYNCED_BUFFERS = re.compile(r"\.router\.expert_bias$")


class UnmappedParametersError(ValueError):
    """Names in the model that the architecture's converter cannot map to HF tensors."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


def model_chunks(model: torch.nn.Module | Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The unwrapped chunks of a model or model list (megatron's one chunk per virtual stage)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("the model list is empty")
    return [unwrap(chunk) for chunk in chunks]


def padded_vocab_size(chunks: Sequence[torch.nn.Module], tp_size: int) -> int:
    """The model's (padded) vocabulary: GPTModel's `vocab_size`, else its embedding rows x TP."""
    for chunk in chunks:
        size = getattr(chunk, "vocab_size", None)
        if isinstance(size, int):
            return size
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                return int(param.shape[0]) * tp_size
    raise ValueError("the model has no vocab_size and no embedding or output layer on this rank")


def canonical_suffix(suffix: str) -> tuple[str, bool]:
    """A layer suffix under local-spec names, and whether it was a Transformer Engine name."""
    for pattern, replacement in _TE_RENAMES:
        if pattern.match(suffix):
            return pattern.sub(replacement, suffix), True
    return suffix, False


@dataclass(frozen=True)
class SyncTensor:
    """One tensor of this rank to sync, and what gathering it takes.

    `full_names`: the canonical full names it becomes: one, or for an expert one per EP rank
    (local expert j of EP rank r is global expert r * num_local + j), in EP rank order.
    `axis`: the parallel axis it is split over ("tp", "expert_tp") or None (replicated), along
    `partition_dim`; `glu`: a [gate; up] fc1, whose shards interleave (see sharding.py).
    """

    chunk: int
    local_name: str
    tensor: torch.Tensor
    full_names: tuple[str, ...]
    full_shape: tuple[int, ...]
    axis: str | None
    partition_dim: int
    glu: bool

    @property
    def is_expert(self) -> bool:
        return len(self.full_names) > 0 and ".mlp.experts." in self.full_names[0]


def _split_axis(suffix: str, expert: bool) -> tuple[str | None, int]:
    """(axis, partition_dim) of a canonical layer suffix (an expert's without its prefix)."""
    axis = "expert_tp" if expert else "tp"
    if _COLUMN_PARALLEL.match(suffix):
        return axis, 0
    if _ROW_PARALLEL.match(suffix):
        return axis, 1
    return None, 0


def _local_tensors(chunk: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    tensors = [(name, param) for name, param in chunk.named_parameters()]
    tensors += [(n, b) for n, b in chunk.named_buffers() if _SYNCED_BUFFERS.search(n)]
    return tensors


def sync_tensors(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    converter: DecoderConverter,
    topology: Topology,
    with_tied_copy: bool = False,
) -> tuple[list[SyncTensor], str]:
    """This rank's tensors to sync, in a fixed order (chunk, then module order), and the layout
    seen: "transformer_engine" when some name was TE's own, else "local". Ranks of one stage
    list the same local names in the same order, so they run the same gathers. The last stage's
    copy of a tied embedding maps to no HF tensor of its own and is left out unless
    `with_tied_copy` (checkpoint loading).

    Raises UnmappedParametersError listing every name the converter cannot map, and ValueError
    for a tensor whose full shape is not the checkpoint's (wrong HF config, or a sharding vime
    does not know).
    """
    chunks = model_chunks(model)
    num_experts = converter.dims.num_experts
    num_local_experts = num_experts // topology.ep_size if num_experts else 0
    layouts: set[str] = set()
    unmapped: list[str] = []
    out: list[SyncTensor] = []
    for index, chunk in enumerate(chunks):
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        for local_name, tensor in _local_tensors(chunk):
            full_names, suffix, expert = _full_names(
                local_name, layers, topology, num_local_experts, layouts
            )
            if not all(converter.maps(name) for name in full_names):
                unmapped.append(
                    local_name
                    if full_names[0] == local_name
                    else f"{local_name} (as {full_names[0]})"
                )
                continue
            tied_copy = full_names[0] == OUTPUT_LAYER and converter.dims.tie_word_embeddings
            if tied_copy and not with_tied_copy:
                continue
            axis: str | None
            if full_names[0] in (EMBEDDING, OUTPUT_LAYER):
                axis, dim = "tp", 0  # vocab-parallel rows
            else:
                axis, dim = _split_axis(suffix, expert)
            size = {"tp": topology.tp_size, "expert_tp": topology.expert_tp_size, None: 1}[axis]
            shape = list(tensor.shape)
            if shape:
                shape[dim] *= size
            expected = converter.full_shape(full_names[0])
            if tuple(shape) != expected:
                raise ValueError(
                    f"{converter.architecture}: {local_name} (chunk {index}) holds "
                    f"{tuple(tensor.shape)}, i.e. {tuple(shape)} over {axis or 'no axis'}="
                    f"{size}, but the HF config gives {full_names[0]} the shape {expected}: "
                    f"is the HF checkpoint the model's, and the topology ({topology.describe()}) "
                    "the model's?"
                )
            out.append(
                SyncTensor(
                    chunk=index,
                    local_name=local_name,
                    tensor=tensor,
                    full_names=full_names,
                    full_shape=expected,
                    axis=axis,
                    partition_dim=dim,
                    glu=converter.is_glu(full_names[0]),
                )
            )
    layout = "transformer_engine" if layouts else "local"
    if unmapped:
        raise UnmappedParametersError(
            f"{converter.architecture} ({layout} layer names): "
            f"{len(unmapped)} tensors of the model have no HF mapping, nothing was sent: "
            f"{unmapped}"
        )
    return out, layout


def _full_names(
    local_name: str,
    layers: Any,
    topology: Topology,
    num_local_experts: int,
    layouts: set[str],
) -> tuple[tuple[str, ...], str, bool]:
    """(canonical full names, canonical suffix without an expert prefix, is an expert)."""
    match = _LAYER.match(local_name)
    if match is None:
        return (local_name,), local_name, False
    local_layer, suffix = int(match.group(1)), match.group(2)
    suffix, from_te = canonical_suffix(suffix)
    if from_te:
        layouts.add("transformer_engine")
    layer = layers[local_layer].layer_number - 1  # megatron's global 1-based layer number
    expert_match = _EXPERT.match(suffix)
    if expert_match is None:
        return (f"decoder.layers.{layer}.{suffix}",), suffix, False
    local_expert, expert_suffix = int(expert_match.group(1)), expert_match.group(2)
    names = tuple(
        f"decoder.layers.{layer}.mlp.experts.local_experts."
        f"{ep_rank * num_local_experts + local_expert}.{expert_suffix}"
        for ep_rank in range(topology.ep_size)
    )
    return names, expert_suffix, True
