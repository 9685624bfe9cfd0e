"""Each algorithm declares its stages and its loss here; the workflow only runs what it declares.

A :class:`Stage` names the dock columns it reads and writes and the ``runner`` (a function in
``workflow/stages.py``) that executes it. :func:`get_algorithm` returns an :class:`AlgorithmSpec`
for ``grpo``, ``dapo`` or ``ppo``; the worker runs ``spec.stages(cfg, ...)`` and builds its losses
with :func:`actor_loss_fn` / :func:`critic_loss_fn`, so it never branches on the algorithm's name.
The losses, estimators and aggregations come from the registries in ``algos/registry.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ._util import unknown_name_error
from .kl import apply_kl_penalty, scores_to_token_rewards
from .losses import entropy_bonus, kl_loss, value_loss
from .registry import get_adv_estimator, get_policy_loss
from .rollout_correction import importance_weights, mismatch_stats


@dataclass(frozen=True)
class Stage:
    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    repeat_group: Optional[str] = None
    """Stages sharing a repeat group run again while DAPO's dynamic sampling needs more groups."""
    doc: str = ""
    runner: str = ""
    """The stage implementation the workflow runs (``workflow/stages.py``); defaults to ``name``."""

    def __post_init__(self) -> None:
        if not self.runner:
            object.__setattr__(self, "runner", self.name)


def _generation(cfg) -> list[Stage]:
    gen = "sampling" if cfg.dynamic_sampling.enabled else None
    st = [Stage("rollout", (), ("prompt_ids", "response_ids", "prompt_index", "rollout_log_probs"), gen,
                "generate n responses per prompt with the rollout engine"),
          Stage("reward", ("prompt_ids", "response_ids", "prompt_index"), ("scores", "acc"), gen,
                "score responses (rule reward, overlong shaping)")]
    if cfg.dynamic_sampling.enabled:
        st.append(Stage("dynamic_sampling", ("scores", "acc"), (), gen,
                        "drop groups with constant scores; generate more until the batch is full"))
    return st


def _forward_passes(use_ref: bool, skip_old: bool) -> list[Stage]:
    st = []
    if use_ref:
        st.append(Stage("ref", ("prompt_ids", "response_ids"), ("ref_log_probs",), doc="reference log-probs"))
    if not skip_old:
        st.append(Stage("old", ("prompt_ids", "response_ids"), ("old_log_probs",), doc="old (behaviour) log-probs"))
    return st


def _update(use_ref: bool, skip_old: bool) -> list[Stage]:
    reads = ("prompt_ids", "response_ids", "advantages") + (("ref_log_probs",) if use_ref else ()) + \
        (() if skip_old else ("old_log_probs",))
    return [Stage("update", reads, (), doc="actor policy-gradient step"),
            Stage("reshard", (), (), doc="train layout -> rollout layout weights")]


def _grpo_stages(cfg, *, use_ref: bool, skip_old: bool) -> list[Stage]:
    return (_generation(cfg) + _forward_passes(use_ref, skip_old)
            + [Stage("advantage", ("scores",), ("advantages",), doc="group-normalised outcome advantage",
                     runner="outcome_advantage")]
            + _update(use_ref, skip_old))


def _ppo_stages(cfg, *, use_ref: bool, skip_old: bool) -> list[Stage]:
    return (_generation(cfg) + _forward_passes(use_ref, skip_old)
            + [Stage("values", ("prompt_ids", "response_ids"), ("values",), doc="critic values"),
               Stage("advantage", ("scores", "response_ids", "values") + (("ref_log_probs",) if use_ref else ()),
                     ("advantages", "returns"), doc="GAE", runner="gae"),
               Stage("critic_update", ("prompt_ids", "response_ids", "values", "returns"), (), doc="critic step")]
            + _update(use_ref, skip_old))


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    build_stages: Callable[..., list[Stage]]
    critic: bool = False
    doc: str = ""

    def needs_critic(self, cfg: Any = None) -> bool:
        return self.critic

    def stages(self, cfg, *, use_ref: bool, skip_old: bool) -> list[Stage]:
        """Stages in execution order; every column a stage reads is written earlier."""
        st = self.build_stages(cfg, use_ref=use_ref, skip_old=skip_old)
        check_stages(self.name, st)
        return st


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec("grpo", _grpo_stages, doc="group-normalised outcome advantage, no critic"),
    "dapo": AlgorithmSpec("dapo", _grpo_stages, doc="GRPO + clip-higher, dynamic sampling, token-level loss"),
    "ppo": AlgorithmSpec("ppo", _ppo_stages, critic=True, doc="critic + GAE"),
}


