"""Policy and value losses, and loss aggregation that is invariant to batch splitting.

Aggregation modes (``algorithm.loss_agg_mode``), for a loss matrix ``L [batch, seq]`` and a
response mask ``M``; ``N_tok`` and ``N_seq`` are the GLOBAL numbers of valid tokens and of
sequences (with at least one valid token) in the whole optimizer mini-batch, over all DP ranks
and micro-batches:

* ``token-mean``             : ``sum(L*M) / N_tok``                   (DAPO)
* ``seq-mean-token-sum``     : ``sum_i sum_t(L*M)_i / N_seq``
* ``seq-mean-token-mean``    : ``sum_i [sum_t(L*M)_i / len_i] / N_seq``  (original GRPO)
* ``seq-mean-token-sum-norm``: ``sum(L*M) / (N_seq * norm_len)``    (Dr. GRPO, norm_len a constant
  such as the maximum response length)

Each micro-batch returns its *share* of the global loss, so summing the gradients of every
micro-batch on every rank gives exactly the gradient of the unsplit batch. If the data-parallel
reducer *averages* gradients over ranks (the FSDP/DDP default), pass ``dp_size`` so the share is
multiplied back.
"""
from __future__ import annotations

import torch

from ._util import Registry, check_same_shape, masked_mean, masked_select_zero



def loss_normalisers(response_mask: torch.Tensor) -> dict[str, int]:
    """Local counts to all-reduce (sum) into the global normalisers.

    Returns ``{"tokens": valid tokens, "seqs": sequences with >= 1 valid token}`` for a
    ``[batch, seq]`` mask. Sum these over micro-batches and DP ranks, then pass them to
    :func:`aggregate_loss` as ``global_tokens`` / ``global_seqs``.
    """
    m = response_mask.bool()
    return {"tokens": int(m.sum().item()), "seqs": int(m.any(-1).sum().item())}


def _positive(x, name: str):
    if isinstance(x, torch.Tensor):
        return x.clamp(min=1)
    if x <= 0:
        # An empty mini-batch contributes nothing; avoid 0/0 = nan.
        return 1
    return x


#: ``algorithm.loss_agg_mode``: name -> ``fn(loss_mat, mask, n_tokens, n_seqs, norm_len) -> scalar``
#: with ``loss_mat`` already zeroed (by selection) outside the mask.
LOSS_AGG = Registry("loss_agg_mode", "algorithm.loss_agg_mode")


@LOSS_AGG.register("token-mean")
def _token_mean(lm, m, n_tok, n_seq, norm_len):
    return lm.sum() / n_tok


@LOSS_AGG.register("seq-mean-token-sum")
def _seq_mean_token_sum(lm, m, n_tok, n_seq, norm_len):
    return lm.sum(-1).sum() / n_seq


@LOSS_AGG.register("seq-mean-token-mean")
def _seq_mean_token_mean(lm, m, n_tok, n_seq, norm_len):
    return (lm.sum(-1) / m.sum(-1).clamp(min=1)).sum() / n_seq


@LOSS_AGG.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(lm, m, n_tok, n_seq, norm_len):
    return lm.sum() / (n_seq * norm_len)


LOSS_AGG_MODES = tuple(LOSS_AGG.names())


