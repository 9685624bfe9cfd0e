"""Every name a recipe's ``algorithm:`` section accepts: the algorithms of ``spec.py`` and the
names in the registries of ``registry.py``.

It is its own module because ``spec.py`` builds its losses through the registries, so
``registry.py`` cannot import ``spec.py`` back.
"""
from __future__ import annotations

from .registry import TABLES
from .spec import ALGORITHMS, get_algorithm


def check_algorithm_name(name: str) -> str:
    """``algorithm.name``: grpo | dapo | ppo."""
    return get_algorithm(name).name


def list_names() -> dict[str, list[str]]:
    """Every registered name per recipe key (for ``rlrecipes show`` / docs)."""
    return {"algorithm.name": list(ALGORITHMS), **{k: t.names() for k, t in TABLES.items()}}