def get_algorithm(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise unknown_name_error("algorithm", name, ALGORITHMS, "algorithm.name")
    return ALGORITHMS[name]


def check_stages(algorithm: str, stages: list[Stage]) -> None:
    produced: set[str] = set()
    for s in stages:
        missing = [c for c in s.reads if c not in produced]
        if missing:
            raise ValueError(f"{algorithm}: stage {s.name!r} reads {missing} before any stage writes them")
        produced.update(s.writes)


# ---------------------------------------------------------------------------------------------
# what the stages compute
# ---------------------------------------------------------------------------------------------
def dynamic_sampling_column(cfg) -> str:
    """The dock column a DAPO group must vary in: ``scores`` (shaped) or ``acc`` (raw reward)."""
    return "acc" if cfg.dynamic_sampling.metric == "acc" else "scores"


def outcome_advantages(cfg, scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[rows]`` outcome advantage through the registry (``algorithm.adv_estimator``)."""
    name = cfg.adv_estimator if cfg.norm_adv_by_std or cfg.adv_estimator != "grpo" else "grpo_no_std"
    adv, _ = get_adv_estimator(name)(scores, torch.ones((len(scores), 1)), group_ids)
    return adv[:, 0]


def _pad(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)  # [rows, R]
    for i, t in enumerate(rows):
        out[i, :t.numel()] = t.float()
    return out


def gae_advantages(cfg, *, scores: torch.Tensor, responses: list[torch.Tensor], values: list[torch.Tensor],
                   rollout_log_probs: list[torch.Tensor], ref_log_probs: Optional[list[torch.Tensor]],
                   kl_coef: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO: score on the last token (optionally minus KL), GAE; per-sample ``[R_i]`` advantages, returns."""
    lens = [int(x.numel()) for x in responses]
    R = max(lens)
    mask = torch.zeros((len(lens), R))  # [rows, R]
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    rewards = scores_to_token_rewards(scores.float(), mask)  # [rows, R]
    if cfg.use_kl_in_reward and ref_log_probs is not None:
        rewards, _ = apply_kl_penalty(rewards, _pad(rollout_log_probs, R), _pad(ref_log_probs, R), mask,
                                      kl_coef, cfg.kl_estimator)
    adv, ret = get_adv_estimator("gae")(rewards, _pad(values, R), mask, gamma=cfg.gamma, lam=cfg.lam)
    return [adv[i, :n].contiguous() for i, n in enumerate(lens)], [ret[i, :n].contiguous() for i, n in enumerate(lens)]


def actor_loss_fn(cfg, *, agg: dict, kl_coef: float, use_ref: bool, dp_size: int):
    """The policy loss closure ``(logp, entropy, mb) -> (loss, metrics)`` for one micro-batch."""
    policy_loss = get_policy_loss(cfg.policy_loss)
    lo_key, hi_key = getattr(policy_loss, "clip_keys", ("clip_ratio_low", "clip_ratio_high"))

    def loss_fn(logp, entropy, mb):
        mask = mb["response_mask"].to(logp.device)
        adv = torch.where(mask.bool(), mb["advantages"].to(logp.device), 0.0)
        old = mb["old_log_probs"].to(logp.device) if "old_log_probs" in mb else logp.detach()
        metrics, weights = {}, None
        if "rollout_log_probs" in mb:  # old == pi_train under the weights that generated the batch
            rl = mb["rollout_log_probs"].to(logp.device)
            mm = mismatch_stats(old, rl, mask)
            metrics.update({"rollout/logprob_diff_sum": float(mm["diff_sum"]),
                            "rollout/logprob_diff_max": float(mm["diff_max"]),
                            "rollout/tokens_sum": float(mm["tokens"])})
            if cfg.rollout_correction != "none":
                weights, im = importance_weights(old, rl, mask, cfg.rollout_correction, cfg.rollout_correction_cap)
                metrics.update({"rollout/is_weight_sum": float(im["weight_sum"]),
                                "rollout/is_capped_sum": float(im["capped"])})
        loss, m = policy_loss(logp, old, adv, mask, clip_ratio_low=getattr(cfg, lo_key),
                              clip_ratio_high=getattr(cfg, hi_key), dual_clip_c=cfg.dual_clip_c,
                              loss_agg_mode=cfg.loss_agg_mode, token_weights=weights, **agg)
        metrics.update({"actor/pg_loss": float(loss.detach()), "actor/clipfrac": float(m["clipfrac"]),
                        "actor/ppo_kl": float(m["ppo_kl"])})
        if use_ref:
            kl = kl_loss(logp, mb["ref_log_probs"].to(logp.device), mask, cfg.kl_estimator, cfg.loss_agg_mode, **agg)
            if cfg.use_kl_loss:
                loss = loss + kl_coef * kl
            metrics["actor/kl"] = float(kl.detach()) / max(dp_size, 1)
        if cfg.entropy_coef and entropy is not None:
            loss = loss - cfg.entropy_coef * entropy_bonus(entropy, mask, cfg.loss_agg_mode, **agg)
        return loss, metrics

    return loss_fn


def critic_loss_fn(cfg, *, agg: dict):
    def loss_fn(values, _entropy, mb):
        mask = mb["response_mask"].to(values.device)
        loss, m = value_loss(values, mb["values"].to(values.device), mb["returns"].to(values.device), mask,
                             value_clip=cfg.value_clip, loss_agg_mode=cfg.loss_agg_mode, **agg)
        return loss, {"critic/vf_clipfrac": float(m["vf_clipfrac"])}

    return loss_fn
