"""HF transformers as the reference the tests compare engines with.

model = load_hf_model(model_dir)             # float32, eval
tokens = hf_greedy(model, prompt_ids, 12)    # what a greedy engine with ignore_eos must give
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """An HF checkpoint as a transformers model in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


def hf_greedy(model: Any, prompt_ids: Sequence[int], num_tokens: int) -> list[int]:
    """Greedy decoding with the KV cache: argmax at every step, no stopping at EOS and no logits
    processors (generate()'s min_new_tokens would mask EOS and so change the argmax)."""
    if isinstance(model, (str, Path)):
        model = load_hf_model(model)
    ids = torch.tensor([list(prompt_ids)])
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(num_tokens):
            result = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out
