"""Reward of the bundled smoke task (see :mod:`rlrecipes.data.smoke`): graded, not only 0/1."""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")
_REPEAT = re.compile(r"(\d)\*(\d+)")  # the longtail task's answer "7*45": the digit 7 written 45 times


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

    The ``longtail`` task's answer ``"d*n"`` asks for the digit ``d`` written ``n`` times. Its
    positions are graded as above, and each character beyond ``n`` cancels one position's credit
    (no cap: a response that runs on to the token limit earns nothing). Being k characters too long
    costs as much as being k too short. Answer ``"7*3"``: ``"777"`` -> 1.0; ``"77"`` and ``"7777"``
    -> 0.667; ``"778"`` -> 0.815; ``"7" * 64`` -> 0.0; ``""`` -> 0.0.
    """
    c = completion.strip()
    a = answer.strip()
    if not c and tool_results:  # multi-turn: the model ended its turn on the tool's result, its answer
        m = _NUMBER.search(tool_results[-1])
        c = m.group(0) if m else ""
    rep = _REPEAT.fullmatch(a)
    if rep:
        return _repeat_score(c, rep.group(1), int(rep.group(2)))
    if not a:
        return 1.0 if not c else 0.0
    total = sum(_closeness(x, y) for x, y in zip(c, a))
    score = total / len(a)
    if len(c) > len(a):
        score -= min(0.1 * (len(c) - len(a)), 0.5)
    return max(score, 0.0)


def _repeat_score(c: str, d: str, n: int) -> float:
    """The longtail grade of ``c`` against ``d * n``: the positions' credit less one per extra
    character, over ``n``."""
    if n == 0:
        return 1.0 if not c else 0.0
    total = sum(_closeness(x, d) for x in c[:n]) - max(len(c) - n, 0)
    return max(total / n, 0.0)


#: answers of the vision smoke task (rlrecipes.data.images: one digit per colour)
VISION_CLASSES = 4


def smoke_vision_reward(completion: str, answer: str, *, classes: int = VISION_CLASSES, **_) -> float:
    """Chance-corrected score of the vision smoke task (``data.synthetic: colors``): ``1`` for the
    right colour digit first, ``-1 / (classes - 1)`` for another class's digit, ``0`` otherwise.

    Answers are drawn uniformly over the classes, so any policy that does not look at the image
    (blank images included) scores 0 in expectation, however it learns to answer: only the image
    can raise this reward. Examples (answer ``"2"``): ``"2"`` -> 1.0; ``"1"`` -> -0.333; ``"x"`` -> 0.0.
    """
    c = completion.strip()[:1]
    if c == answer.strip():
        return 1.0
    if c.isdigit() and int(c) < classes:
        return -1.0 / (classes - 1)
    return 0.0
