"""Hand-computed small examples for every algos formula."""
import math

import pytest
import torch

from rlrecipes.algos import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    apply_kl_penalty,
    entropy_from_logits,
    gae_advantage,
    grpo_advantage,
    kl_penalty,
    logprobs_and_entropy,
    logprobs_from_logits,
    make_kl_controller,
    ppo_clip_policy_loss,
    scores_to_token_rewards,
    value_loss,
)


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float64, **kw)


# ------------------------------------------------------------------ GRPO
def test_grpo_group_normalised_unbiased_std():
    scores = t([1.0, 2.0, 3.0, 5.0, 5.0, 0.0, 1.0])
    mask = torch.ones(7, 2)
    mask[0, 1] = 0  # padding gets 0
    adv, ret = grpo_advantage(scores, mask, torch.tensor([0, 0, 0, 1, 1, 2, 2]))
    # group 0: mean 2, unbiased std 1; group 1: constant -> 0; group 2: mean .5, std sqrt(.5)
    s2 = math.sqrt(0.5) + 1e-6
    expected = [-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0, 0.0, -0.5 / s2, 0.5 / s2]
    assert torch.allclose(adv[:, 0], t(expected).float(), atol=1e-6)
    assert adv[0, 1] == 0 and torch.equal(adv, ret)


def test_grpo_no_std_and_group_size_and_singletons():
    scores = t([1.0, 2.0, 3.0, 7.0])
    mask = torch.ones(4, 1)
    adv, _ = grpo_advantage(scores, mask, group_size=2, norm_by_std=False)
    assert adv[:, 0].tolist() == [-0.5, 0.5, -2.0, 2.0]
    # non-contiguous ids work the same as contiguous ones
    adv2, _ = grpo_advantage(scores[[0, 2, 1, 3]], mask, torch.tensor([0, 1, 0, 1]), norm_by_std=False)
    assert adv2[:, 0].tolist() == [-0.5, -2.0, 0.5, 2.0]
    # a one-sample group has nothing to compare with -> 0
    adv3, _ = grpo_advantage(t([4.0, 1.0, 3.0]), torch.ones(3, 1), torch.tensor([0, 1, 1]))
    assert adv3[0, 0] == 0
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantage(scores, mask, group_size=3)


# ------------------------------------------------------------------ GAE
def test_gae_hand_computed_with_padding():
    r = t([[0.0, 0.0, 1.0, 9.0]])
    v = t([[0.2, 0.4, 0.6, 5.0]])  # last position is padding: its value and reward must not leak
    m = t([[1, 1, 1, 0]])
    adv, ret = gae_advantage(r, v, m, gamma=0.9, lam=0.5, whiten=False)
    # delta2 = 1 - .6 = .4 ; delta1 = .9*.6 - .4 = .14 ; delta0 = .9*.4 - .2 = .16 ; gamma*lam = .45
    exp_adv = [0.16 + 0.45 * (0.14 + 0.45 * 0.4), 0.14 + 0.45 * 0.4, 0.4, 0.0]
    assert torch.allclose(adv, t([exp_adv]))
    assert torch.allclose(ret, t([[exp_adv[0] + 0.2, exp_adv[1] + 0.4, 1.0, 0.0]]))


def test_gae_lambda1_gamma1_is_return_minus_value_and_skips_masked_gap():
    r = t([[0.0, 0.0, 1.0]])
    v = t([[0.5, 0.3, 0.5]])
    adv, ret = gae_advantage(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0, whiten=False)
    assert torch.allclose(ret, t([[1.0, 1.0, 1.0]])) and torch.allclose(adv, 1 - v)
    # a masked token inside the response is skipped: same result as if it were absent
    r2, v2, m2 = t([[0.0, 7.0, 0.0, 1.0]]), t([[0.5, 9.0, 0.3, 0.5]]), t([[1, 0, 1, 1]])
    adv2, _ = gae_advantage(r2, v2, m2, gamma=0.9, lam=0.8, whiten=False)
    adv_ref, _ = gae_advantage(t([[0.0, 0.0, 1.0]]), v, torch.ones(1, 3), gamma=0.9, lam=0.8, whiten=False)
    assert torch.allclose(adv2[:, [0, 2, 3]], adv_ref) and adv2[0, 1] == 0


def test_gae_whitening_masked():
    torch.manual_seed(0)
    r, v = torch.randn(3, 5), torch.randn(3, 5)
    m = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).float()
    adv, _ = gae_advantage(r, v, m, whiten=True)
    vals = adv[m.bool()]
    assert abs(vals.mean().item()) < 1e-5 and abs(vals.std().item() - 1) < 1e-3
    assert (adv[~m.bool()] == 0).all()


# ------------------------------------------------------------------ KL
def test_kl_estimators_hand_computed():
    logp, ref = torch.log(t([[0.5]])), torch.log(t([[0.25]]))
    d = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(d)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "mse").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.5 + math.log(0.5) * -1 - 1)
    # k3 is clamped to [-10, 10]
    assert kl_penalty(t([[0.0]]), t([[30.0]]), "k3").item() == 10.0
    assert kl_penalty(t([[1.0]]), t([[1.0]]), "k3").item() == 0.0
    with pytest.raises(ValueError, match="unknown kl_estimator 'k4'.*Did you mean"):
        kl_penalty(logp, ref, "k4")


