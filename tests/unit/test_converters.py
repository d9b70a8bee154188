"""Megatron <-> HF converters and the pure layouts around them (no processes, no megatron state).

- every registered architecture: HF -> Megatron -> HF is bit-identical on a real tiny checkpoint;
- QKV grouping and GLU [gate; up] checked against hand-made tensors, also under TP sharding;
- unknown architectures and unmapped names fail with the registered names in the message;
- the full shapes the converter expects, mapped to HF on meta tensors, equal the checkpoint's;
- `Topology` validation and Megatron's default rank order.

    pytest -m unit tests/unit/test_converters.py
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from vime.megatron.converters import CONVERTERS, get_converter
from vime.megatron.converters.layouts import merge_glu, merge_qkv, split_glu, split_qkv
from vime.megatron.model import pad_vocab_size
from vime.megatron.sharding import shard, unshard
from vime.megatron.topology import Topology

pytestmark = pytest.mark.unit

PRESET_OF = {
    "Qwen2ForCausalLM": "qwen2-tiny",
    "Qwen3ForCausalLM": "qwen3-tiny",
    "LlamaForCausalLM": "llama-tiny",
    "Qwen3MoeForCausalLM": "qwen3-moe-tiny",
    "Qwen2MoeForCausalLM": "qwen2-moe-tiny",
    "MistralForCausalLM": "mistral-tiny",
}


@pytest.fixture(scope="module")
def checkpoints(model_builder):
    """(architecture, dtype) -> (hf_config, HF state dict) of the tiny preset."""
    out = {}
    for architecture, preset in PRESET_OF.items():
        for dtype in ("float32", "bfloat16"):
            model_dir = model_builder(preset, dtype)
            config = AutoConfig.from_pretrained(str(model_dir))
            out[architecture, dtype] = (config, load_file(model_dir / "model.safetensors"))
    return out


def test_every_registered_architecture_has_a_tiny_preset():
    assert set(CONVERTERS) == set(PRESET_OF)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("architecture", sorted(PRESET_OF))
@pytest.mark.parametrize("padded_vocab_size", [None, 576])
def test_hf_megatron_hf_roundtrip_is_bit_identical(
    checkpoints, architecture, dtype, padded_vocab_size
):
    config, hf_state = checkpoints[architecture, dtype]
    converter = get_converter(config, padded_vocab_size=padded_vocab_size)

    megatron_state = converter.hf_to_megatron_state_dict(hf_state)
    expected_shapes = dict(converter.megatron_shapes())
    assert {n: tuple(t.shape) for n, t in megatron_state.items()} == expected_shapes
    embedding = megatron_state["embedding.word_embeddings.weight"]
    assert torch.count_nonzero(embedding[config.vocab_size :]) == 0, "padding rows must be zero"

    roundtrip = converter.megatron_to_hf_state_dict(megatron_state)
    assert sorted(roundtrip) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert roundtrip[name].dtype == tensor.dtype, name
        assert torch.equal(roundtrip[name], tensor), name


def test_moe_names_map_router_and_global_experts(checkpoints):
    config, hf_state = checkpoints["Qwen3MoeForCausalLM", "float32"]
    converter = get_converter(config)
    router = converter.to_hf(
        "decoder.layers.1.mlp.router.weight", hf_state["model.layers.1.mlp.gate.weight"]
    )
    assert [name for name, _ in router] == ["model.layers.1.mlp.gate.weight"]
    fc1 = converter.to_megatron(
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", hf_state
    )
    gate = hf_state["model.layers.1.mlp.experts.3.gate_proj.weight"]
    up = hf_state["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))


def test_qkv_layout_is_grouped_per_query_group():
    # 4 query heads in 2 groups, head_dim 2, hidden 3; each row holds its own label.
    def rows(labels):
        return torch.tensor([[label] * 3 for label in labels], dtype=torch.float32)

    q = rows([10, 11, 20, 21, 30, 31, 40, 41])  # heads 1..4, two rows each
    k = rows([50, 51, 60, 61])  # kv heads 1..2
    v = rows([70, 71, 80, 81])
    qkv = merge_qkv(q, k, v, num_query_groups=2)
    expected = rows([10, 11, 20, 21, 50, 51, 70, 71, 30, 31, 40, 41, 60, 61, 80, 81])
    assert torch.equal(qkv, expected)
    for got, want in zip(
        split_qkv(qkv, num_attention_heads=4, num_query_groups=2), (q, k, v), strict=True
    ):
        assert torch.equal(got, want)
    # Bias: the same grouping on 1-D tensors.
    bias = merge_qkv(q[:, 0], k[:, 0], v[:, 0], num_query_groups=2)
    assert torch.equal(bias, expected[:, 0])
    # TP=2 gives each rank whole query groups: [q, k, v] of group 0, then of group 1.
    first = shard(qkv, partition_dim=0, rank=0, num_shards=2, glu=False)
    assert torch.equal(first, rows([10, 11, 20, 21, 50, 51, 70, 71]))


def test_glu_layout_and_its_tp_shards():
    gate = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    up = torch.tensor([[5.0], [6.0], [7.0], [8.0]])
    fc1 = merge_glu(gate, up)
    assert fc1[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert all(torch.equal(a, b) for a, b in zip(split_glu(fc1), (gate, up), strict=True))
    shards = [shard(fc1, partition_dim=0, rank=r, num_shards=2, glu=True) for r in range(2)]
    assert [s[:, 0].tolist() for s in shards] == [[1, 2, 5, 6], [3, 4, 7, 8]]
    assert torch.equal(unshard(shards, partition_dim=0, glu=True), fc1)
    # A plain concatenation of GLU shards would interleave gate and up: the bug to avoid.
    assert not torch.equal(torch.cat(shards), fc1)


def test_row_parallel_shards_roundtrip():
    full = torch.arange(24.0).reshape(4, 6)
    shards = [shard(full, partition_dim=1, rank=r, num_shards=3, glu=False) for r in range(3)]
    assert shards[1].tolist() == [[2, 3], [8, 9], [14, 15], [20, 21]]
    assert torch.equal(unshard(shards, partition_dim=1, glu=False), full)
    with pytest.raises(ValueError, match="does not split"):
        shard(full, partition_dim=0, rank=0, num_shards=3, glu=False)


def test_tied_embeddings_have_no_lm_head(checkpoints):
    config, hf_state = checkpoints["Qwen2ForCausalLM", "float32"]
    tied = copy.deepcopy(config)
    tied.tie_word_embeddings = True
    converter = get_converter(tied, padded_vocab_size=576)
    names = [name for name, _ in converter.megatron_shapes()]
    assert "output_layer.weight" not in names
    # The last PP stage's copy of the tied embedding is built from embed_tokens, sends nothing.
    output = converter.to_megatron("output_layer.weight", hf_state)
    assert torch.equal(output[: config.vocab_size], hf_state["model.embed_tokens.weight"])
    assert converter.to_hf("output_layer.weight", output) == []


def test_unknown_architecture_lists_registered_ones(checkpoints):
    config = copy.deepcopy(checkpoints["LlamaForCausalLM", "float32"][0])
    config.architectures = ["GemmaForCausalLM"]
    with pytest.raises(ValueError, match="GemmaForCausalLM") as error:
        get_converter(config)
    for architecture in CONVERTERS:
        assert architecture in str(error.value)


def test_unmapped_megatron_name_and_unsupported_config(checkpoints):
    config, _ = checkpoints["Qwen3ForCausalLM", "float32"]
    converter = get_converter(config)
    with pytest.raises(ValueError, match="no HF mapping"):
        converter.to_hf("decoder.layers.0.mlp.router.weight", torch.zeros(1))
    with pytest.raises(ValueError, match="no HF mapping"):
        converter.to_hf("decoder.layers.2.input_layernorm.weight", torch.zeros(1))
    llama, _ = checkpoints["LlamaForCausalLM", "float32"]
    biased = copy.deepcopy(llama)
    biased.attention_bias = True
    with pytest.raises(ValueError, match="attention_bias"):
        get_converter(biased)
    # Both MoE families refuse a decoder with dense layers among the MoE ones.
    for architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        moe, _ = checkpoints[architecture, "float32"]
        mixed = copy.deepcopy(moe)
        mixed.mlp_only_layers = [0]
        with pytest.raises(ValueError, match=rf"{architecture}: only all-MoE decoders"):
            get_converter(mixed)


@pytest.mark.parametrize("architecture", sorted(PRESET_OF))
def test_full_shapes_map_to_the_checkpoint(checkpoints, architecture):
    """What the gather plan checks every tensor against: the converter's full shapes, mapped to
    HF on meta tensors, are the checkpoint's names and shapes, each once (per-stage splits of
    real models are checked in the distributed tier)."""
    config, hf_state = checkpoints[architecture, "bfloat16"]
    converter = get_converter(config, padded_vocab_size=pad_vocab_size(config.vocab_size, 2))
    mapped: list[tuple[str, tuple[int, ...]]] = []
    for name, shape in converter.megatron_shapes():
        assert converter.full_shape(name) == shape
        meta = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        mapped += [(hf_name, tuple(t.shape)) for hf_name, t in converter.to_hf(name, meta)]
    names = [name for name, _ in mapped]
    assert len(names) == len(set(names)), "a tensor is listed twice"
    assert dict(mapped) == {name: tuple(t.shape) for name, t in hf_state.items()}


def test_shared_expert_names_and_layouts(checkpoints):
    """Qwen2-MoE's shared expert ([gate; up] like a dense MLP) and its sigmoid gate."""
    config, hf_state = checkpoints["Qwen2MoeForCausalLM", "float32"]
    converter = get_converter(config)
    fc1 = converter.to_megatron("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", hf_state)
    gate = hf_state["model.layers.1.mlp.shared_expert.gate_proj.weight"]
    up = hf_state["model.layers.1.mlp.shared_expert.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))
    pairs = converter.to_hf(
        "decoder.layers.0.mlp.shared_experts.gate_weight",
        hf_state["model.layers.0.mlp.shared_expert_gate.weight"],
    )
    assert [name for name, _ in pairs] == ["model.layers.0.mlp.shared_expert_gate.weight"]
    assert converter.full_shape("decoder.layers.0.mlp.shared_experts.linear_fc2.weight") == (
        config.hidden_size,
        config.shared_expert_intermediate_size,
    )
    # Qwen3-MoE has no shared expert: the same name is unmapped there.
    qwen3_moe = get_converter(checkpoints["Qwen3MoeForCausalLM", "float32"][0])
    assert not qwen3_moe.maps("decoder.layers.0.mlp.shared_experts.gate_weight")


def test_mistral_sliding_window_is_refused_unless_it_covers_every_position(checkpoints):
    config = copy.deepcopy(checkpoints["MistralForCausalLM", "float32"][0])
    get_converter(config)  # sliding_window None
    config.sliding_window = 64
    with pytest.raises(ValueError, match="sliding_window=64"):
        get_converter(config)
    config.sliding_window = config.max_position_embeddings
    get_converter(config)


def test_topology_default_rank_order():
    # world 8 = tp2 x dp2 x pp2 for dense layers, expert_tp1 x ep2 x expert_dp2 x pp2 for experts.
    topologies = [Topology.for_rank(r, 8, tp=2, pp=2, ep=2, expert_tp=1) for r in range(8)]
    assert [(t.tp_rank, t.dp_rank, t.pp_rank) for t in topologies[:4]] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 0),
        (1, 1, 0),
    ]
    assert [(t.ep_rank, t.expert_dp_rank) for t in topologies[:4]] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
    ]
    senders = [t.world_rank for t in topologies if t.is_pp_sender]
    assert senders == [0, 4]
    assert [topologies[r].pp_rank for r in senders] == [0, 1]


def test_topology_errors_list_every_degree():
    with pytest.raises(ValueError) as error:
        Topology(
            world_rank=0,
            world_size=4,
            tp_rank=0,
            tp_size=3,
            pp_rank=0,
            pp_size=1,
            dp_rank=0,
            dp_size=1,
        )
    message = str(error.value)
    for part in (
        "tp*cp*dp*pp=3 != world_size=4",
        "tp 0/3",
        "pp 0/1",
        "dp 0/1",
        "ep 0/1",
        "expert_tp 0/1",
        "expert_dp 0/1",
    ):
        assert part in message
    with pytest.raises(ValueError, match="world_size=6 is not divisible by tp\\*cp\\*pp=4"):
        Topology.for_rank(0, 6, tp=2, pp=2)
    with pytest.raises(ValueError, match="pp sender"):
        Topology(
            world_rank=0,
            world_size=2,
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            dp_rank=0,
            dp_size=2,
            ep_rank=1,
            ep_size=2,
        )