def aggregate_loss(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: float | int | torch.Tensor | None = None,
    global_seqs: float | int | torch.Tensor | None = None,
    norm_len: int | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Reduce a ``[batch, seq]`` per-token loss to a scalar.

    Args:
        loss_mat: ``[batch, seq]`` per-token loss. Values at masked-out positions are never read
            (selected away, so a NaN in padding cannot reach the loss).
        response_mask: ``[batch, seq]`` 1 on tokens that count.
        mode: a name in :data:`LOSS_AGG` (see the module docstring).
        global_tokens: total valid tokens of the whole mini-batch (all ranks, all micro-batches);
            defaults to this call's own count (then the result is a plain local mean).
        global_seqs: total sequences of the whole mini-batch; defaults to this call's own count.
        norm_len: the constant of ``seq-mean-token-sum-norm`` (e.g. max response length);
            defaults to ``seq`` of this tensor, which is only split-invariant if every micro-batch
            is padded to the same length, so pass it explicitly.
        dp_size: multiply by this when gradients are averaged (not summed) across DP ranks.
    Returns:
        0-dim tensor.
    """
    check_same_shape(loss_mat=loss_mat, response_mask=response_mask)
    agg = LOSS_AGG.get(mode)
    local = loss_normalisers(response_mask)
    n_tok = _positive(local["tokens"] if global_tokens is None else global_tokens, "global_tokens")
    n_seq = _positive(local["seqs"] if global_seqs is None else global_seqs, "global_seqs")
    nl = _positive(loss_mat.shape[-1] if norm_len is None else norm_len, "norm_len")
    m = response_mask.to(loss_mat.dtype)  # [batch, seq]
    return agg(masked_select_zero(loss_mat, response_mask), m, n_tok, n_seq, nl) * dp_size


#: ``algorithm.policy_loss``: name -> ``fn(logp, old_logp, advantages, mask, **kw) -> (loss, metrics)``.
POLICY_LOSSES = Registry("policy_loss", "algorithm.policy_loss")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    dual_clip_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    token_weights: torch.Tensor | None = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher (DAPO) and dual-clip (Ye et al. 2020).

    ``r = exp(logp - old_logp)``; ``L = max(-A r, -A clip(r, 1-eps_low, 1+eps_high))``; for
    ``A < 0`` dual-clip caps it: ``L = min(L, -A c)`` (``c > 1``; ``None`` disables).

    Args:
        logp: ``[batch, seq]`` current log-probs (with grad).
        old_logp: ``[batch, seq]`` behaviour log-probs (no grad; ``logp.detach()`` when on-policy).
        advantages: ``[batch, seq]``.
        response_mask: ``[batch, seq]``.
        clip_ratio_low, clip_ratio_high: eps_low and eps_high (``None`` -> eps_low).
        dual_clip_c: dual-clip constant, > 1, or ``None``.
        token_weights: ``[batch, seq]`` detached per-token weights applied to the loss (the
            rollout-mismatch importance weights of :func:`rlrecipes.algos.rollout_correction`).
        loss_agg_mode, **agg_kwargs: passed to :func:`aggregate_loss` (``global_tokens``, ...).
    Returns:
        ``(loss 0-dim, metrics)``; metrics (detached, local masked means): ``clipfrac`` (share of
        tokens where the clipped branch is active), ``clipfrac_lower`` (dual-clip active),
        ``ppo_kl`` (mean ``old_logp - logp``), ``ratio_mean``.
    """
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, response_mask=response_mask)
    eps_high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"algorithm.dual_clip_c must be > 1 (or null to disable); got {dual_clip_c}")
    # padded positions are selected away before exp(): their gradient is exactly 0, never nan
    logp, old_logp, advantages = (masked_select_zero(t, response_mask) for t in (logp, old_logp, advantages))
    log_ratio = (logp - old_logp).clamp(min=-20.0, max=20.0)  # [batch, seq]
    ratio = log_ratio.exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + eps_high)
    clipped = torch.maximum(pg1, pg2)  # [batch, seq]
    clip_active = (pg2 > pg1)
    if dual_clip_c is not None:
        pg3 = -advantages * dual_clip_c
        lower = torch.minimum(clipped, pg3)
        neg = advantages < 0
        lower_active = (clipped > pg3) & neg
        loss_mat = torch.where(neg, lower, clipped)
    else:
        lower_active = torch.zeros_like(clip_active)
        loss_mat = clipped
    if token_weights is not None:
        loss_mat = loss_mat * masked_select_zero(token_weights.detach(), response_mask)
    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(clip_active.float(), response_mask),
            "clipfrac_lower": masked_mean(lower_active.float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "ratio_mean": masked_mean(ratio, response_mask),
        }
    return loss, metrics


