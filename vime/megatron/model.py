"""Build a Megatron-core GPTModel from an HF config, load the HF checkpoint into it, run it.

The trainer must start from exactly the weights the rollout engine serves, so the model is built
from the HF config (local layer spec, no Transformer Engine) and filled from the HF safetensors.

    dist.init_process_group("gloo", ...)                # or nccl on GPUs
    topology = initialize_model_parallel(tp=2, pp=1)    # parallel_state + CPU shims
    hf_config = load_hf_config(model_dir)
    converter = get_converter(hf_config, padded_vocab_size=pad_vocab_size(hf_config.vocab_size, 2))
    model = build_gpt_model(converter, topology, params_dtype=torch.bfloat16)
    load_hf_checkpoint(model, model_dir, converter=converter, topology=topology)
    chunks = build_gpt_chunks(converter, topology)       # one per virtual pipeline stage
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

from vime.megatron.converters import DecoderConverter
from vime.megatron.cpu_shims import apply_cpu_shims
from vime.megatron.param_names import sync_tensors, unwrap
from vime.megatron.sharding import shard
from vime.megatron.topology import Topology

logger = logging.getLogger(__name__)

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def load_hf_config(hf_config_or_dir: Any) -> Any:
    """A transformers config object, from a config object or a checkpoint directory."""
    if isinstance(hf_config_or_dir, (str, Path)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(hf_config_or_dir))
    return hf_config_or_dir


def pad_vocab_size(vocab_size: int, tp_size: int, *, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of divisible_by * tp_size."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def initialize_model_parallel(
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    expert_tp: int | None = None,
    vp: int | None = None,
    timeout: timedelta = timedelta(minutes=5),
) -> Topology:
    """Set up megatron's parallel_state on an initialised torch.distributed; return the Topology.

    Every group megatron creates gets `timeout`, so a stuck collective fails instead of hanging.
    `vp`: virtual pipeline stages per pipeline rank (interleaved 1F1B; needs pp > 1).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise ValueError("torch.distributed must be initialised before megatron's parallel_state")
    apply_cpu_shims()
    # Validate the sizes (the error lists every degree) before megatron asserts on them.
    Topology.for_rank(
        dist.get_rank(), dist.get_world_size(), tp=tp, pp=pp, ep=ep, expert_tp=expert_tp, vp=vp
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
        distributed_timeout_minutes=max(1, round(timeout.total_seconds() / 60)),
    )
    return Topology.from_parallel_state()


