"""The old-log-prob rule: when may the "old" forward pass be skipped?

PPO-style losses need ``old_logp``: the log-probs under the weights that generated the rollout
(the state before this batch's first optimizer step). If every rollout batch is used for exactly
one optimizer step (``ppo_epochs == 1`` and one mini-batch per rollout batch), the weights at the
update equal the weights at the old-log-prob forward, so ``old_logp == logp`` numerically and the
forward can be skipped: use ``logp.detach()``. Then ``ratio = exp(logp - logp.detach()) == 1`` in
value but its gradient is ``grad logp``, the on-policy policy gradient.
"""
from __future__ import annotations

import torch


def mini_batches_per_rollout(rollout_batch_size: int, ppo_mini_batch_size: int) -> int:
    """How many optimizer steps one rollout batch gives per epoch (rows / mini-batch rows)."""
    if ppo_mini_batch_size <= 0 or rollout_batch_size % ppo_mini_batch_size != 0:
        raise ValueError(
            f"rollout batch of {rollout_batch_size} rows is not a multiple of the mini-batch size "
            f"{ppo_mini_batch_size}; set the mini-batch size to a divisor of prompts_per_step * n_samples"
        )
    return rollout_batch_size // ppo_mini_batch_size


def is_on_policy(ppo_epochs: int, mini_batches: int) -> bool:
    """True when the rollout batch gives exactly one optimizer step (on-policy update)."""
    if ppo_epochs < 1 or mini_batches < 1:
        raise ValueError(f"algorithm.ppo_epochs and mini-batches must be >= 1; got {ppo_epochs}, {mini_batches}")
    return ppo_epochs == 1 and mini_batches == 1


def resolve_skip_old_log_prob(setting: str | bool, ppo_epochs: int, mini_batches: int) -> bool:
    """Decide ``algorithm.skip_old_log_prob`` (``auto`` | ``true`` | ``false``).

    ``auto`` skips exactly when on-policy. ``true`` on an off-policy setup is an error, since the
    ratio would then be computed against the wrong policy.
    """
    if isinstance(setting, str):
        s = setting.strip().lower()
        if s == "auto":
            return is_on_policy(ppo_epochs, mini_batches)
        if s in ("true", "yes", "1"):
            setting = True
        elif s in ("false", "no", "0"):
            setting = False
        else:
            raise ValueError(f"algorithm.skip_old_log_prob must be auto, true or false; got {setting!r}")
    if setting and not is_on_policy(ppo_epochs, mini_batches):
        raise ValueError(
            f"algorithm.skip_old_log_prob=true needs one optimizer step per rollout batch, but "
            f"ppo_epochs={ppo_epochs} and mini-batches per rollout batch={mini_batches}; set it to auto "
            "or false, or use ppo_epochs=1 with one mini-batch"
        )
    return bool(setting)


def old_log_prob_or_detached(logp: torch.Tensor, old_logp: torch.Tensor | None) -> torch.Tensor:
    """``old_logp`` when it was computed, else ``logp.detach()`` (skipped on-policy forward). ``[batch, seq]``."""
    return logp.detach() if old_logp is None else old_logp
