"""The tiny-model builder is deterministic and produces loadable HF checkpoints."""

from __future__ import annotations

import hashlib
import json

import pytest
from transformers import AutoConfig, AutoTokenizer

from vime.testing.tiny_model import PRESETS, build_tiny_model

pytestmark = pytest.mark.unit


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, dtype):
    first = build_tiny_model(tmp_path / "a", "qwen3-tiny", dtype, seed=3)
    second = build_tiny_model(tmp_path / "b", "qwen3-tiny", dtype, seed=3)
    third = build_tiny_model(tmp_path / "c", "qwen3-tiny", dtype, seed=4)
    assert _digest(first) == _digest(second) != _digest(third)
    config = AutoConfig.from_pretrained(first)
    assert config.architectures == ["Qwen3ForCausalLM"] and str(config.dtype).endswith(dtype)
    assert config.head_dim >= 32


def test_tokenizer_round_trips_and_has_eos(tmp_path):
    out = build_tiny_model(tmp_path / "m", "qwen2-tiny")
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "Q: 12+34= A: 46"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    eos_id = json.loads((out / "config.json").read_text())["eos_token_id"]
    assert tokenizer.eos_token_id == eos_id


def test_unknown_preset_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        build_tiny_model(tmp_path / "x", "gpt5")


def test_presets_keep_head_dim_at_least_32():
    for name, fields in PRESETS.items():
        head_dim = fields.get("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
        assert head_dim >= 32, name
