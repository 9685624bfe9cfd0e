"""Reward of the bundled smoke task (see :mod:`rlrecipes.data.smoke`): graded, not only 0/1."""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def _closeness(c: str, a: str) -> float:
    if c == a:
        return 1.0
    if c.isdigit() and a.isdigit():
        return 0.5 * (1.0 - abs(int(c) - int(a)) / 9.0)
    return 0.0


def smoke_reward(completion: str, answer: str, *, tool_results: list[str] | None = None) -> float:
    """Graded score in [0, 1] of a smoke-task response against its answer.

    ``completion`` is the decoded response (special tokens skipped), surrounding whitespace
    ignored. Each answer position earns 1 for the right character, ``0.5 * (1 - |c - a| / 9)``
    for a wrong digit (a near miss earns more), 0 otherwise; the score is their mean, minus
    ``0.1`` per character beyond the answer's length (at most ``0.5``), floored at 0.
    Examples with answer ``"407"``: ``"407"`` -> 1.0; ``"40"`` -> 0.667; ``"417"`` -> 0.815;
    ``"4071"`` -> 0.9; ``""`` -> 0.0.

    Multi-turn (``tool_results`` given): a model that ends its turn right after a tool's result,
    with no text of its own, answers with that result (the last number of the last observation).
    The smoke models cannot learn to copy a result within a smoke run (the plain copy task stays
    near 0.4 after 150 steps), so accepting the calculator's result is how the smoke add task's
    model uses the tool; a model that copies the result is scored on its copy.
    """
    c = completion.strip()
    a = answer.strip()
    if not c and tool_results:  # multi-turn: the model ended its turn on the tool's result, its answer
        m = _NUMBER.search(tool_results[-1])
        c = m.group(0) if m else ""
    if not a:
        return 1.0 if not c else 0.0
    total = sum(_closeness(x, y) for x, y in zip(c, a))
    score = total / len(a)
    if len(c) > len(a):
        score -= min(0.1 * (len(c) - len(a)), 0.5)
    return max(score, 0.0)
