"""Reward functions, pluggable by dotted path: `load_reward_fn("vime.rl.rewards:digit_match")`.

A reward function is `fn(prompt_text, completion_text, metadata) -> float`, where `metadata` is the
prompt record's extra JSONL fields (for the built-in task: `{"digit": "7"}`). Rewards are in [0, 1].

The built-in task (`vime/data/digit_repeat/`): each prompt names a digit; the answer is that digit
repeated. Random-weight qwen2-tiny scores about 0.07 with digit_match (under 0.01 with the stricter
digit_run, too sparse to learn from); GRPO at 32 prompts x 8 samples, lr 2e-3, 8 tokens, takes it
to about 0.4 in 110-150 steps; a solver scores 1.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any

RewardFn = Callable[[str, str, Mapping[str, Any]], float]

DIGIT_MATCH_CHARS = 8
_INTEGER = re.compile(r"-?\d+")


def _target_digit(metadata: Mapping[str, Any], reward_name: str) -> str:
    digit = metadata.get("digit")
    if not isinstance(digit, str) or len(digit) != 1 or not digit.isdigit():
        raise ValueError(f"{reward_name} needs metadata['digit'] to be one digit, got {digit!r}")
    return digit


def digit_match(prompt_text: str, completion_text: str, metadata: Mapping[str, Any]) -> float:
    """Fraction of the first 8 non-whitespace completion characters equal to `metadata["digit"]`.

    Missing characters (a completion that stops early) count as wrong, so "7" scores 1/8 and
    "7777 7777" scores 1. Partial credit keeps the group-normalised advantage informative while the
    policy is still mostly wrong.
    """
    digit = _target_digit(metadata, "digit_match")
    chars = "".join(completion_text.split())[:DIGIT_MATCH_CHARS]
    return sum(char == digit for char in chars) / DIGIT_MATCH_CHARS


def digit_run(prompt_text: str, completion_text: str, metadata: Mapping[str, Any]) -> float:
    """Length of the leading run of `metadata["digit"]` in the non-whitespace completion, over 8.

    Stricter than digit_match: "7717" scores 2/8, so a prompt-independent mixture of digits
    ("104104...") earns almost nothing and only copying the prompt's digit pays.
    """
    digit = _target_digit(metadata, "digit_run")
    chars = "".join(completion_text.split())[:DIGIT_MATCH_CHARS]
    run = len(chars) - len(chars.lstrip(digit))
    return run / DIGIT_MATCH_CHARS


def exact_match(prompt_text: str, completion_text: str, metadata: Mapping[str, Any]) -> float:
    """1 if the stripped completion equals `metadata["answer"]`, else the fraction of its leading
    characters that match the answer position by position (partial credit)."""
    answer = metadata.get("answer")
    if not isinstance(answer, str) or not answer:
        raise ValueError(
            f"exact_match needs metadata['answer'] to be a non-empty string, got {answer!r}"
        )
    completion = completion_text.strip()
    if completion == answer:
        return 1.0
    matched = sum(a == b for a, b in zip(completion, answer, strict=False))
    # Never full credit for a longer or different string.
    return 0.9 * matched / max(len(answer), len(completion))


def final_number(prompt_text: str, completion_text: str, metadata: Mapping[str, Any]) -> float:
    """1 if the last integer the completion writes equals `metadata["answer"]`, else 0 (the
    arithmetic task: "17 + 16 = 33" and "The answer is 33." both score; a completion cut off
    before its answer does not)."""
    answer = metadata.get("answer")
    if not isinstance(answer, int) or isinstance(answer, bool):
        raise ValueError(f"final_number needs metadata['answer'] to be an integer, got {answer!r}")
    numbers = _INTEGER.findall(completion_text)
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


def load_reward_fn(path: str) -> RewardFn:
    """Resolve "package.module:function" (or "package.module.function") to a reward function."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward function path {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"reward function {path!r}: cannot import module {module_name!r} ({exc})"
        ) from exc
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(name for name in vars(module) if not name.startswith("_"))
        raise ValueError(
            f"reward function {path!r}: module {module_name!r} has no attribute {attr!r} "
            f"(it has: {', '.join(public)})"
        )
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is a {type(fn).__name__}, not a callable")
    return fn
