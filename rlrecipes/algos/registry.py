"""Names used in recipe YAML (``algorithm:`` section) -> the functions that implement them.

Unknown names raise a ValueError listing the choices plus a difflib "did you mean".
"""
from __future__ import annotations

import functools
from typing import Callable

from ._util import unknown_name_error
from .advantages import gae_advantage, grpo_advantage
from .kl import AdaptiveKLController, FixedKLController, kl_penalty
from .losses import LOSS_AGG_MODES, aggregate_loss, ppo_clip_policy_loss

ADV_ESTIMATORS: dict[str, Callable] = {
    "grpo": functools.partial(grpo_advantage, norm_by_std=True),
    "grpo_no_std": functools.partial(grpo_advantage, norm_by_std=False),
    "drgrpo": functools.partial(grpo_advantage, norm_by_std=False),
    "gae": gae_advantage,
}
#: estimators that need a critic (values)
CRITIC_ESTIMATORS = frozenset({"gae"})

KL_ESTIMATORS: dict[str, Callable] = {
    name: functools.partial(kl_penalty, estimator=name) for name in ("k1", "abs", "k2", "mse", "k3", "low_var_kl")
}

LOSS_AGG: dict[str, Callable] = {mode: functools.partial(aggregate_loss, mode=mode) for mode in LOSS_AGG_MODES}

POLICY_LOSSES: dict[str, Callable] = {"ppo_clip": ppo_clip_policy_loss}

KL_CONTROLLERS: dict[str, type] = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}

ALGORITHM_NAMES = ("grpo", "dapo", "ppo")


def _get(table: dict, kind: str, name: str, key: str):
    if name not in table:
        raise unknown_name_error(kind, name, table.keys(), key)
    return table[name]


def get_adv_estimator(name: str) -> Callable:
    """``algorithm.adv_estimator``: grpo | grpo_no_std (drgrpo) | gae."""
    return _get(ADV_ESTIMATORS, "adv_estimator", name, "algorithm.adv_estimator")


def get_kl_estimator(name: str) -> Callable:
    """``algorithm.kl_estimator``: k1 | abs | k2 (mse) | k3 (low_var_kl). ``fn(logp, ref_logp)``."""
    return _get(KL_ESTIMATORS, "kl_estimator", name, "algorithm.kl_estimator")


def get_loss_agg(name: str) -> Callable:
    """``algorithm.loss_agg_mode``. ``fn(loss_mat, response_mask, global_tokens=.., global_seqs=..)``."""
    return _get(LOSS_AGG, "loss_agg_mode", name, "algorithm.loss_agg_mode")


def get_policy_loss(name: str) -> Callable:
    """``algorithm.policy_loss``: ppo_clip (covers clip-higher and dual-clip)."""
    return _get(POLICY_LOSSES, "policy_loss", name, "algorithm.policy_loss")


def get_kl_controller(name: str) -> type:
    """``algorithm.kl_controller``: fixed | adaptive."""
    return _get(KL_CONTROLLERS, "kl_controller", name, "algorithm.kl_controller")


def check_algorithm_name(name: str) -> str:
    """``algorithm.name``: grpo | dapo | ppo."""
    return _get({n: n for n in ALGORITHM_NAMES}, "algorithm name", name, "algorithm.name")


def list_names() -> dict[str, list[str]]:
    """Every registered name per kind (for ``rlrecipes show`` / docs)."""
    return {
        "algorithm.name": list(ALGORITHM_NAMES),
        "algorithm.adv_estimator": sorted(ADV_ESTIMATORS),
        "algorithm.kl_estimator": sorted(KL_ESTIMATORS),
        "algorithm.loss_agg_mode": list(LOSS_AGG_MODES),
        "algorithm.policy_loss": sorted(POLICY_LOSSES),
        "algorithm.kl_controller": sorted(KL_CONTROLLERS),
    }
