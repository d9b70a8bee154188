"""Prompt datasets as JSONL, and the built-in digit-repeat task that a tiny random model can learn.

One JSON object per line: `{"id": "...", "prompt": "...", ...}`; every other field is the sample's
metadata, handed to the reward function (the digit task stores `"digit"`).

    python -m vime.rl.data --out vime/data/digit_repeat     # rewrite the built-in task files
                                                            # (train, test, sft demonstrations)
    python -m vime.rl.data --context-chars 300 --out DIR    # the digit task with long prompts
"""

from __future__ import annotations

import argparse
import json
import random
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DIGIT_REPEAT_TRAIN = DATA_DIR / "digit_repeat" / "train.jsonl"
DIGIT_REPEAT_TEST = DATA_DIR / "digit_repeat" / "test.jsonl"
DIGIT_REPEAT_LENGTH = 8  # digit_match scores the first 8 characters


def resolve_data_path(path: str | Path) -> Path:
    """A data file named in a config: an absolute path as it is; a relative one from the working
    directory if it is there, else from vime's package data (`vime/data/`, e.g.
    "digit_repeat/train.jsonl"), so shipped configs work from any directory. ValueError naming
    both places when neither has it."""
    path = Path(path)
    if path.is_absolute():
        if not path.is_file():
            raise ValueError(f"{path} does not exist")
        return path
    for candidate in (Path.cwd() / path, DATA_DIR / path):
        if candidate.is_file():
            return candidate.resolve()
    raise ValueError(f"{path} is neither in {Path.cwd()} nor in vime's data ({DATA_DIR})")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a dataset: text, a stable id and the reward function's metadata."""

    id: str
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


def load_prompts(path: str | Path) -> list[PromptRecord]:
    """Read a JSONL prompt file; errors name the file and line and say what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    records: list[PromptRecord] = []
    seen_ids: dict[str, int] = {}
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_number}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ValueError(
                f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}"
            )
        prompt = row.pop("prompt", None)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{line_number}: needs a non-empty string field 'prompt'")
        record_id = str(row.pop("id", line_number))
        if record_id in seen_ids:
            raise ValueError(
                f"{path}:{line_number}: id {record_id!r} already used on line {seen_ids[record_id]}"
            )
        seen_ids[record_id] = line_number
        records.append(PromptRecord(id=record_id, prompt=prompt, metadata=row))
    if not records:
        raise ValueError(f"prompt file {path} has no prompts")
    return records


# Each template names the digit. Half end with it (the answer is begun: copying the last token is
# the easy first thing to learn); the rest need it found further back, one past a distractor.
# With the last-token templates qwen2-tiny climbs faster (0.38 vs 0.30 after 120 steps, 2 seeds).
_DIGIT_TEMPLATES = (
    "Q: write {d} A: {d}",
    "Q: {d} {d} {d} A: {d}",
    "Q: write {d} {d} A:",
    "Q: {x} write {d} A:",
    "Q: {d} is the number A:",
    "Q: {d} {d} A: {d}{d}",
)


def load_demonstrations(path: str) -> list[PromptRecord]:
    """Prompt records whose metadata holds a non-empty string `completion`."""
    records = load_prompts(path)
    for record in records:
        completion = record.metadata.get("completion")
        if not isinstance(completion, str) or not completion:
            raise ValueError(
                f"{path}: demonstration {record.id!r} needs a non-empty string field "
                "'completion' (the answer the model should learn to write)"
            )
    return records


def make_digit_repeat(num_prompts: int, seed: int, context_chars: int = 0) -> list[dict[str, Any]]:
    """Prompts of the digit-repeat task (reward: `vime.rl.rewards:digit_match`). With
    `context_chars`, each prompt starts with its own run of that many random letters (unique per
    prompt, so only a prompt's own samples share its prefix: a workload for the engines'
    prefix cache and the rollout routing)."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_prompts):
        digit = str(index % 10)
        distractor = rng.choice([n for n in range(10, 100) if digit not in str(n)])
        template = rng.choice(_DIGIT_TEMPLATES)
        context = "".join(rng.choices(string.ascii_lowercase, k=context_chars))
        prefix = f"{context} " if context else ""
        rows.append(
            {
                "id": f"digit-{seed}-{index}",
                "prompt": prefix + template.format(d=digit, x=distractor),
                "digit": digit,
            }
        )
    rng.shuffle(rows)
    return rows


def digit_repeat_demonstrations(
    num_prompts: int, seed: int, min_repeats: int = 4
) -> list[dict[str, Any]]:
    """Digit-repeat prompts with an imperfect demonstrator's answers: the right digit, written
    `min_repeats` to 8 times (uniformly), where the reward asks for 8. The supervised warm start
    (`vime.rl.sft`) learns the digit from them, and their habit of stopping early; RL on the
    reward has to unlearn that (the main job's SFT -> RL margin)."""
    rng = random.Random(f"demonstrations-{seed}")
    return [
        {**row, "completion": row["digit"] * rng.randint(min_repeats, DIGIT_REPEAT_LENGTH)}
        for row in make_digit_repeat(num_prompts, seed)
    ]


def make_addition(max_operand: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The small-addition task for an instruct model (reward `vime.rl.rewards:final_number`):
    every pair a + b with 1 <= a, b <= max_operand, split in halves (train, held-out test), no
    pair in both."""
    rows = [
        {
            "id": f"add-{a}-{b}",
            "prompt": f"What is {a} + {b}? Answer with just the number.",
            "answer": a + b,
        }
        for a in range(1, max_operand + 1)
        for b in range(1, max_operand + 1)
    ]
    random.Random(seed).shuffle(rows)
    half = len(rows) // 2
    return rows[:half], rows[half:]


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DIGIT_REPEAT_TRAIN.parent), help="output directory")
    parser.add_argument("--num-train", type=int, default=500)
    parser.add_argument("--num-test", type=int, default=100)
    parser.add_argument("--num-sft", type=int, default=256)
    parser.add_argument(
        "--context-chars",
        type=int,
        default=0,
        help="write only the digit task's train and test prompts, each led by its own run of this "
        "many random letters (a long-prompt workload for the prefix cache)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    write_jsonl(make_digit_repeat(args.num_train, 0, args.context_chars), out / "train.jsonl")
    write_jsonl(make_digit_repeat(args.num_test, 1, args.context_chars), out / "test.jsonl")
    if args.context_chars:
        print(out)
        return
    write_jsonl(digit_repeat_demonstrations(args.num_sft, seed=2), out / "sft.jsonl")
    train, test = make_addition(20, seed=0)
    addition = out.parent / "add_small"
    write_jsonl(train, addition / "train.jsonl")
    write_jsonl(test, addition / "test.jsonl")
    print(out, addition)


if __name__ == "__main__":
    main()
