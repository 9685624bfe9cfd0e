"""Rollout-train mismatch statistics and the TIS / MIS corrections, against hand-computed values."""
import math

import pytest
import torch

from rlrecipes.algos import ppo_clip_policy_loss
from rlrecipes.algos.rollout_correction import importance_weights, mismatch_stats
from rlrecipes.algos.spec import actor_loss_fn
from rlrecipes.recipe import AlgorithmConfig

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# d = logp_train - logp_rollout: w = e^d = 1, e^1 (2.718), e^-1 (0.368); e^0.5 (1.649), e^2 (7.389); padding
TRAIN = torch.tensor([[-1.0, -1.0, -2.0], [-1.0, -1.0, float("nan")]])
ROLL = torch.tensor([[-1.0, -2.0, -1.0], [-1.5, -3.0, 0.0]])


def test_mismatch_stats():
    s = mismatch_stats(TRAIN, ROLL, MASK)
    assert s["diff_sum"].item() == pytest.approx(0 + 1 + 1 + 0.5 + 2)
    assert s["diff_max"].item() == pytest.approx(2.0)
    assert s["tokens"].item() == 5


def test_tis_truncates_at_the_cap():
    w, m = importance_weights(TRAIN, ROLL, MASK, "tis", cap=2.0)
    expect = torch.tensor([[1.0, 2.0, math.exp(-1)], [math.exp(0.5), 2.0, 0.0]])
    assert torch.allclose(w, expect, atol=1e-6)
    assert m["capped"].item() == 2 and m["weight_sum"].item() == pytest.approx(expect.sum().item(), rel=1e-6)


def test_mis_masks_tokens_past_the_cap():
    w, m = importance_weights(TRAIN, ROLL, MASK, "mis", cap=2.0)
    expect = torch.tensor([[1.0, 0.0, math.exp(-1)], [math.exp(0.5), 0.0, 0.0]])
    assert torch.allclose(w, expect, atol=1e-6)
    assert m["capped"].item() == 2
    with pytest.raises(ValueError, match="rollout_correction"):
        importance_weights(TRAIN, ROLL, MASK, "is", cap=2.0)


def test_weights_scale_the_policy_loss_per_token():
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    adv = torch.ones(2, 3)
    w = torch.tensor([[1.0, 2.0, 0.5], [0.0, 1.0, 9.0]])
    loss, _ = ppo_clip_policy_loss(logp, logp.detach(), adv, MASK, token_weights=w, loss_agg_mode="token-mean")
    # on-policy ratio 1: per-token loss -A = -1, weighted and averaged over the 5 valid tokens
    assert loss.item() == pytest.approx(-(1 + 2 + 0.5 + 0 + 1) / 5)
    loss.backward()
    assert logp.grad[0, 1].item() == pytest.approx(-2 / 5) and logp.grad[1, 0].item() == 0.0


def test_actor_closure_reports_mismatch_and_applies_tis():
    cfg = AlgorithmConfig(name="grpo", use_kl_loss=False, rollout_correction="tis", rollout_correction_cap=2.0)
    mb = {"response_mask": MASK, "advantages": torch.ones(2, 3), "rollout_log_probs": ROLL,
          "old_log_probs": torch.nan_to_num(TRAIN)}
    logp = torch.nan_to_num(TRAIN).clone().requires_grad_(True)
    loss, m = actor_loss_fn(cfg, agg={}, kl_coef=0.0, use_ref=False, dp_size=1)(logp, None, mb)
    assert m["rollout/logprob_diff_sum"] == pytest.approx(4.5) and m["rollout/logprob_diff_max"] == 2.0
    assert m["rollout/tokens_sum"] == 5 and m["rollout/is_capped_sum"] == 2
    w = torch.tensor([1.0, 2.0, math.exp(-1), math.exp(0.5), 2.0])
    assert loss.item() == pytest.approx(-(w.sum() / 5).item(), rel=1e-5)
    plain = AlgorithmConfig(name="grpo", use_kl_loss=False)
    loss0, m0 = actor_loss_fn(plain, agg={}, kl_coef=0.0, use_ref=False, dp_size=1)(logp, None, mb)
    assert loss0.item() == pytest.approx(-1.0) and "rollout/is_weight_sum" not in m0