def test_kl_in_reward_and_token_rewards():
    scores = t([2.0, 3.0])
    mask = t([[1, 1, 0], [1, 1, 1]])
    tr = scores_to_token_rewards(scores, mask)
    assert tr.tolist() == [[0, 2, 0], [0, 0, 3]]
    logp = torch.zeros(2, 3, dtype=torch.float64)
    ref = torch.full((2, 3), -0.5, dtype=torch.float64)  # k1 = 0.5 per token
    out, m = apply_kl_penalty(tr, logp, ref, mask, kl_coef=0.1, estimator="k1")
    assert torch.allclose(out, t([[-0.05, 1.95, 0.0], [-0.05, -0.05, 2.95]]))
    assert m["kl"].item() == pytest.approx(0.5)


def test_kl_controllers():
    fixed = make_kl_controller("fixed", 0.2)
    assert isinstance(fixed, FixedKLController) and fixed.update(5.0, 100) == 0.2
    ad = make_kl_controller("adaptive", 0.1, kl_target=1.0, kl_horizon=100)
    assert isinstance(ad, AdaptiveKLController)
    assert ad.update(2.0, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error clipped to +0.2
    v = ad.value
    assert ad.update(0.95, 10) == pytest.approx(v * (1 - 0.05 * 10 / 100))
    with pytest.raises(ValueError, match="kl_target"):
        make_kl_controller("adaptive", 0.1)
    with pytest.raises(ValueError, match="Did you mean 'adaptive'"):
        make_kl_controller("adaptve", 0.1)


# ------------------------------------------------------------------ policy / value loss
def test_ppo_clip_higher_and_dual_clip_hand_computed():
    ratio = t([[1.5, 0.5, 1.5, 5.0, 0.5, 1.1]])
    adv = t([[1.0, 1.0, -1.0, -1.0, -1.0, 2.0]])
    logp = torch.log(ratio).clone().requires_grad_(True)
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss, m = ppo_clip_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0,
                                   loss_agg_mode="token-mean")
    # per token: -1.28 (clipped high), -0.5, 1.5, 3.0 (dual clip), 0.8 (clipped low), -2.2
    per_tok = [-1.28, -0.5, 1.5, 3.0, 0.8, -2.2]
    assert loss.item() == pytest.approx(sum(per_tok) / 6)
    assert m["clipfrac"].item() == pytest.approx(2 / 6)  # tokens 0 and 4 (token 3 is dual-clipped instead)
    assert m["clipfrac_lower"].item() == pytest.approx(1 / 6)
    loss.backward()
    g = logp.grad[0] * 6  # d(-A r)/dlogp = -A r where unclipped, else 0
    assert torch.allclose(g, t([0.0, -0.5, 1.5, 0.0, 0.0, -2.2]))


def test_ppo_symmetric_clip_without_dual():
    logp = torch.log(t([[1.5, 5.0]]))
    adv = t([[1.0, -1.0]])
    loss, m = ppo_clip_policy_loss(logp, torch.zeros_like(logp), adv, torch.ones_like(logp),
                                   clip_ratio_low=0.2, clip_ratio_high=None, dual_clip_c=None)
    assert loss.item() == pytest.approx((-1.2 + 5.0) / 2)
    assert m["clipfrac_lower"].item() == 0
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        ppo_clip_policy_loss(logp, logp, adv, torch.ones_like(logp), dual_clip_c=0.5)


def test_value_loss_clipped_hand_computed():
    v = t([[1.0, 0.1]]).requires_grad_(True)
    old, ret = t([[0.0, 0.0]]), t([[0.9, 0.3]])
    loss, m = value_loss(v, old, ret, torch.ones(1, 2), value_clip=0.2)
    # token0: l1 = .01, clipped pred .2 -> l2 = .49 -> .245 ; token1: l1 = .04, l2 = .04 -> .02
    assert loss.item() == pytest.approx((0.245 + 0.02) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    loss2, _ = value_loss(v, old, ret, torch.ones(1, 2), value_clip=None)
    assert loss2.item() == pytest.approx((0.5 * 0.01 + 0.5 * 0.04) / 2)


def test_aggregation_modes_hand_computed():
    L = t([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    M = t([[1, 1, 1], [1, 0, 0]])
    assert aggregate_loss(L, M, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate_loss(L, M, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate_loss(L, M, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate_loss(L, M, "seq-mean-token-sum-norm", norm_len=5).item() == pytest.approx(10 / (2 * 5))
    assert aggregate_loss(L, M, "token-mean", global_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate_loss(L, M, "token-mean", dp_size=4).item() == pytest.approx(10)
    assert aggregate_loss(L, torch.zeros_like(M), "token-mean").item() == 0.0  # empty: no nan
    with pytest.raises(ValueError, match="Did you mean 'token-mean'"):
        aggregate_loss(L, M, "token_mean")


# ------------------------------------------------------------------ log-probs / entropy
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_logprobs_entropy_match_full_softmax(chunk):
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    lp, ent = logprobs_and_entropy(logits, labels, chunk_size=chunk, temperature=0.7)
    ref_ls = torch.log_softmax(logits / 0.7, -1)
    ref_lp = ref_ls.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref_ls.exp() * ref_ls).sum(-1)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    g1 = torch.autograd.grad(lp.sum() + ent.sum(), logits)[0]
    g2 = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), logits)[0]
    assert torch.allclose(g1, g2, atol=1e-5)
    assert torch.allclose(logprobs_from_logits(logits, labels, chunk_size=chunk, temperature=0.7), lp)
    assert torch.allclose(entropy_from_logits(logits, chunk_size=chunk, temperature=0.7), ent)


def test_logprobs_hand_computed_and_shape_error():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    assert logprobs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.25))
    assert entropy_from_logits(logits).item() == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)))
    with pytest.raises(ValueError, match="disagree"):
        logprobs_from_logits(logits, torch.tensor([[1, 2]]))
