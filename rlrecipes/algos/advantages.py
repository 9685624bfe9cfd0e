"""Advantage estimators on padded ``[batch, seq]`` response tensors.

* :func:`grpo_advantage` -- GRPO outcome advantage, normalised within each prompt group:
  ``A_i = (s_i - mean_g) / (std_g + eps)`` with the unbiased (Bessel) std, broadcast over the
  response tokens. ``norm_by_std=False`` gives Dr. GRPO's ``A_i = s_i - mean_g``.
* :func:`gae_advantage` -- generalised advantage estimation (Schulman et al. 2016) for PPO with a
  critic, token level, masked; returns both advantages and value targets (returns).

Responses are right-padded; ``response_mask`` is 1 on real response tokens and 0 on padding.
"""
from __future__ import annotations

import torch

import functools

from ._util import Registry, check_same_shape, masked_select_zero, masked_whiten

#: ``algorithm.adv_estimator``: name -> estimator. Outcome estimators take ``(scores [batch],
#: response_mask, group_ids)``; critic estimators (:data:`CRITIC_ESTIMATORS`) take ``(token_rewards,
#: values, response_mask, gamma=, lam=)``. Both return ``(advantages, returns)``, ``[batch, seq]``.
ADV_ESTIMATORS = Registry("adv_estimator", "algorithm.adv_estimator")
#: estimators that need a critic (values)
CRITIC_ESTIMATORS = frozenset({"gae"})


def group_ids_from_size(batch: int, group_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Group index of each row when the ``n`` samples of a prompt are contiguous rows.

    Returns ``[batch]`` int64: ``[0]*n + [1]*n + ...``.
    """
    if group_size <= 0 or batch % group_size != 0:
        raise ValueError(
            f"batch of {batch} rows cannot be split into groups of {group_size}; "
            "the batch must hold whole prompt groups (prompts_per_step * n_samples_per_prompt rows)"
        )
    return torch.arange(batch, device=device).div(group_size, rounding_mode="floor")


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased group std and group size.

    Args:
        scores: ``[batch]`` float outcome scores.
        group_ids: ``[batch]`` int group index of each row (any integers; need not be contiguous).
    Returns:
        ``(mean [batch], std [batch], count [batch])`` -- the statistics of each row's group.
        A group of one sample has std 0.
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores must be [batch] and group_ids the same shape; got {tuple(scores.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [batch] -> 0..G-1
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    s = scores.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64, device=scores.device).index_add_(0, inverse, torch.ones_like(s))
    total = torch.zeros_like(count).index_add_(0, inverse, s)
    mean = total / count  # [groups]
    sq = torch.zeros_like(count).index_add_(0, inverse, (s - mean[inverse]) ** 2)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1.0), torch.zeros_like(sq))
    std = var.sqrt()
    return (mean[inverse].to(scores.dtype), std[inverse].to(scores.dtype), count[inverse].to(scores.dtype))


def grpo_advantage(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-normalised outcome advantage.

    Args:
        scores: ``[batch]`` outcome score of each sample (reward after any shaping).
        response_mask: ``[batch, seq]`` 1 on response tokens.
        group_ids: ``[batch]`` prompt-group index of each row, or ``None`` with ``group_size``
            when the samples of one prompt are contiguous rows.
        norm_by_std: divide by the unbiased group std (GRPO); ``False`` is Dr. GRPO.
        eps: added to the std.
    Returns:
        ``(advantages [batch, seq], returns [batch, seq])``; both equal the per-sample advantage on
        response tokens and 0 on padding. A one-sample group gets advantage 0 (nothing to compare).
    """
    if group_ids is None:
        if group_size is None:
            raise ValueError("grpo_advantage needs group_ids or group_size")
        group_ids = group_ids_from_size(scores.shape[0], group_size, scores.device)
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"response_mask must be [batch, seq] with batch={scores.shape[0]}; got {tuple(response_mask.shape)}"
        )
    scores = scores.float()
    mean, std, count = group_stats(scores, group_ids)  # [batch] each
    adv = scores - mean  # [batch]
    if norm_by_std:
        adv = adv / (std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    adv_tok = adv.unsqueeze(-1) * response_mask.to(adv.dtype)  # [batch, seq]
    return adv_tok, adv_tok.clone()


ADV_ESTIMATORS.register("grpo")(functools.partial(grpo_advantage, norm_by_std=True))
ADV_ESTIMATORS.register("grpo_no_std", "drgrpo")(functools.partial(grpo_advantage, norm_by_std=False))


@ADV_ESTIMATORS.register("gae")

def gae_advantage(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``; ``A_t = delta_t + gamma * lam * A_{t+1}``, where
    ``t+1`` is the next *valid* token (masked positions are skipped, and the value after the last
    valid token is 0 -- the episode ends there). ``returns = A + V`` (before whitening).

    Args:
        token_rewards: ``[batch, seq]`` reward per token (usually the score on the last token minus
            a per-token KL penalty, see :func:`rlrecipes.algos.kl.apply_kl_penalty`).
        values: ``[batch, seq]`` critic values ``V_t``.
        response_mask: ``[batch, seq]`` 1 on response tokens.
        gamma, lam: discount and GAE lambda.
        whiten: whiten the advantages over all valid tokens of the batch (PPO practice).
    Returns:
        ``(advantages [batch, seq], returns [batch, seq])``, 0 on padding.
    """
    check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    mask = response_mask.to(values.dtype)  # [batch, seq]
    # padding is selected away first, so a nan/inf there cannot enter the recursion
    rewards = masked_select_zero(token_rewards.to(values.dtype), response_mask)
    values = masked_select_zero(values.detach(), response_mask)
    bsz, seqlen = values.shape
    next_value = values.new_zeros(bsz)  # [batch]
    last_gae = values.new_zeros(bsz)  # [batch]
    adv = torch.zeros_like(values)  # [batch, seq]
    for t in reversed(range(seqlen)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        adv[:, t] = gae * m
        next_value = m * values[:, t] + (1 - m) * next_value
        last_gae = m * gae + (1 - m) * last_gae
    returns = (adv + values) * mask
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv, returns
