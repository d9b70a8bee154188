"""Build small HF checkpoints locally: random weights, a real architecture, a local BPE tokenizer.

Nothing is downloaded. The same (preset, dtype, seed) always gives the same bytes, so tests and
benchmarks can rebuild a model instead of shipping one.

    python -m vime.testing.tiny_model --preset qwen2-tiny --out models/qwen2-tiny
    python -m vime.testing.tiny_model --preset qwen2.5-0.5b --dtype bfloat16 --out models/q05b
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_VOCAB_SIZE = 512

# head_dim must be >= 32: vLLM's CPU attention kernel crashes on 16 (see NOTES.md).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-tiny": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # qwen2-tiny with four layers: pipeline x virtual pipeline stages of one layer each.
    "qwen2-tiny-4layer": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # Slower per token than the API server's per-token work on 2 cores, so a streaming client sees
    # tokens about when the engine makes them (pause/resume tests need that).
    "qwen2-small": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "qwen3-tiny": dict(
        architecture="Qwen3ForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "llama-tiny": dict(
        architecture="LlamaForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "qwen3-moe-tiny": dict(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # Qwen2-MoE: every layer routed (top-2 of 4) plus a shared expert behind a sigmoid gate.
    "qwen2-moe-tiny": dict(
        architecture="Qwen2MoeForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=False,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "mistral-tiny": dict(
        architecture="MistralForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=None,
        vocab_size=512,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # A Qwen2-shaped model of 0.16B parameters (158M) (Qwen2.5's vocabulary), the small end of
    # `vime bench-sync --sizes`.
    "qwen2-0.16b": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=640,
        intermediate_size=3456,
        num_hidden_layers=8,
        num_attention_heads=10,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-0.5B shape (494M parameters), for transfer and speed work.
    "qwen2.5-0.5b": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # Qwen2.5-1.5B shape (1.54B parameters), the large end of `vime bench-sync --sizes`.
    "qwen2.5-1.5b": dict(
        architecture="Qwen2ForCausalLM",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tokenizer_corpus() -> list[str]:
    """A fixed corpus: digits and arithmetic dominate so the RL task tokenizes compactly."""
    words = (
        "the a of and to in is it you that he was for on are with as his they be at one have this "
        "from or had by word but what some we can out other were all there when up use your how "
        "said an each she which do their time if will way about many then them write would like "
        "so these her long make thing see him two has look more day could go come did number "
        "sound no most people my over know water than call first who may down side been now find "
        "answer question add plus minus times equals sum result compute what is"
    ).split()
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            lines.append(f"Q: {a}+{b}= A: {a + b}")
            lines.append(f"{a} plus {b} is {a + b}. {a}*{b}={a * b}")
    return lines


def build_tokenizer(out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer (deterministic) and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=None
    )
    wrapped.model_max_length = 4096
    wrapped.save_pretrained(str(out_dir))


def build_config(preset: str, dtype: str, eos_token_id: int):
    """The transformers config object of a preset."""
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    fields = dict(PRESETS[preset])
    architecture = fields.pop("architecture")
    model_type = {
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "LlamaForCausalLM": "llama",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "Qwen2MoeForCausalLM": "qwen2_moe",
        "MistralForCausalLM": "mistral",
    }[architecture]
    config = AutoConfig.for_model(
        model_type,
        architectures=[architecture],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        dtype=dtype,
        **fields,
    )
    return config


def build_tiny_model(
    out_dir: str | Path, preset: str = "qwen2-tiny", dtype: str = "float32", seed: int = 0
) -> Path:
    """Write config.json, model.safetensors and the tokenizer files of a random model to out_dir.

    Idempotent: an existing build with the same (preset, dtype, seed) is left as it is.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    stamp = {"preset": preset, "dtype": dtype, "seed": seed, "fields": PRESETS.get(preset)}
    stamp_file = out / "vime_tiny_model.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    eos_token_id = json.loads((out / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    config = build_config(preset, dtype, eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(_DTYPES[dtype])
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size="100GB")
    (out / "generation_config.json").unlink(missing_ok=True)
    stamp_file.write_text(json.dumps(stamp))
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("built %s (%s, %.1fM params) in %s", preset, dtype, num_params / 1e6, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2-tiny", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(build_tiny_model(args.out, args.preset, args.dtype, args.seed))


if __name__ == "__main__":
    main()