def transformer_config(
    converter: DecoderConverter,
    topology: Topology,
    *,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
):
    """The TransformerConfig of the HF model behind `converter`; `overrides` win."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    d = converter.dims
    fields: dict[str, Any] = {
        "num_layers": d.num_layers,
        "hidden_size": d.hidden_size,
        "num_attention_heads": d.num_attention_heads,
        "num_query_groups": d.num_query_groups,
        "kv_channels": d.head_dim,
        "ffn_hidden_size": d.ffn_hidden_size,
        "normalization": "RMSNorm",
        "layernorm_epsilon": d.norm_epsilon,
        "gated_linear_unit": True,
        "activation_func": functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": converter.qkv_bias,
        "qk_layernorm": converter.qk_layernorm,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": topology.tp_size,
        "pipeline_model_parallel_size": topology.pp_size,
        "virtual_pipeline_model_parallel_size": topology.vp_size if topology.vp_size > 1 else None,
        "context_parallel_size": topology.cp_size,
        "expert_model_parallel_size": topology.ep_size,
        "expert_tensor_parallel_size": topology.expert_tp_size,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "fp16": params_dtype == torch.float16,
        # Random init on the CPU (replaced by load_hf_checkpoint). Keep perform_initialization:
        # with CPU init, megatron sets the tensor_model_parallel / partition_dim attributes of
        # embedding and linear weights only while initialising them.
        "use_cpu_initialization": True,
        # CPU-safe kernels: no fused/apex/TE paths.
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        # vime's losses arrive at megatron's schedule already normalised by the whole batch's
        # token (or, per-sequence, sample) count: micro-batches and DP ranks sum to the batch
        # mean, and the schedule must not divide again by the micro-batch count. (MoE aux
        # losses would then expect megatron's finalize_model_grads, which vime does not run;
        # their coefficients are 0 below.)
        "calculate_per_token_loss": True,
    }
    if topology.vp_size > 1:
        # Megatron-LM's default with interleaving. Batched p2p must be off at PP=2 on gloo: the
        # previous and next stage are the same peer, gloo matches messages per peer in posting
        # order, and a batch posts send_prev before recv_prev, so an activation arrives as a
        # gradient (no error, wrong gradients; measured). Unbatched ops order by rank parity.
        fields.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if converter.moe:
        fields.update(
            num_moe_experts=d.num_experts,
            moe_ffn_hidden_size=d.moe_ffn_hidden_size,
            moe_router_topk=d.moe_router_topk,
            # HF: softmax over all experts, top-k, renormalise (norm_topk_prob) ==
            # megatron: top-k of the logits, softmax over those k.
            moe_router_pre_softmax=not d.moe_norm_topk_prob,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_shared_expert_intermediate_size=d.shared_expert_ffn_hidden_size or None,
            moe_shared_expert_gate=converter.shared_expert_gate,
        )
    fields.update(overrides)
    return TransformerConfig(**fields)


def check_heads_split(num_heads: int, num_kv_heads: int, tp_size: int, field: str) -> None:
    """Megatron splits attention heads and KV groups over tensor-parallel ranks: `tp_size` must
    divide both. ValueError naming `field`, the rule and the sizes that would work."""
    if num_heads % tp_size or num_kv_heads % tp_size:
        fits = [
            tp for tp in range(1, num_heads + 1) if not num_heads % tp and not num_kv_heads % tp
        ]
        raise ValueError(
            f"{field}={tp_size} does not divide the model's {num_heads} attention heads and "
            f"{num_kv_heads} KV heads (megatron splits both over tensor-parallel ranks): use one "
            f"of {fits}"
        )


def check_layers_split(num_layers: int, pp_size: int, vp_size: int | None, field: str) -> None:
    """Megatron gives every (virtual) pipeline stage the same number of decoder layers:
    `pp_size * vp_size` must divide `num_layers`. ValueError naming `field`, the rule and the
    sizes that would work."""
    chunks = pp_size * (vp_size or 1)
    if num_layers % chunks:
        fits = [
            (pp, vp)
            for pp in range(2, num_layers + 1)
            for vp in (1, 2, 3, 4)
            if not num_layers % (pp * vp)
        ][:8]
        raise ValueError(
            f"{field}: pipeline_parallel_size={pp_size} x virtual_pipeline_parallel_size="
            f"{vp_size or 1} = {chunks} stages do not divide the model's {num_layers} decoder "
            "layers (megatron gives every virtual pipeline stage the same number): use one of "
            f"(pp, vpp) = {fits}"
        )


def build_gpt_chunks(
    converter: DecoderConverter,
    topology: Topology,
    *,
    params_dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> list[torch.nn.Module]:
    """This rank's model chunks: one GPTModel per virtual pipeline stage (one without VPP), each
    holding its layers and TP/EP shards, randomly initialised.

    Built on the CPU, then moved to the current CUDA device when there is one. Chunk k of pipeline
    rank p holds megatron's layers for (vp_stage k, pp_rank p); only the first stage's first chunk
    embeds and only the last stage's last chunk has the output layer.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    d = converter.dims
    check_heads_split(d.num_attention_heads, d.num_query_groups, topology.tp_size, "tp")
    config = transformer_config(converter, topology, params_dtype=params_dtype, **config_overrides)
    if d.padded_vocab_size % topology.tp_size != 0:
        raise ValueError(
            f"padded_vocab_size={d.padded_vocab_size} is not divisible by tp={topology.tp_size}; "
            "build the converter with padded_vocab_size=pad_vocab_size(vocab_size, tp)"
        )
    layer_spec = get_gpt_layer_local_spec(
        num_experts=d.num_experts if converter.moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=converter.qk_layernorm,
        normalization="RMSNorm",
    )
    chunks = []
    for vp_stage in range(topology.vp_size) if topology.vp_size > 1 else [None]:
        if vp_stage is None:
            pre, post = topology.is_first_stage, topology.is_last_stage
        else:
            pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=d.padded_vocab_size,
            max_sequence_length=d.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=d.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=d.rope_theta,
            vp_stage=vp_stage,
        )
        # Megatron builds norms in float32 whatever params_dtype is; its Float16Module casts the
        # whole module, and so do we, so every parameter has the checkpoint's dtype.
        model = model.to(dtype=params_dtype)
        if torch.cuda.is_available():
            model = model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def build_gpt_model(
    converter: DecoderConverter,
    topology: Topology,
    *,
    params_dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
):
    """This rank's GPTModel (its pipeline stage, its TP/EP shards), randomly initialised; for
    virtual pipeline stages use `build_gpt_chunks`."""
    if topology.vp_size > 1:
        raise ValueError(
            f"virtual pipeline stages ({topology.vp_size}) need one model per stage: "
            "call build_gpt_chunks"
        )
    (model,) = build_gpt_chunks(converter, topology, params_dtype=params_dtype, **config_overrides)
    return model


