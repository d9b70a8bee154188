"""Reward functions and loading them by dotted path."""

from __future__ import annotations

import pytest

from vime.rl.rewards import digit_match, digit_run, exact_match, load_reward_fn

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("77777777", 1.0),
        (" 7777 7777 tail", 1.0),  # whitespace is skipped; only the first 8 characters count
        ("7", 1 / 8),  # stopping early: missing characters count as wrong
        ("", 0.0),
        ("17171717", 0.5),
        ("88888888", 0.0),
        ("7777\n77x7", 7 / 8),
    ],
)
def test_digit_match(completion, expected):
    assert digit_match("Q: write 7 A:", completion, {"digit": "7"}) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("77777777", 1.0), (" 77 71 777", 3 / 8), ("17777777", 0.0), ("7", 1 / 8), ("", 0.0)],
)
def test_digit_run(completion, expected):
    assert digit_run("Q: write 7 A:", completion, {"digit": "7"}) == pytest.approx(expected)


@pytest.mark.parametrize("metadata", [{}, {"digit": "77"}, {"digit": "x"}, {"digit": 7}])
@pytest.mark.parametrize("reward_fn", [digit_match, digit_run])
def test_digit_rewards_reject_bad_metadata(reward_fn, metadata):
    with pytest.raises(ValueError, match=f"{reward_fn.__name__} needs metadata\\['digit'\\]"):
        reward_fn("p", "7", metadata)


def test_exact_match_partial_credit():
    assert exact_match("", " 42 ", {"answer": "42"}) == 1.0
    assert exact_match("", "41", {"answer": "42"}) == pytest.approx(0.45)
    assert exact_match("", "4200", {"answer": "42"}) == pytest.approx(0.45)
    assert exact_match("", "", {"answer": "42"}) == 0.0


def test_load_reward_fn_resolves_both_spellings():
    assert load_reward_fn("vime.rl.rewards:digit_match") is digit_match
    assert load_reward_fn("vime.rl.rewards.exact_match") is exact_match


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("vime.rl.no_such_module:fn", "cannot import module 'vime.rl.no_such_module'"),
        ("vime.rl.rewards:no_such_fn", "has no attribute 'no_such_fn'"),
        ("vime.rl.rewards:DIGIT_MATCH_CHARS", "is a int, not a callable"),
        ("digit_match", "must look like 'package.module:function'"),
    ],
)
def test_load_reward_fn_errors_name_the_path(path, message):
    with pytest.raises(ValueError, match="reward function") as info:
        load_reward_fn(path)
    assert message in str(info.value)
    assert path in str(info.value)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("17 + 16 = 33", 1.0),
        ("The answer is 33.", 1.0),
        ("33", 1.0),
        ("17 + 16 = 32", 0.0),
        ("To add 17 and 16, we", 0.0),  # cut off before its answer
        ("", 0.0),
    ],
)
def test_final_number_scores_the_last_integer(completion, expected):
    from vime.rl.rewards import final_number

    assert final_number("What is 17 + 16?", completion, {"answer": 33}) == expected
    with pytest.raises(ValueError, match="integer"):
        final_number("q", completion, {"answer": "33"})


def test_addition_task_splits_every_pair_once():
    from vime.rl.data import load_prompts, make_addition, resolve_data_path

    train, test = make_addition(20, seed=0)
    assert len(train) == len(test) == 200
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    shipped = load_prompts(resolve_data_path("add_small/test.jsonl"))
    assert [r.id for r in shipped] == [r["id"] for r in test]  # the shipped files are these
