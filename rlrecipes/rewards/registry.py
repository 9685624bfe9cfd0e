"""Reward addressing and fault-tolerant batch scoring.

A reward function has the signature ``fn(completion: str, answer: str) -> float``. Recipes name
one by a built-in name (``math_verify``, ``format``, ``smoke``) or by an import path
``"pkg.module:function"``.

Multi-turn rollouts (``rollout.multi_turn``): ``completion`` is the final answer, the model's text
after its last tool turn. A function that also wants the whole trajectory declares keyword
parameters ``messages`` and/or ``tool_results``::

    def my_reward(completion: str, answer: str, *, messages: list[dict], tool_results: list[str]) -> float

``messages`` is the response as chat messages, ``{"role": "assistant" | "tool", "content": str}``
in order (the model's segments and the observations as the model saw them); ``tool_results`` is
the content of every ``tool`` message. A function without those parameters is called as before.
"""
from __future__ import annotations

import difflib
import importlib
import math
from typing import Callable, Sequence

from .format import format_reward
from .math import math_verify
from .smoke import smoke_reward, smoke_vision_reward

RewardFn = Callable[[str, str], float]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math_verify": math_verify,
    "format": format_reward,
    "smoke": smoke_reward,
    "smoke_vision": smoke_vision_reward,
}


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """Return the reward function named by ``spec``.

    ``spec`` is a built-in name (``math_verify``, ``format``, ``smoke``), an import path
    ``"pkg.module:function"``, or already a callable (returned as is).
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward must be a name or 'pkg.module:function'; got {spec!r}")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        close = difflib.get_close_matches(spec, BUILTIN_REWARDS, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown reward {spec!r}; built-in rewards: {', '.join(sorted(BUILTIN_REWARDS))}, or give an "
            f"import path 'pkg.module:function'.{hint}"
        )
    mod_name, _, attr = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {mod_name!r} ({e}); check the module path "
                         "and that it is importable (on PYTHONPATH / installed)") from e
    fn = getattr(mod, attr, None)
    if fn is None:
        names = [n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n))]
        close = difflib.get_close_matches(attr, names, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"reward {spec!r}: module {mod_name!r} has no attribute {attr!r}.{hint}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {mod_name}.{attr} is not callable")
    return fn


def trajectory_keywords(fn: Callable) -> tuple[str, ...]:
    """Which of ``messages`` / ``tool_results`` ``fn`` accepts as keywords (``**kwargs`` takes both)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return ("messages", "tool_results")
    return tuple(k for k in ("messages", "tool_results") if k in params
                 and params[k].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def score_batch(
    fn: RewardFn | str, completions: Sequence[str], answers: Sequence[str],
    trajectories: Sequence[dict] | None = None,
) -> tuple[list[float], int, str | None]:
    """Score every (completion, answer) pair; never raises because of one bad sample.

    A sample whose reward function raises, or returns something that is not a finite number,
    scores 0.0 and is counted.

    ``trajectories[i]`` (multi-turn): ``{"messages": [...], "tool_results": [...]}`` of sample
    ``i``, passed to a function that declares those keywords (module doc).

    Returns:
        ``(scores, n_errors, first_error_message)``; the message names the sample index and the
        exception, e.g. ``"sample 3: ValueError: ..."``, or is None when there were no errors.
    """
    if len(completions) != len(answers):
        raise ValueError(f"score_batch: {len(completions)} completions but {len(answers)} answers")
    fn = resolve_reward(fn)
    keys = trajectory_keywords(fn) if trajectories is not None else ()
    scores: list[float] = []
    n_err, first = 0, None
    for i, (c, a) in enumerate(zip(completions, answers)):
        try:
            v = float(fn(c, a, **{k: trajectories[i][k] for k in keys}))
            if not math.isfinite(v):
                raise ValueError(f"reward returned a non-finite value {v!r}")
        except Exception as e:  # noqa: BLE001 - one bad sample must not kill the step
            n_err += 1
            if first is None:
                name = getattr(fn, "__qualname__", repr(fn))
                first = f"sample {i}: {type(e).__name__}: {e} (in reward {name})"
            v = 0.0
        scores.append(v)
    return scores, n_err, first