ppo_clip_policy_loss.clip_keys = ("clip_ratio_low", "clip_ratio_high")  # the recipe keys of its clip range


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float | None = 4e-4,
    dual_clip_c: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    token_weights: torch.Tensor | None = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, clipped per sequence.

    ``s_i = exp(mean_t(logp - old_logp))`` over sequence ``i``'s response tokens (the length-normalised
    log-ratio). In token form, ``s_it = sg[s_i] * exp(logp_t - sg[logp_t])`` has the value ``s_i``
    and the gradient ``s_i * grad logp_t``, so with ``seq-mean-token-mean`` aggregation (the paper's
    ``1/G sum_i 1/|y_i| sum_t``) it is exactly GSPO's gradient, and any aggregation mode still works.
    ``L_it = max(-A_i s_it, -A_i clip(s_it, 1 - eps_low, 1 + eps_high))``: the clip range is much
    narrower than PPO's (``algorithm.gspo_clip_low/high``, 3e-4 / 4e-4 in the paper).
    ``dual_clip_c`` is ignored (sequence ratios are already bounded by the clip).

    Returns ``(loss, metrics)``: ``clipfrac`` (share of sequences whose ratio is clipped),
    ``ppo_kl`` (mean ``old - new`` log-ratio over tokens), ``ratio_mean`` (mean ``s_i``).
    """
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, response_mask=response_mask)
    eps_high = clip_ratio_low if clip_ratio_high is None else clip_ratio_high
    logp, old_logp, advantages = (masked_select_zero(t, response_mask) for t in (logp, old_logp, advantages))
    mask = response_mask.to(logp.dtype)  # [batch, seq]
    lengths = mask.sum(-1).clamp(min=1.0)  # [batch]
    seq_log_ratio = (logp - old_logp).sum(-1) / lengths  # [batch]
    s_seq = seq_log_ratio.clamp(min=-20.0, max=20.0).exp()  # [batch]
    s_tok = s_seq.detach()[:, None] * (logp - logp.detach()).exp()  # [batch, seq]: value s_i
    pg1 = -advantages * s_tok
    pg2 = -advantages * s_tok.clamp(1.0 - clip_ratio_low, 1.0 + eps_high)
    loss_mat = torch.maximum(pg1, pg2)  # [batch, seq]
    if token_weights is not None:
        loss_mat = loss_mat * masked_select_zero(token_weights.detach(), response_mask)
    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        has = response_mask.bool().any(-1)
        clipped = ((s_seq < 1.0 - clip_ratio_low) | (s_seq > 1.0 + eps_high)) & has
        metrics = {
            "clipfrac": clipped.float().sum() / has.float().sum().clamp(min=1.0),
            "clipfrac_lower": torch.zeros(()),
            "ppo_kl": masked_mean(-(logp - old_logp), response_mask),
            "ratio_mean": s_seq[has].mean() if has.any() else torch.ones(()),
        }
    return loss, metrics


gspo_policy_loss.clip_keys = ("gspo_clip_low", "gspo_clip_high")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    value_clip: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``.

    Args:
        values: ``[batch, seq]`` current critic values (with grad).
        old_values: ``[batch, seq]`` values at rollout time.
        returns: ``[batch, seq]`` GAE returns.
        response_mask: ``[batch, seq]``.
        value_clip: ``c``; ``None`` gives the unclipped ``0.5 (V - R)^2``.
    Returns:
        ``(loss, {"vf_clipfrac": share of tokens where the clipped term is larger})``.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    values, old_values, returns = (masked_select_zero(t, response_mask) for t in (values, old_values, returns))
    l1 = (values - returns).square()  # [batch, seq]
    if value_clip is None:
        loss_mat = 0.5 * l1
        active = torch.zeros_like(l1, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
        l2 = (v_clip - returns).square()
        loss_mat = 0.5 * torch.maximum(l1, l2)
        active = l2 > l1
    loss = aggregate_loss(loss_mat, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean(active.float(), response_mask)}
    return loss, metrics


def entropy_bonus(
    entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", **agg_kwargs
) -> torch.Tensor:
    """Aggregated entropy ``[batch, seq] -> scalar``; the actor loss subtracts ``entropy_coef * this``."""
    return aggregate_loss(entropy, response_mask, loss_agg_mode, **agg_kwargs)


def kl_loss(
    logp: torch.Tensor, ref_logp: torch.Tensor, response_mask: torch.Tensor, estimator: str = "k3",
    loss_agg_mode: str = "token-mean", **agg_kwargs,
) -> torch.Tensor:
    """KL-as-loss term (``use_kl_loss``): aggregated per-token KL to the reference policy."""
    from .kl import kl_penalty

    logp, ref_logp = masked_select_zero(logp, response_mask), masked_select_zero(ref_logp, response_mask)
    return aggregate_loss(kl_penalty(logp, ref_logp, estimator), response_mask, loss_agg_mode, **agg_kwargs)
