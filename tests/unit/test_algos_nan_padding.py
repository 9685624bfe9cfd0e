"""A NaN or inf at a padded position never reaches a loss, an advantage or a gradient.

Losses select with the mask (``torch.where``) instead of multiplying by it: ``nan * 0`` is nan.
"""
import pytest
import torch

from rlrecipes.algos import (
    LOSS_AGG_MODES,
    aggregate_loss,
    gae_advantage,
    kl_loss,

    ppo_clip_policy_loss,
    value_loss,
)
from rlrecipes.algos._util import masked_mean, masked_sum, masked_whiten

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # [2, 3] right-padded


def poisoned(x: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    return torch.where(MASK.bool(), x, torch.full_like(x, value))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_ignores_padding(mode, bad):
    x = torch.arange(6.0).reshape(2, 3)
    clean = aggregate_loss(x * MASK, MASK, mode)
    assert torch.isfinite(clean)
    assert aggregate_loss(poisoned(x, bad), MASK, mode).item() == pytest.approx(clean.item())


def test_masked_reductions_ignore_padding():
    x = torch.arange(6.0).reshape(2, 3)
    assert masked_sum(poisoned(x), MASK).item() == 0 + 1 + 3
    assert masked_mean(poisoned(x), MASK).item() == pytest.approx(4 / 3)
    w = masked_whiten(poisoned(x), MASK)
    assert torch.isfinite(w).all() and (w[~MASK.bool()] == 0).all()


def test_policy_loss_value_and_gradient_finite_with_nan_padding():
    logp = poisoned(torch.full((2, 3), -1.0)).requires_grad_(True)
    old = poisoned(torch.full((2, 3), -1.1))
    adv = poisoned(torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]))
    loss, m = ppo_clip_policy_loss(logp, old, adv, MASK)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in m.values())
    assert torch.isfinite(logp.grad).all() and (logp.grad[~MASK.bool()] == 0).all()
    ref = poisoned(torch.full((2, 3), -1.5))
    assert torch.isfinite(kl_loss(logp, ref, MASK, "k3"))


def test_value_loss_and_gae_finite_with_nan_padding():
    v = poisoned(torch.zeros(2, 3)).requires_grad_(True)
    loss, _ = value_loss(v, poisoned(torch.zeros(2, 3)), poisoned(torch.ones(2, 3)), MASK, value_clip=0.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(v.grad).all()
    adv, ret = gae_advantage(poisoned(torch.ones(2, 3)), poisoned(torch.zeros(2, 3)), MASK, whiten=True)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
