"""KL estimators between the policy and the reference policy, and KL controllers.

Per-token estimators of ``KL(pi || pi_ref)`` from the log-probs of the sampled tokens
(Schulman, "Approximating KL divergence", 2020), with ``d = logp - ref_logp``:

* ``k1``  : ``d``                      (unbiased, high variance, can be negative)
* ``abs`` : ``|d|``
* ``k2`` / ``mse`` : ``0.5 * d**2``
* ``k3`` / ``low_var_kl`` : ``exp(-d) - 1 + d`` (= ``r - log r - 1`` with ``r = pi_ref/pi``),
  non-negative, low variance; clamped to ``[-10, 10]`` for stability.

The KL is used either as a loss term (``use_kl_loss``, GRPO) or subtracted from the token-level
reward before the advantage (``use_kl_in_reward``, PPO) with a fixed or adaptive coefficient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ._util import Registry, check_same_shape, masked_mean, masked_select_zero

K3_CLAMP = 10.0

#: ``algorithm.kl_estimator``: name -> ``fn(d) -> [batch, seq]`` with ``d = logp - ref_logp``.
KL_ESTIMATORS = Registry("kl_estimator", "algorithm.kl_estimator")


@KL_ESTIMATORS.register("k1")
def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


@KL_ESTIMATORS.register("abs")
def _abs(d: torch.Tensor) -> torch.Tensor:
    return d.abs()


@KL_ESTIMATORS.register("k2", "mse")
def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def _k3(d: torch.Tensor) -> torch.Tensor:
    neg = (-d).clamp(min=-20.0, max=20.0)  # log(pi_ref / pi), clamped before exp
    return (neg.exp() - neg - 1.0).clamp(min=-K3_CLAMP, max=K3_CLAMP)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate.

    Args:
        logp: ``[batch, seq]`` log-probs of the sampled tokens under the policy.
        ref_logp: ``[batch, seq]`` the same under the reference policy.
        estimator: a name in :data:`KL_ESTIMATORS` (k1, abs, k2/mse, k3/low_var_kl).
    Returns:
        ``[batch, seq]`` KL estimate per token (unmasked; aggregate it with the response mask).
    """
    check_same_shape(logp=logp, ref_logp=ref_logp)
    return KL_ESTIMATORS.get(estimator)(logp - ref_logp)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's outcome score on its last response token.

    Args:
        scores: ``[batch]``; response_mask: ``[batch, seq]`` right-padded.
    Returns:
        ``[batch, seq]`` zeros except ``scores[i]`` at the last valid token of row ``i``
        (rows without response tokens get nothing).
    """
    mask = response_mask.to(torch.long)
    lengths = mask.sum(-1)  # [batch]
    out = torch.zeros(response_mask.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32,
                      device=scores.device)
    has = lengths > 0
    rows = torch.arange(mask.shape[0], device=scores.device)[has]
    # index of the last valid token, robust to non-contiguous masks
    pos = torch.arange(mask.shape[1], device=scores.device).expand_as(mask)
    last = torch.where(mask.bool(), pos, torch.full_like(pos, -1)).max(-1).values  # [batch]
    out[rows, last[has]] = scores[has].to(out.dtype)
    return out


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-in-reward: ``r_t - kl_coef * KL_t`` on response tokens (``use_kl_in_reward``).

    Args:
        token_rewards: ``[batch, seq]``; logp, ref_logp: ``[batch, seq]``; response_mask ``[batch, seq]``.
    Returns:
        ``(penalised [batch, seq], {"kl": mean per-sequence KL (for the adaptive controller)})``.
    """
    kl = masked_select_zero(kl_penalty(logp.detach(), ref_logp.detach(), estimator), response_mask)  # [batch, seq]
    out = token_rewards - kl_coef * kl
    seq_kl = masked_mean(kl, response_mask, dim=-1)  # [batch]
    return out, {"kl": seq_kl.mean()}


#: ``algorithm.kl_controller``: name -> ``factory(kl_coef, kl_target, kl_horizon) -> controller``.
KL_CONTROLLERS = Registry("kl_controller", "algorithm.kl_controller")


class KLController(Protocol):
    """The KL coefficient the losses use this step (``value``) and its update from the measured KL."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        """Adapt ``value`` after a step that measured ``current_kl`` over ``n_steps`` samples."""
        ...


@dataclass
class FixedKLController:
    """Constant KL coefficient (``kl_controller: fixed``)."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:  # noqa: ARG002 - same API as adaptive
        return self.value


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (``kl_controller: adaptive``).

    After each step: ``e = clip(kl / target - 1, -0.2, 0.2)``; ``coef *= 1 + e * n_steps / horizon``.
    The coefficient grows when the measured KL is above ``target`` and shrinks below it.
    """

    value: float
    target: float
    horizon: float

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(
                f"adaptive KL controller needs algorithm.kl_target > 0 and algorithm.kl_horizon > 0; "
                f"got kl_target={self.target}, kl_horizon={self.horizon}"
            )

    def update(self, current_kl: float, n_steps: int) -> float:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
        return self.value


@KL_CONTROLLERS.register("fixed")
def _fixed(kl_coef: float, kl_target: float | None = None, kl_horizon: float | None = None) -> FixedKLController:
    return FixedKLController(float(kl_coef))


@KL_CONTROLLERS.register("adaptive")
def _adaptive(kl_coef: float, kl_target: float | None = None, kl_horizon: float | None = None) -> AdaptiveKLController:
    if kl_target is None or kl_horizon is None:
        raise ValueError("algorithm.kl_controller=adaptive needs algorithm.kl_target and algorithm.kl_horizon")
    return AdaptiveKLController(float(kl_coef), float(kl_target), float(kl_horizon))


def make_kl_controller(kind: str, kl_coef: float, kl_target: float | None = None,
                       kl_horizon: float | None = None) -> KLController:
    """Build the controller named by ``algorithm.kl_controller`` through :data:`KL_CONTROLLERS`."""
    return KL_CONTROLLERS.get(kind)(kl_coef, kl_target, kl_horizon)