def full_param_names(model: torch.nn.Module, topology: Topology) -> dict[str, str]:
    """This rank's parameter names -> full names (global layer index, global expert index)."""
    model = unwrap(model)
    layers = model.decoder.layers
    names = {}
    for local_name, _ in model.named_parameters():
        full_name = local_name
        layer_match = _LOCAL_LAYER.match(local_name)
        if layer_match is not None:
            layer = layers[int(layer_match.group(1))]
            suffix = layer_match.group(2)
            expert_match = _LOCAL_EXPERT.match(suffix)
            if expert_match is not None:
                num_local = len(layer.mlp.experts.local_experts)
                expert = topology.ep_rank * num_local + int(expert_match.group(1))
                suffix = f"mlp.experts.local_experts.{expert}.{expert_match.group(2)}"
            full_name = f"decoder.layers.{layer.layer_number - 1}.{suffix}"
        names[local_name] = full_name
    return names


class _SafetensorsReader:
    """Lazy tensor getter over a single-file or sharded (index.json) safetensors checkpoint."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import safe_open

        index = hf_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            single = hf_dir / "model.safetensors"
            if not single.exists():
                raise ValueError(
                    f"no model.safetensors or model.safetensors.index.json in {hf_dir}"
                )
            with safe_open(str(single), "pt") as handle:
                weight_map = {name: single.name for name in handle.keys()}  # noqa: SIM118
        self._files = {
            file: safe_open(str(hf_dir / file), "pt") for file in sorted(set(weight_map.values()))
        }
        self._weight_map = weight_map

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._weight_map:
            raise ValueError(f"tensor {name!r} is not in the checkpoint")
        return self._files[self._weight_map[name]].get_tensor(name)


@torch.no_grad()
def load_hf_checkpoint(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    hf_dir: str | Path,
    *,
    converter: DecoderConverter,
    topology: Topology,
) -> None:
    """Copy this rank's shards of an HF safetensors checkpoint into `model` (HF -> Megatron).

    `model`: a chunk or the list of chunks, wrapped or not. Reads only the HF tensors this rank's
    tensors are built from; a tied embedding's last-stage copy is filled from the embedding. A
    checkpoint dtype that differs from the parameter dtype is cast (then the copy is no longer
    bit-identical).
    """
    read = _SafetensorsReader(Path(hf_dir))
    tensors, _ = sync_tensors(model, converter=converter, topology=topology, with_tied_copy=True)
    for item in tensors:
        full_name = item.full_names[topology.ep_rank if item.is_expert else 0]
        full = converter.to_megatron(full_name, read)
        if item.axis is not None:
            rank, size = (
                (topology.expert_tp_rank, topology.expert_tp_size)
                if item.axis == "expert_tp"
                else (topology.tp_rank, topology.tp_size)
            )
            full = shard(
                full, partition_dim=item.partition_dim, rank=rank, num_shards=size, glu=item.glu
            )
        if full.shape != item.tensor.shape:
            raise ValueError(
                f"{item.local_name} ({full_name}): checkpoint shard {tuple(full.shape)} != "
                f"parameter {tuple(item.tensor.shape)} ({topology.describe()})"
            )
        item.tensor.copy_(full)
    logger.info("loaded %d tensors from %s (%s)", len(tensors), hf_dir, topology.describe())


def build_from_hf(
    hf_dir: str | Path,
    topology: Topology,
    *,
    params_dtype: torch.dtype = torch.float32,
    vocab_divisible_by: int = 128,
    **config_overrides: Any,
) -> tuple[torch.nn.Module, DecoderConverter]:
    """One GPTModel (no virtual pipeline stages) of this rank's part of the HF checkpoint at
    `hf_dir`, loaded, and the converter it was built with (vocabulary padded for `topology`);
    `config_overrides` go to its TransformerConfig."""
    from vime.megatron.converters import get_converter

    hf_config = load_hf_config(hf_dir)
    padded = pad_vocab_size(hf_config.vocab_size, topology.tp_size, divisible_by=vocab_divisible_by)
    converter = get_converter(hf_config, padded_vocab_size=padded)
    model = build_gpt_model(converter, topology, params_dtype=params_dtype, **config_overrides)
    load_hf_checkpoint(model, hf_dir, converter=converter, topology=topology)
    return model, converter
