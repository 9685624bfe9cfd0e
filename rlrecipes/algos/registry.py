"""Every name a recipe's ``algorithm:`` section can use, and where it is implemented.

Each table is a :class:`~rlrecipes.algos._util.Registry` defined next to its implementations, which
register themselves with a decorator (add a KL estimator by decorating a function in ``kl.py``).
The workflow dispatches through these tables; an unknown name raises a ValueError naming the
recipe key, the choices and the closest match. ``names.py`` lists every name, the algorithms' own
included (``spec.py`` uses these tables, so this module does not import it).
"""
from __future__ import annotations

from typing import Callable

from ._util import Registry
from .advantages import ADV_ESTIMATORS
from .kl import KL_CONTROLLERS, KL_ESTIMATORS
from .losses import LOSS_AGG, POLICY_LOSSES


TABLES: dict[str, Registry] = {t.key: t for t in (ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG, POLICY_LOSSES, KL_CONTROLLERS)}


def get_adv_estimator(name: str) -> Callable:
    """``algorithm.adv_estimator``: grpo | grpo_no_std (drgrpo) | gae."""
    return ADV_ESTIMATORS.get(name)


def get_kl_estimator(name: str) -> Callable:
    """``algorithm.kl_estimator``: ``fn(logp, ref_logp) -> [batch, seq]``."""
    est = KL_ESTIMATORS.get(name)
    return lambda logp, ref_logp: est(logp - ref_logp)


def get_loss_agg(name: str) -> Callable:
    """``algorithm.loss_agg_mode``: ``fn(loss_mat, response_mask, global_tokens=.., global_seqs=..)``."""
    from .losses import aggregate_loss

    LOSS_AGG.get(name)
    return lambda loss_mat, mask, **kw: aggregate_loss(loss_mat, mask, name, **kw)


def get_policy_loss(name: str) -> Callable:
    """``algorithm.policy_loss``: ppo_clip (covers clip-higher and dual-clip)."""
    return POLICY_LOSSES.get(name)


def get_kl_controller(name: str) -> Callable:
    """``algorithm.kl_controller``: ``factory(kl_coef, kl_target, kl_horizon)``."""
    return KL_CONTROLLERS.get(name)
