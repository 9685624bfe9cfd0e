"""GSPO's sequence-level ratio and clip against hand-computed values."""
import math

import pytest
import torch

from rlrecipes.algos import get_policy_loss
from rlrecipes.algos.spec import actor_loss_fn
from rlrecipes.recipe import AlgorithmConfig

gspo = get_policy_loss("gspo")
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_sequence_ratio_is_length_normalised_and_clipped_per_sequence():
    old = torch.zeros(2, 3)
    # seq 0: log-ratios 0.1, 0.3 (mean 0.2) -> s0 = e^0.2; seq 1: -0.3, 0, 0 (mean -0.1) -> s1 = e^-0.1
    logp = torch.tensor([[0.1, 0.3, 5.0], [-0.3, 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, m = gspo(logp, old, adv, MASK, clip_ratio_low=0.05, clip_ratio_high=0.1,
                   loss_agg_mode="seq-mean-token-mean")
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    # A0 = +1: max(-s0, -clip(s0, .95, 1.1)) = -1.1 ; A1 = -1: max(s1, clip(s1)) = max(0.905, 0.95) = 0.95
    assert loss.item() == pytest.approx((-1.1 + 0.95) / 2, rel=1e-6)
    assert m["clipfrac"].item() == 1.0 and m["ratio_mean"].item() == pytest.approx((s0 + s1) / 2, rel=1e-6)
    loss.backward()
    assert torch.all(logp.grad == 0)  # both sequences clipped: no gradient, padding included


def test_unclipped_gradient_is_s_times_advantage_over_length():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.01, 0.03, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]])
    loss, _ = gspo(logp, old, adv, MASK, clip_ratio_low=0.5, clip_ratio_high=0.5, loss_agg_mode="seq-mean-token-mean")
    s0 = math.exp(0.02)
    assert loss.item() == pytest.approx(-(2 * s0 + 1.0) / 2, rel=1e-6)
    loss.backward()
    # d loss / d logp_it = -A_i s_i / |y_i| / G
    assert logp.grad[0, 0].item() == pytest.approx(-2 * s0 / 2 / 2, rel=1e-6)
    assert logp.grad[1, 2].item() == pytest.approx(-1.0 / 3 / 2, rel=1e-6)
    assert logp.grad[0, 2].item() == 0.0


def test_gspo_on_policy_equals_grpo_seq_mean_token_mean_and_uses_its_own_clip_keys():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    adv = torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, -1.0]])
    a, _ = gspo(logp, logp.detach(), adv, MASK, loss_agg_mode="seq-mean-token-mean")
    b, _ = get_policy_loss("ppo_clip")(logp, logp.detach(), adv, MASK, loss_agg_mode="seq-mean-token-mean")
    assert a.item() == pytest.approx(b.item())
    cfg = AlgorithmConfig(name="grpo", policy_loss="gspo", gspo_clip_low=0.05, gspo_clip_high=0.1,
                          loss_agg_mode="seq-mean-token-mean", use_kl_loss=False)
    mb = {"response_mask": MASK, "advantages": adv, "old_log_probs": torch.zeros(2, 3)}
    lp = torch.tensor([[0.1, 0.3, 0.0], [-0.3, 0.0, 0.0]], requires_grad=True)
    loss, m = actor_loss_fn(cfg, agg={}, kl_coef=0.0, use_ref=False, dp_size=1)(lp, None, mb)
    assert loss.item() == pytest.approx((-0.5 * 1.1 + 0.95) / 2, rel=1e-6) and m["actor/clipfrac"] == 1.0
