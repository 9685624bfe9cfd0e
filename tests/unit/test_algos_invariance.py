"""Loss aggregation is invariant to DP / micro-batch splitting; skipping the old-log-prob forward
on on-policy data gives the same gradients as recomputing it."""
import pytest
import torch

from rlrecipes.algos import (
    LOSS_AGG_MODES,
    aggregate_loss,
    is_on_policy,
    logprobs_from_logits,
    loss_normalisers,
    mini_batches_per_rollout,
    old_log_prob_or_detached,
    ppo_clip_policy_loss,
    resolve_skip_old_log_prob,
)

B, T, V, H = 8, 7, 13, 5


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([7, 1, 3, 5, 2, 6, 4, 7])  # right-padded, different lengths
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()  # [B, T]
    adv = torch.randn(B, generator=g, dtype=torch.float64)[:, None] * mask
    old = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1 - 2.5
    return x, labels, mask, adv, old


def _loss(w, x, labels, mask, adv, old, mode, **norm):
    logits = x @ w  # [b, t, V]
    logp = logprobs_from_logits(logits, labels, chunk_size=4).double()
    loss, _ = ppo_clip_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                   dual_clip_c=3.0, loss_agg_mode=mode, **norm)
    return loss


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_split_gradient_equals_unsplit(mode, splits):
    x, labels, mask, adv, old = _batch()
    w0 = torch.randn(H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    norm_len = T
    # unsplit reference (local normalisers == global ones)
    w = w0.clone().requires_grad_(True)
    _loss(w, x, labels, mask, adv, old, mode, norm_len=norm_len).backward()
    g_ref = w.grad.clone()

    # global normalisers = sum of local counts (what an all-reduce over ranks/micro-batches gives)
    parts = torch.arange(B).chunk(splits)
    counts = [loss_normalisers(mask[p]) for p in parts]
    gt, gs = sum(c["tokens"] for c in counts), sum(c["seqs"] for c in counts)
    w = w0.clone().requires_grad_(True)
    total = 0.0
    for p in parts:
        # each micro-batch is trimmed to its own longest response, as dynamic padding would do
        tmax = int(mask[p].sum(-1).max())
        sl = (p, slice(0, tmax))
        loss = _loss(w, x[p, :tmax], labels[sl[0]][:, :tmax], mask[p, :tmax], adv[p, :tmax], old[p, :tmax], mode,
                     global_tokens=gt, global_seqs=gs, norm_len=norm_len)
        loss.backward()  # gradients accumulate = summed over micro-batches / ranks
        total += loss.item()
    assert torch.allclose(w.grad, g_ref, atol=1e-12, rtol=1e-9)
    unsplit = _loss(w0, x, labels, mask, adv, old, mode, norm_len=norm_len).item()
    assert total == pytest.approx(unsplit, rel=1e-9)


def test_local_normalisers_are_not_invariant():
    """Without the global normaliser the split result differs -- the test above can fail."""
    x, labels, mask, adv, old = _batch()
    w0 = torch.randn(H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = w0.clone().requires_grad_(True)
    _loss(w, x, labels, mask, adv, old, "token-mean").backward()
    g_ref = w.grad.clone()
    w = w0.clone().requires_grad_(True)
    for p in torch.arange(B).chunk(2):
        (_loss(w, x[p], labels[p], mask[p], adv[p], old[p], "token-mean") / 2).backward()
    assert not torch.allclose(w.grad, g_ref, atol=1e-6)


def test_dp_size_rescales_for_averaging_reducers():
    x, labels, mask, adv, old = _batch()
    w0 = torch.randn(H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = w0.clone().requires_grad_(True)
    _loss(w, x, labels, mask, adv, old, "seq-mean-token-mean").backward()
    g_ref = w.grad.clone()
    parts = torch.arange(B).chunk(4)
    gs = sum(loss_normalisers(mask[p])["seqs"] for p in parts)
    grads = []
    for p in parts:  # 4 DP ranks; the reducer averages
        w = w0.clone().requires_grad_(True)
        _loss(w, x[p], labels[p], mask[p], adv[p], old[p], "seq-mean-token-mean", global_seqs=gs, dp_size=4).backward()
        grads.append(w.grad)
    assert torch.allclose(torch.stack(grads).mean(0), g_ref, atol=1e-12)


# ------------------------------------------------------------------ on-policy old-log-prob rule
def test_on_policy_rule():
    assert is_on_policy(1, 1)
    assert not is_on_policy(2, 1) and not is_on_policy(1, 4)
    assert mini_batches_per_rollout(256, 64) == 4
    with pytest.raises(ValueError, match="not a multiple"):
        mini_batches_per_rollout(256, 60)
    assert resolve_skip_old_log_prob("auto", 1, 1) is True
    assert resolve_skip_old_log_prob("auto", 1, 4) is False
    assert resolve_skip_old_log_prob(False, 1, 1) is False
    assert resolve_skip_old_log_prob("true", 1, 1) is True
    with pytest.raises(ValueError, match="ppo_epochs=2"):
        resolve_skip_old_log_prob(True, 2, 1)
    with pytest.raises(ValueError, match="auto, true or false"):
        resolve_skip_old_log_prob("sometimes", 1, 1)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_skipped_old_log_prob_gives_recomputed_gradients(mode):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(V, 16), torch.nn.Tanh(), torch.nn.Linear(16, V)).double()
    tokens = torch.randint(0, V, (B, T + 1))
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    _, _, mask, adv, _ = _batch(3)

    # path A: a separate no-grad forward for the old log-probs (same weights: on-policy)
    with torch.no_grad():
        old = logprobs_from_logits(model(inp), labels)
    logp = logprobs_from_logits(model(inp), labels)
    loss_a, m_a = ppo_clip_policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                       loss_agg_mode=mode)
    grads_a = torch.autograd.grad(loss_a, list(model.parameters()))

    # path B: the forward is skipped; old = logp.detach()
    logp = logprobs_from_logits(model(inp), labels)
    loss_b, m_b = ppo_clip_policy_loss(logp, old_log_prob_or_detached(logp, None), adv, mask,
                                       clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
    grads_b = torch.autograd.grad(loss_b, list(model.parameters()))
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-12)
    assert m_b["ratio_mean"].item() == 1.0 and m_b["clipfrac"].item() == 0.0
    assert any(g.abs().sum() > 0 for g in grads_b)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.allclose(ga, gb, atol=1e-12)

    # after one optimizer step the data is off-policy: the stale old log-probs now differ
    with torch.no_grad():
        for p_, g in zip(model.parameters(), grads_a):
            p_ -= 0.5 * g
    logp = logprobs_from_logits(model(inp), labels)
    assert not torch.allclose(logp.detach(), old)
    assert old_log_prob_or_detached(logp, old) is old
