"""The ``longtail`` smoke task: heavy-tailed answer lengths, deterministic rows, a length-aware reward."""
import statistics

import pytest
from transformers import AutoTokenizer

from rlrecipes.data import PromptDataset, build_smoke_tokenizer, smoke_task_dataset, smoke_vocab
from rlrecipes.data.smoke import LONGTAIL_LONG, LONGTAIL_LONG_SHARE, LONGTAIL_SHORT
from rlrecipes.rewards import resolve_reward, smoke_reward


def _length(row) -> int:
    """The number of digits the row's answer asks for."""
    return int(row["answer"].split("*")[1])


def test_answer_lengths_are_heavy_tailed():
    rows = smoke_task_dataset(2048, seed=0, task="longtail")
    lengths = [_length(r) for r in rows]
    assert statistics.median(lengths) == 3
    assert 0.07 <= sum(n >= 40 for n in lengths) / len(lengths) <= 0.13
    assert LONGTAIL_LONG_SHARE == 0.1
    assert all(LONGTAIL_SHORT[0] <= n <= LONGTAIL_SHORT[1] or LONGTAIL_LONG[0] <= n <= LONGTAIL_LONG[1]
               for n in lengths)
    assert {n for n in lengths if n < 40} == {2, 3, 4} and min(n for n in lengths if n >= 40) == 40
    assert max(lengths) == 60
    for r in rows:  # the prompt asks for exactly what the answer holds
        d, n = r["answer"].split("*")
        assert r["prompt"] == f"{d}*{n}=" and len(d) == 1 and d.isdigit()


def test_rows_are_deterministic_and_prefix_stable():
    a = smoke_task_dataset(300, seed=7, task="longtail")
    assert a == smoke_task_dataset(300, seed=7, task="longtail")
    assert a[:50] == smoke_task_dataset(50, seed=7, task="longtail")
    assert a != smoke_task_dataset(300, seed=8, task="longtail")
    assert a == smoke_task_dataset(300, seed=7, task="longtail", num_digits=5)  # num_digits does not apply
    # the other tasks' rows are unchanged by the new one
    assert smoke_task_dataset(3, seed=0) == [{"prompt": "157=", "answer": "157"}, {"prompt": "019=", "answer": "019"},
                                             {"prompt": "907=", "answer": "907"}]


@pytest.mark.parametrize("completion, answer, expected", [
    ("777", "7*3", 1.0),                       # right
    (" 777\n", "7*3", 1.0),                    # surrounding whitespace ignored
    ("7" * 45, "7*45", 1.0),
    ("77", "7*3", 2 / 3),                      # partial: one digit short
    ("778", "7*3", (2 + 0.5 * (1 - 1 / 9)) / 3),  # a near-miss digit earns part, as in the other tasks
    ("7" * 40, "7*45", 40 / 45),
    ("7777", "7*3", 2 / 3),                    # overlong: one too many costs as much as one too few
    ("7" * 50, "7*45", 40 / 45),
    ("7" * 64, "7*3", 0.0),                    # ran on to the token limit: nothing
    ("7" * 64, "7*45", 26 / 45),
    ("", "7*3", 0.0),                          # empty
    ("", "7*45", 0.0),
    ("abc", "7*3", 0.0),
])
def test_reward(completion, answer, expected):
    assert smoke_reward(completion, answer) == pytest.approx(expected, abs=1e-12)


def test_reward_never_pays_for_length():
    for n in (2, 3, 4, 40, 60):
        right = smoke_reward("5" * n, f"5*{n}")
        assert right == 1.0
        scores = [smoke_reward("5" * (n + k), f"5*{n}") for k in range(1, 70)]
        assert all(b < a for a, b in zip([right, *scores], scores) if a > 0)  # each extra digit costs
        assert scores[-1] == 0.0
    assert resolve_reward("smoke")("333", "3*3") == 1.0  # recipes' reward.fn: smoke grades it
    assert smoke_reward("4071", "407") == pytest.approx(0.9)  # the other tasks keep their grading


def test_prompts_fit_the_smoke_max_prompt_length(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(build_smoke_tokenizer(tmp_path / "tok")))
    assert "*" in smoke_vocab()  # no new characters: the existing tokens keep their ids
    rows = smoke_task_dataset(2048, seed=0, task="longtail")
    ds = PromptDataset(rows, tokenizer=tok, max_prompt_len=32)
    assert len(ds) == 2048 and ds.n_dropped_too_long == 0
    assert all(len(ds[i]["prompt_ids"]) <= 6 for i in range(len(ds)))
    assert all(tok.unk_token_id not in ds[i]["prompt_ids"] for i in range(len(ds)))


def test_plan_accepts_the_longtail_smoke_with_64_new_tokens():
    from rlrecipes.plan import build_plan, format_violations
    from rlrecipes.recipe import load_recipe

    r = load_recipe("qwen25_7b", smoke=True,
                    overrides=["data.synthetic=longtail", "rollout.sampling.max_new_tokens=64"])
    assert r.data.synthetic == "longtail" and r.rollout.max_response_len == 64
    p = build_plan(r)
    assert p.ok, format_violations(p)
