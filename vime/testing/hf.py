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


def hf_greedy(
    model: Any, prompt_ids: Sequence[int], num_tokens: int, past: Any = None
) -> list[int]:
    """Greedy decoding with the KV cache: argmax at every step, no stopping at EOS and no logits
    processors (generate()'s min_new_tokens would mask EOS and so change the argmax). `past`: a
    KV cache to continue from (`prompt_ids` are then the tokens after it)."""
    if isinstance(model, (str, Path)):
        model = load_hf_model(model)
    ids = torch.tensor([list(prompt_ids)])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            result = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def hf_greedy_across_switch(
    old: Any, new: Any, prompt_ids: Sequence[int], tokens: Sequence[int], switch: int, n: int
) -> list[int]:
    """What an engine that swapped `old` for `new` weights mid-request, between the steps that
    made tokens[switch - 1] and tokens[switch], without recomputing its KV cache, makes next:
    the cache of the prompt and tokens[:switch - 1] holds `old`'s keys and values, and from
    tokens[switch - 1] on every step runs `new`. n greedy tokens from tokens[switch]."""
    assert 0 < switch <= len(tokens)
    with torch.no_grad():
        ids = torch.tensor([[*prompt_ids, *tokens[: switch - 1]]])
        past = old(input_ids=ids, use_cache=True).past_key_values
    return hf_greedy(new, [tokens[switch - 1]], n, past=past)
