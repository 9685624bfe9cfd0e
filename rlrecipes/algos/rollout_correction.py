"""Rollout-train mismatch: measure it, and correct the policy loss for it.

The rollout engine (vLLM, or the native sampler in another dtype) and the train engine compute
slightly different probabilities for the same tokens (kernels, dtypes, batch-dependent numerics).
With ``d = logp_train - logp_rollout`` of the sampled token (``logp_train`` under the weights that
generated the batch), the importance weight is ``w = exp(d) = pi_train / pi_rollout``, and:

* ``tis`` (truncated importance sampling): the per-token policy loss is multiplied by ``min(w, C)``;
* ``mis`` (masked importance sampling): by ``w`` where ``w <= C``, and by 0 past the cap, so tokens
  the rollout sampled far more readily than the trainer would are dropped from the gradient.

Weights are detached (they re-weight the gradient; they are not differentiated).
"""
from __future__ import annotations

import torch

from ._util import masked_select_zero

CORRECTIONS = ("none", "tis", "mis")


def mismatch_stats(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sum and max of ``|logp_train - logp_rollout|`` over ``mask`` (``[batch, seq]`` each), and the
    token count, as sums/maxes a caller reduces over micro-batches and ranks."""
    diff = masked_select_zero((logp_train - logp_rollout).abs(), mask)  # [batch, seq]
    return {"diff_sum": diff.sum(), "diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
            "tokens": mask.float().sum()}


def importance_weights(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``[batch, seq]`` detached token weights for ``mode`` (``tis`` | ``mis``) and their sums.

    Returns ``(weights, {"weight_sum", "capped"})``: the weights' sum over ``mask`` and how many
    masked tokens were truncated (tis) or dropped (mis). 0 outside the mask.
    """
    if mode not in ("tis", "mis"):
        raise ValueError(f"algorithm.rollout_correction={mode!r}: expected one of {', '.join(CORRECTIONS)}")
    if not cap > 1.0:
        raise ValueError(f"algorithm.rollout_correction_cap must be > 1; got {cap}")
    d = masked_select_zero((logp_train - logp_rollout).detach(), mask).clamp(-20.0, 20.0)
    w = d.exp()  # [batch, seq]
    over = (w > cap) & mask.bool()
    if mode == "tis":
        out = w.clamp(max=cap)
    else:
        out = torch.where(over, torch.zeros_like(w), w)
    out = masked_select_zero(out, mask)
    return out, {"weight_sum": out.sum(), "capped": over.float().sum()}
