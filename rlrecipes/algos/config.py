"""Typed view of a recipe's ``algorithm:`` section, and the glue that maps each key to code.

The workflow builds one :class:`AlgorithmSettings` (``AlgorithmSettings.from_dict(yaml["algorithm"])``)
and calls its methods; every key below is consumed by exactly one tested function.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .advantages import gae_advantage, grpo_advantage
from .dapo import DynamicSampler, GroupFilterResult, dynamic_sampling_filter, overlong_reward_penalty
from .kl import apply_kl_penalty, make_kl_controller, scores_to_token_rewards
from .losses import aggregate_loss, kl_loss, ppo_clip_policy_loss, value_loss
from .onpolicy import old_log_prob_or_detached, resolve_skip_old_log_prob
from .registry import (
    CRITIC_ESTIMATORS,
    check_algorithm_name,
    get_adv_estimator,
    get_kl_controller,
    get_kl_estimator,
    get_loss_agg,
    get_policy_loss,
)


@dataclass
class DynamicSamplingSettings:
    enabled: bool = False
    """Drop prompt groups whose ``metric`` is equal for all samples and generate more (DAPO)."""
    metric: str = "score"
    """Per-sample column the filter looks at (``score``, ``acc``, ...)."""
    max_gen_batches: int = 10
    """Give up (error) after this many generation rounds for one step; <= 0 means no cap."""


@dataclass
class OverlongSettings:
    enabled: bool = False
    """DAPO soft overlong punishment added to the score."""
    buffer_len: int = 4096
    """``L_cache``: the penalty ramps from 0 to ``-penalty_factor`` over the last ``buffer_len`` tokens."""
    penalty_factor: float = 1.0
    """Penalty at (and beyond) the maximum response length."""


@dataclass
class AlgorithmSettings:
    name: str = "grpo"
    """grpo | dapo | ppo (the DAG the workflow builds; ppo adds the critic)."""
    adv_estimator: str = "grpo"
    """grpo | grpo_no_std (alias drgrpo) | gae."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False == grpo_no_std)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    clip_ratio_low: float = 0.2
    """PPO eps_low."""
    clip_ratio_high: float = 0.2
    """PPO eps_high (DAPO clip-higher: 0.28)."""
    dual_clip_c: float | None = 3.0
    """Dual-clip constant for negative advantages (> 1); null disables."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    policy_loss: str = "ppo_clip"
    """Policy loss name (ppo_clip)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= entropy_coef * entropy)."""
    use_kl_loss: bool = False
    """Add ``kl_coef * KL(pi || pi_ref)`` to the actor loss (GRPO)."""
    kl_coef: float = 0.001
    """KL coefficient (initial value for the adaptive controller)."""
    kl_estimator: str = "low_var_kl"
    """k1 | abs | k2 (mse) | k3 (low_var_kl)."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_coef * KL`` from the token-level reward before the advantage (PPO)."""
    kl_controller: str = "fixed"
    """fixed | adaptive (coefficient of the in-reward KL)."""
    kl_target: float | None = None
    """Adaptive controller target KL."""
    kl_horizon: float | None = None
    """Adaptive controller horizon (samples)."""
    value_clip: float | None = 0.5
    """Critic value clipping range; null disables."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    skip_old_log_prob: str | bool = "auto"
    """auto | true | false: skip the old-log-prob forward when on-policy."""
    dynamic_sampling: DynamicSamplingSettings = field(default_factory=DynamicSamplingSettings)
    overlong: OverlongSettings = field(default_factory=OverlongSettings)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, where: str = "algorithm") -> "AlgorithmSettings":
        """Build and validate from a mapping; unknown keys raise with a "did you mean"."""
        d = dict(d or {})
        nested = {"dynamic_sampling": DynamicSamplingSettings, "overlong": OverlongSettings}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            _check_key(cls, key, where)
            if key in nested:
                sub = dict(value or {})
                for k in sub:
                    _check_key(nested[key], k, f"{where}.{key}")
                kwargs[key] = nested[key](**sub)
            else:
                kwargs[key] = value
        out = cls(**kwargs)
        out.validate(where)
        return out

    def validate(self, where: str = "algorithm") -> None:
        check_algorithm_name(self.name)
        get_adv_estimator(self.adv_estimator)
        get_kl_estimator(self.kl_estimator)
        get_loss_agg(self.loss_agg_mode)
        get_policy_loss(self.policy_loss)
        get_kl_controller(self.kl_controller)
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"{where}.dual_clip_c must be > 1 or null; got {self.dual_clip_c}")
        if not (0 <= self.clip_ratio_low < 1) or self.clip_ratio_high < 0:
            raise ValueError(
                f"{where}.clip_ratio_low must be in [0, 1) and clip_ratio_high >= 0; got "
                f"{self.clip_ratio_low}, {self.clip_ratio_high}"
            )
        if self.ppo_epochs < 1:
            raise ValueError(f"{where}.ppo_epochs must be >= 1; got {self.ppo_epochs}")
        if self.kl_controller == "adaptive" and (self.kl_target is None or self.kl_horizon is None):
            raise ValueError(f"{where}.kl_controller=adaptive needs {where}.kl_target and {where}.kl_horizon")
        if self.use_kl_in_reward and self.use_kl_loss:
            raise ValueError(f"{where}: use_kl_in_reward and use_kl_loss are both true; choose one")

    @property
    def needs_critic(self) -> bool:
        return self.adv_estimator in CRITIC_ESTIMATORS

    # ------------------------------------------------------------------ reward side
    def shape_scores(self, scores: torch.Tensor, response_lengths: torch.Tensor, max_response_len: int) -> torch.Tensor:
        """``overlong.*``: add the DAPO overlong penalty to ``[batch]`` scores when enabled."""
        if not self.overlong.enabled:
            return scores
        return scores + overlong_reward_penalty(
            response_lengths, max_response_len=max_response_len, buffer_len=self.overlong.buffer_len,
            penalty_factor=self.overlong.penalty_factor,
        ).to(scores.dtype)

    def filter_groups(self, metric: torch.Tensor, group_ids: torch.Tensor) -> GroupFilterResult:
        """``dynamic_sampling.enabled``: drop constant-metric groups (keeps all rows when disabled)."""
        if not self.dynamic_sampling.enabled:
            n = len(dict.fromkeys(group_ids.tolist()))
            return GroupFilterResult(torch.ones_like(group_ids, dtype=torch.bool), n, 0,
                                     list(dict.fromkeys(int(g) for g in group_ids.tolist())))
        return dynamic_sampling_filter(metric, group_ids)

    def dynamic_sampler(self, target_groups: int) -> DynamicSampler:
        """``dynamic_sampling.max_gen_batches``: a sampler that fills ``target_groups`` groups."""
        return DynamicSampler(target_groups=target_groups, max_gen_batches=self.dynamic_sampling.max_gen_batches)

    def kl_ctrl(self):
        """``kl_controller``, ``kl_coef``, ``kl_target``, ``kl_horizon``."""
        return make_kl_controller(self.kl_controller, self.kl_coef, self.kl_target, self.kl_horizon)

    def compute_advantages(
        self,
        scores: torch.Tensor,
        response_mask: torch.Tensor,
        group_ids: torch.Tensor,
        *,
        values: torch.Tensor | None = None,
        logp: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
        kl_coef: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``adv_estimator``, ``norm_adv_by_std``, ``gamma``, ``lam``, ``use_kl_in_reward``.

        Args:
            scores: ``[batch]``; response_mask: ``[batch, seq]``; group_ids: ``[batch]``;
            values: ``[batch, seq]`` (gae); logp/ref_logp: ``[batch, seq]`` (use_kl_in_reward);
            kl_coef: current controller value (defaults to ``self.kl_coef``).
        Returns:
            ``(advantages [batch, seq], returns [batch, seq], metrics)``.
        """
        metrics: dict[str, torch.Tensor] = {}
        token_rewards = scores_to_token_rewards(scores.float(), response_mask)  # [batch, seq]
        if self.use_kl_in_reward:
            if logp is None or ref_logp is None:
                raise ValueError("algorithm.use_kl_in_reward=true needs logp and ref_logp for the advantage")
            coef = self.kl_coef if kl_coef is None else kl_coef
            token_rewards, m = apply_kl_penalty(token_rewards, logp, ref_logp, response_mask, coef, self.kl_estimator)
            metrics["reward/kl"] = m["kl"]
        if self.adv_estimator == "gae":
            if values is None:
                raise ValueError("algorithm.adv_estimator=gae needs critic values; the recipe must define a critic")
            adv, ret = gae_advantage(token_rewards, values, response_mask, gamma=self.gamma, lam=self.lam)
        else:
            norm = self.norm_adv_by_std and self.adv_estimator == "grpo"
            seq_scores = (token_rewards * response_mask.to(token_rewards.dtype)).sum(-1)  # [batch]
            adv, ret = grpo_advantage(seq_scores, response_mask, group_ids, norm_by_std=norm)
        return adv, ret, metrics

    # ------------------------------------------------------------------ update side
    def skip_old(self, mini_batches_per_rollout: int) -> bool:
        """``skip_old_log_prob`` + ``ppo_epochs``: whether to skip the old-log-prob forward."""
        return resolve_skip_old_log_prob(self.skip_old_log_prob, self.ppo_epochs, mini_batches_per_rollout)

    def actor_loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        entropy: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
        **agg_kwargs,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``clip_ratio_low/high``, ``dual_clip_c``, ``loss_agg_mode``, ``entropy_coef``,
        ``use_kl_loss``, ``kl_coef``, ``kl_estimator``. ``old_logp=None`` -> on-policy (detached).

        All tensors ``[batch, seq]``; ``agg_kwargs`` are the global normalisers of
        :func:`rlrecipes.algos.losses.aggregate_loss`.
        """
        old = old_log_prob_or_detached(logp, old_logp)
        loss, metrics = ppo_clip_policy_loss(
            logp, old, advantages, response_mask, clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high, dual_clip_c=self.dual_clip_c,
            loss_agg_mode=self.loss_agg_mode, **agg_kwargs,
        )
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics["actor/pg_loss"] = loss.detach()
        if self.entropy_coef and entropy is None:
            raise ValueError("algorithm.entropy_coef != 0 needs the entropy (compute it with logprobs_and_entropy)")
        if entropy is not None:
            ent = aggregate_loss(entropy, response_mask, self.loss_agg_mode, **agg_kwargs)
            metrics["actor/entropy"] = ent.detach()
            if self.entropy_coef:
                loss = loss - self.entropy_coef * ent
        if self.use_kl_loss:
            if ref_logp is None:
                raise ValueError("algorithm.use_kl_loss=true needs ref_logp (enable the reference model)")
            kl = kl_loss(logp, ref_logp, response_mask, self.kl_estimator, self.loss_agg_mode, **agg_kwargs)
            metrics["actor/kl"] = kl.detach()
            loss = loss + self.kl_coef * kl
        return loss, metrics

    def critic_loss(self, values, old_values, returns, response_mask, **agg_kwargs):
        """``value_clip``, ``loss_agg_mode``: clipped value loss, all tensors ``[batch, seq]``."""
        loss, m = value_loss(values, old_values, returns, response_mask, value_clip=self.value_clip,
                             loss_agg_mode=self.loss_agg_mode, **agg_kwargs)
        return loss, {f"critic/{k}": v for k, v in m.items()}


def _check_key(cls, key: str, where: str) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    if key not in names:
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown key {where}.{key}; valid keys: {', '.join(names)}.{hint}")
