"""Format reward: is the answer given as a single final ``\\boxed{}`` (after any reasoning)?"""
from __future__ import annotations

import re

from .math import last_boxed

_TRAILING_OK = re.compile(r"[\s$.)\]\\]*")


def format_reward(completion: str, answer: str | None = None) -> float:  # noqa: ARG001 - reward signature
    """1.0 when the completion has the expected shape, else 0.0.

    Shape rules:

    * exactly one ``\\boxed{...}`` with balanced braces;
    * after its closing brace only whitespace, ``$``, ``.``, ``)``, ``]`` or ``\\`` (``\\]``) may follow,
      so the box is the final answer;
    * ``<think>`` / ``</think>`` are optional, but if either appears there must be exactly one
      of each, ``<think>`` first, and the box must come after ``</think>``.

    ``answer`` is ignored (kept for the common reward signature ``fn(completion, answer)``).
    """
    text = completion or ""
    if text.count("\\boxed") != 1:
        return 0.0
    content = last_boxed(text)
    if content is None:
        return 0.0
    start = text.find("\\boxed")
    brace = text.find("{", start)
    if brace < 0 or text[start + len("\\boxed"):brace].strip():
        return 0.0
    end = brace + 1 + len(content) + 1  # index after the closing brace
    if not _TRAILING_OK.fullmatch(text[end:]):
        return 0.0
    n_open, n_close = text.count("<think>"), text.count("</think>")
    if n_open or n_close:
        if n_open != 1 or n_close != 1:
            return 0.0
        o, c = text.find("<think>"), text.find("</think>")
        if not (o < c < start):
            return 0.0
    return 1.0
