"""Rule rewards: math answer verifier, format reward, the smoke-task reward; batch scoring."""
from .format import format_reward
from .math import answers_match, extract_answer, last_boxed, last_number, math_verify, normalize_answer, parse_number
from .registry import BUILTIN_REWARDS, RewardFn, resolve_reward, score_batch
from .smoke import smoke_reward

__all__ = [
    "BUILTIN_REWARDS", "RewardFn", "answers_match", "extract_answer", "format_reward", "last_boxed",
    "last_number", "math_verify", "normalize_answer", "parse_number", "resolve_reward", "score_batch",
    "smoke_reward",
]
