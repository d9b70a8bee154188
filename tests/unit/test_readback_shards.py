"""`served_shards` against vLLM's own weight loaders, at tensor-parallel size 4.

Real vLLM layers (QKVParallelLinear with 4 query and 2 KV heads, so each KV head is replicated on
2 workers; MergedColumnParallelLinear gate/up; RowParallelLinear; VocabParallelEmbedding of 500
rows padded to 512, so the last worker holds 116 rows and 12 of padding) are built for each of the
4 workers (vLLM's TP rank functions patched, no process group) and loaded from whole HF tensors
by their own `weight_loader`. The slice `served_shards` reports for every worker must hold exactly
what vLLM loaded there, and the workers' slices together must cover every tensor.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from vime.weight_sync.engine.readback import served_shards

pytestmark = pytest.mark.unit

TP, HIDDEN, HEAD, HEADS, KV_HEADS, FFN, VOCAB = 4, 64, 16, 4, 2, 96, 500
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@contextlib.contextmanager
def tp_worker(rank: int):
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    import vllm.model_executor.parameter as parameter

    with contextlib.ExitStack() as stack:
        for module in (linear, vocab, parameter):
            for name, value in (
                ("get_tensor_model_parallel_world_size", TP),
                ("get_tensor_model_parallel_rank", rank),
            ):
                if hasattr(module, name):
                    stack.enter_context(mock.patch.object(module, name, return_value=value))
        yield


def whole_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD, HIDDEN),
        "model.layers.0.self_attn.q_proj.bias": (HEADS * HEAD,),
        "model.layers.0.self_attn.k_proj.bias": (KV_HEADS * HEAD,),
        "model.layers.0.self_attn.v_proj.bias": (KV_HEADS * HEAD,),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD),
        "model.layers.0.self_attn.o_proj.bias": (HIDDEN,),
        "model.layers.0.mlp.gate_proj.weight": (FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (FFN, HIDDEN),
    }
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def worker_model(rank: int, whole: dict[str, torch.Tensor]) -> torch.nn.Module:
    """One worker's layers, loaded from the whole tensors by vLLM's own weight loaders."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    f32 = torch.float32
    with set_current_vllm_config(VllmConfig()), tp_worker(rank):
        attn, mlp, layer, model, root = (torch.nn.Module() for _ in range(5))
        attn.qkv_proj = QKVParallelLinear(
            HIDDEN, HEAD, HEADS, KV_HEADS, bias=True, params_dtype=f32
        )
        attn.o_proj = RowParallelLinear(HEADS * HEAD, HIDDEN, bias=True, params_dtype=f32)
        mlp.gate_up_proj = MergedColumnParallelLinear(
            HIDDEN, [FFN, FFN], bias=False, params_dtype=f32
        )
        model.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=f32)
        layer.self_attn, layer.mlp = attn, mlp
        model.layers = torch.nn.ModuleList([layer])
        root.model = model
        root.packed_modules_mapping = PACKED
        prefix = "model.layers.0."
        for part in ("weight", "bias"):
            for shard_id in ("q", "k", "v"):
                loaded = whole[f"{prefix}self_attn.{shard_id}_proj.{part}"]
                attn.qkv_proj.weight_loader(getattr(attn.qkv_proj, part), loaded, shard_id)
            o_proj = attn.o_proj
            o_proj.weight_loader(getattr(o_proj, part), whole[f"{prefix}self_attn.o_proj.{part}"])
        for shard_id, name in enumerate(("gate_proj", "up_proj")):
            loaded = whole[f"{prefix}mlp.{name}.weight"]
            mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, loaded, shard_id)
        embed = model.embed_tokens
        embed.weight_loader(embed.weight, whole["model.embed_tokens.weight"])
    return root


def test_every_worker_reports_the_slice_vllm_loaded_into_it():
    whole = whole_tensors()
    covered: dict[str, torch.Tensor] = {
        n: torch.zeros(t.shape, dtype=torch.bool) for n, t in whole.items()
    }
    for rank in range(TP):
        served = {s.name: s for s in served_shards(worker_model(rank, whole))}
        assert served.keys() == whole.keys()
        for name, item in served.items():
            assert item.shape == tuple(whole[name].shape), name
            if item.shard is None:
                part, mark = whole[name], covered[name]
            else:
                part, mark = item.shard.take(whole[name]), item.shard.take(covered[name])
            assert torch.equal(item.tensor, part), (rank, name, item.shard)
            mark.fill_(True)
        # Worker 3 holds vocab rows 384:500 (its 12 padding rows are not served).
        if rank == TP - 1:
            assert served["model.embed_tokens.weight"].shard.to_list() == [0, 384, 500]
        # Two workers share each KV head: ranks 0, 1 hold head 0, ranks 2, 3 head 1.
        k_shard = served["model.layers.0.self_attn.k_proj.weight"].shard
        assert k_shard.to_list() == [0, (rank // 2) * HEAD, (rank // 2 + 1) * HEAD]
        # The row-parallel bias is whole on every worker.
        assert served["model.layers.0.self_attn.o_proj.bias"].shard is None
    assert all(bool(mark.all()) for mark in covered.values())
