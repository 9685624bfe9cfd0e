"""Format reward, smoke reward, reward addressing and fault-tolerant batch scoring."""
import math

import pytest

from rlrecipes.rewards import format_reward, math_verify, resolve_reward, score_batch, smoke_reward


@pytest.mark.parametrize(
    "text,expected",
    [
        ("reasoning... so \\boxed{4}", 1.0),
        ("\\boxed{4}.", 1.0),
        ("$\\boxed{4}$", 1.0),
        ("\\[\\boxed{\\frac{1}{2}}\\]", 1.0),
        ("<think>2+2</think> The answer is \\boxed{4}", 1.0),
        ("\\boxed{4} because 2+2", 0.0),  # box not final
        ("\\boxed{3} or \\boxed{4}", 0.0),  # two boxes
        ("the answer is 4", 0.0),  # no box
        ("\\boxed{4", 0.0),  # unbalanced
        ("<think>\\boxed{4}</think>", 0.0),  # box inside the reasoning
        ("<think>a<think>b</think> \\boxed{4}", 0.0),  # two opening tags
        ("</think><think> \\boxed{4}", 0.0),  # wrong order
    ],
)
def test_format_reward(text, expected):
    assert format_reward(text, "ignored") == expected


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("407", "407", 1.0),
        (" 407 ", "407", 1.0),
        ("40", "407", 2 / 3),
        ("417", "407", (1 + 0.5 * (1 - 1 / 9) + 1) / 3),
        ("4071", "407", 0.9),
        ("407" + "9" * 10, "407", 0.5),
        ("", "407", 0.0),
        ("abc", "407", 0.0),
        ("907", "407", (0.5 * (1 - 5 / 9) + 2) / 3),
        ("", "", 1.0),
    ],
)
def test_smoke_reward_graded(completion, answer, expected):
    assert math.isclose(smoke_reward(completion, answer), expected, rel_tol=1e-9, abs_tol=1e-12)


def test_smoke_reward_is_graded_and_monotone_in_correct_prefix():
    vals = [smoke_reward(c, "12345") for c in ["", "1", "12", "123", "1234", "12345"]]
    assert vals == sorted(vals) and len(set(vals)) == 6


def test_resolve_builtin_and_import_path():
    assert resolve_reward("math_verify") is math_verify
    assert resolve_reward("rlrecipes.rewards.smoke:smoke_reward") is smoke_reward
    assert resolve_reward(smoke_reward) is smoke_reward


def test_resolve_errors_are_helpful():
    with pytest.raises(ValueError, match="did you mean 'math_verify'|Did you mean 'math_verify'"):
        resolve_reward("math_verfy")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg_xyz.mod'"):
        resolve_reward("no_such_pkg_xyz.mod:fn")
    with pytest.raises(ValueError, match="Did you mean 'smoke_reward'"):
        resolve_reward("rlrecipes.rewards.smoke:smoke_rewrd")


def _flaky(completion, answer):
    if completion == "boom":
        raise RuntimeError("kaput")
    if completion == "nan":
        return float("nan")
    return 1.0 if completion == answer else 0.5


def test_score_batch_catches_errors_per_sample():
    scores, n_err, first = score_batch(_flaky, ["a", "boom", "b", "nan", "boom"], ["a", "x", "c", "y", "z"])
    assert scores == [1.0, 0.0, 0.5, 0.0, 0.0]
    assert n_err == 3
    assert first.startswith("sample 1: RuntimeError: kaput")


def test_score_batch_clean_and_by_name():
    scores, n_err, first = score_batch("math_verify", ["\\boxed{2}", "\\boxed{3}"], ["2", "2"])
    assert scores == [1.0, 0.0] and n_err == 0 and first is None
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        score_batch("smoke", ["a", "b"], ["a"])
