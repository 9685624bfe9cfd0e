"""Each algorithm declares its stages and its loss here; the workflow only runs what it declares.

A :class:`Stage` names every column it reads and writes (``algos/columns.py``), how its rows are shared
out (a share object of ``workflow/shares.py``, by name), the engine it runs on and which workers run
it; ``workflow/stages.py`` registers one function under each stage's name. :func:`get_algorithm` returns an :class:`AlgorithmSpec`
for ``grpo``, ``dapo`` or ``ppo``; the worker runs ``spec.stages(cfg, ...)`` and builds its losses
with :func:`actor_loss_fn` / :func:`critic_loss_fn`, so it never branches on the algorithm's name.
The losses, estimators and aggregations come from the registries in ``algos/registry.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ._util import unknown_name_error
from .columns import POOLED_WRITES
from .kl import apply_kl_penalty, scores_to_token_rewards
from .losses import entropy_bonus, kl_loss, value_loss
from .registry import get_adv_estimator, get_policy_loss
from .rollout_correction import importance_weights, mismatch_stats


#: which workers run a stage: colocated workers run every stage of "both"; under disaggregated
#: placement rollout workers run the "rollout" ones and train workers the "train" ones
RUNS_ON = {"both": ("both",), "rollout": ("both", "rollout"), "train": ("both", "train"),
           "colocated": ("both",), "train_only": ("train",)}


#: the engines a stage can run on (``Stage.engine``)
ENGINES = ("rollout", "actor", "ref", "critic")


@dataclass(frozen=True)
class Stage:
    """One step of an algorithm: the columns it reads and writes (every one it touches), how its rows
    are shared out, the engine it runs on and which workers run it. The workflow hands the stage
    exactly ``reads`` and publishes exactly ``writes``; a strict batch (tests, ``--smoke``) raises on
    anything else. ``workflow/stages.py`` registers the function that runs it under ``name``."""

    name: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    share: str = "none"
    """How its rows are read and where its writes go: the name of a share object registered in
    ``workflow/shares.py`` (``new``, ``round``, ``balanced``, ``groups``, ``all``, ``engine``,
    ``mini_batches``, ``carried``, ``none``)."""
    runs_on: str = "both"
    """Which workers run it: a key of :data:`RUNS_ON`."""
    repeat_group: Optional[str] = None
    """Stages sharing a repeat group run again while DAPO's dynamic sampling needs more groups."""
    doc: str = ""
    engine: Optional[str] = None
    """The engine it runs on (one of :data:`ENGINES`), or None: a stage of plain tensors. A share
    that hands out an engine's data-parallel share (``engine``, ``mini_batches``) uses this one."""
    reports_as: str = ""
    """The name its seconds are reported under in the metrics row (``timing_s/<reports_as>``,
    ``compute_s/...``); defaults to ``name``. Two stages that do the same job for different
    algorithms report alike (``outcome_advantage`` and ``gae`` as ``advantage``)."""

    def __post_init__(self) -> None:
        if not self.reports_as:
            object.__setattr__(self, "reports_as", self.name)
        if self.runs_on not in RUNS_ON:
            raise ValueError(f"stage {self.name!r}: runs_on {self.runs_on!r} is not one of {', '.join(RUNS_ON)}")
        if self.engine is not None and self.engine not in ENGINES:
            raise ValueError(f"stage {self.name!r}: engine {self.engine!r} is not one of {', '.join(ENGINES)}")

    def runs_for(self, role: str) -> bool:
        """Whether a worker of ``role`` (both | train | rollout) runs this stage."""
        return role in RUNS_ON[self.runs_on]


def _mask(masked: bool) -> tuple[str, ...]:
    """Multi-turn rollouts: ``response_mask`` (1 on model tokens, 0 on tool observations) goes
    wherever response tokens are counted, scored or trained on."""
    return ("response_mask",) if masked else ()


def _generation(cfg, masked: bool, pooled: bool = False) -> list[Stage]:
    if pooled:  # the rollout side keeps a pool of groups across steps, scores and filters them
        return [Stage("pool_rollout", (), POOLED_WRITES, "carried", "rollout", None,
                      "continue the carried groups and new ones until enough complete groups (partial rollout, "
                      "over-sampling); score them, drop DAPO's constant groups", engine="rollout",
                      reports_as="rollout"),
                Stage("pool_reward", ("policy_version", "token_versions", "acc"), (), "round", "train", None,
                      "check the samples' policy versions (row and token); count the rollout's scores",
                      reports_as="reward")]
    gen = "sampling" if cfg.dynamic_sampling.enabled else None
    replay = ("routed_experts",) if cfg.routing_replay else ()
    st = [Stage("rollout", (), ("prompt_ids", "response_ids", "prompt_index", "rollout_log_probs", "policy_version")
                + replay + _mask(masked), "new", "rollout", gen,
                "generate n responses per prompt with the rollout engine (multi-turn: the agent loop)",
                engine="rollout"),
          Stage("reward", ("response_ids", "prompt_index", "policy_version") + _mask(masked), ("scores", "acc"),
                "round", "train", gen,
                "score responses (rule reward, overlong shaping); check the samples' policy versions")]
    if cfg.dynamic_sampling.enabled:
        st.append(Stage("dynamic_sampling", (dynamic_sampling_column(cfg),), (), "all", "train", gen,
                        "drop groups with constant scores; generate more until the batch is full"))
    return st


def _forward_passes(cfg, use_ref: bool, skip_old: bool) -> list[Stage]:
    replay = ("routed_experts",) if cfg.routing_replay else ()
    st = []
    if use_ref:
        st.append(Stage("ref", ("prompt_ids", "response_ids"), ("ref_log_probs",), "engine", "train",
                        doc="reference log-probs", engine="ref"))
    if not skip_old:
        st.append(Stage("old", ("prompt_ids", "response_ids") + replay, ("old_log_probs",), "engine", "train",
                        doc="old (behaviour) log-probs", engine="actor"))
    return st


def _update(cfg, use_ref: bool, skip_old: bool, masked: bool) -> list[Stage]:
    reads = ("prompt_ids", "response_ids", "advantages", "rollout_log_probs") + _mask(masked) + \
        (("ref_log_probs",) if use_ref else ()) + (() if skip_old else ("old_log_probs",)) + \
        (("routed_experts",) if cfg.routing_replay else ())
    return [Stage("update", reads, (), "mini_batches", "train", doc="actor policy-gradient step", engine="actor"),
            Stage("reshard", (), (), "none", "colocated", doc="train layout -> rollout layout weights, in place"),
            Stage("publish", (), (), "none", "train_only",
                  doc="the new policy version to the rollout workers, across the bridge")]


def _grpo_stages(cfg, *, use_ref: bool, skip_old: bool, masked: bool = False, pooled: bool = False) -> list[Stage]:
    return (_generation(cfg, masked, pooled) + _forward_passes(cfg, use_ref, skip_old)
            + [Stage("outcome_advantage", ("scores",), ("advantages",), "groups", "train",
                     doc="group-normalised outcome advantage", reports_as="advantage")]
            + _update(cfg, use_ref, skip_old, masked))


def _ppo_stages(cfg, *, use_ref: bool, skip_old: bool, masked: bool = False, pooled: bool = False) -> list[Stage]:
    return (_generation(cfg, masked, pooled) + _forward_passes(cfg, use_ref, skip_old)
            + [Stage("values", ("prompt_ids", "response_ids"), ("values",), "engine", "train", doc="critic values",
                     engine="critic"),
               Stage("gae", ("scores", "response_ids", "rollout_log_probs", "values")
                     + (("ref_log_probs",) if use_ref else ()) + _mask(masked), ("advantages", "returns"), "balanced",
                     "train", doc="GAE", reports_as="advantage"),
               Stage("critic_update", ("prompt_ids", "response_ids", "values", "returns") + _mask(masked), (),
                     "engine", "train", doc="critic step", engine="critic")]
            + _update(cfg, use_ref, skip_old, masked))


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    build_stages: Callable[..., list[Stage]]
    critic: bool = False
    doc: str = ""

    def needs_critic(self, cfg: Any = None) -> bool:
        return self.critic

    def stages(self, cfg, *, use_ref: bool, skip_old: bool, masked: bool = False, pooled: bool = False,
               vision: bool = False) -> list[Stage]:
        """Stages in execution order; every column a stage reads is written earlier. ``masked``:
        the rollout is multi-turn, so samples carry ``response_mask``. ``pooled``: the rollout
        workers keep a pool of groups across steps and score them (:func:`pooled_rollout`).
        ``vision``: a vision-language model; every stage that runs a model over ``prompt_ids`` also
        reads ``prompt_index``, the reference by which it finds the prompt's images (the dock never
        carries pixels)."""
        st = self.build_stages(cfg, use_ref=use_ref, skip_old=skip_old, masked=masked, pooled=pooled)
        if vision:
            import dataclasses

            st = [dataclasses.replace(s, reads=s.reads + ("prompt_index",))
                  if "prompt_ids" in s.reads and "prompt_index" not in s.reads else s for s in st]
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


def pooled_rollout(recipe) -> bool:
    """The rollout keeps a pool of groups across steps (``workflow/pool.py``): disaggregated placement
    with partial rollout, over-sampling or DAPO's dynamic sampling (whose filter then runs on the
    rollout side, off the trainer's critical path)."""
    return recipe.resources.placement == "disaggregated" and (
        recipe.rollout.pooled or recipe.algorithm.dynamic_sampling.enabled)


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
                   kl_coef: float, masks: Optional[list[torch.Tensor]] = None
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO: score on the last token (optionally minus KL), GAE; per-sample ``[R_i]`` advantages, returns.

    ``masks`` (multi-turn): GAE runs over each sample's model tokens only, as one sequence (an
    observation is not an action: no reward, no value, no discounting step); observation tokens
    get advantage and return 0."""
    if masks is not None:
        keep = [m.reshape(-1).bool() for m in masks]
        adv, ret = gae_advantages(cfg, scores=scores, responses=[x[k] for x, k in zip(responses, keep)],
                                  values=[v[k] for v, k in zip(values, keep)],
                                  rollout_log_probs=[x[k] for x, k in zip(rollout_log_probs, keep)],
                                  ref_log_probs=None if ref_log_probs is None else
                                  [x[k] for x, k in zip(ref_log_probs, keep)], kl_coef=kl_coef)

        def spread(xs):
            out = []
            for x, k in zip(xs, keep):
                full = torch.zeros(k.numel(), dtype=x.dtype)
                full[k] = x
                out.append(full)
            return out

        return spread(adv), spread(ret)
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
    """The policy loss closure ``(logp, entropy, mb) -> (loss, metrics)`` for one micro-batch (``mb`` on
    ``logp``'s device: the engine moved it there, ``engines/base.py``)."""
    policy_loss = get_policy_loss(cfg.policy_loss)
    lo_key, hi_key = getattr(policy_loss, "clip_keys", ("clip_ratio_low", "clip_ratio_high"))

    def loss_fn(logp, entropy, mb):
        mask = mb["response_mask"]
        adv = torch.where(mask.bool(), mb["advantages"], 0.0)
        old = mb["old_log_probs"] if "old_log_probs" in mb else logp.detach()
        metrics, weights = {}, None
        if "rollout_log_probs" in mb:  # old == pi_train under the weights that generated the batch
            rl = mb["rollout_log_probs"]
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
            kl = kl_loss(logp, mb["ref_log_probs"], mask, cfg.kl_estimator, cfg.loss_agg_mode, **agg)
            if cfg.use_kl_loss:
                loss = loss + kl_coef * kl
            metrics["actor/kl"] = float(kl.detach()) / max(dp_size, 1)
        if cfg.entropy_coef and entropy is not None:
            loss = loss - cfg.entropy_coef * entropy_bonus(entropy, mask, cfg.loss_agg_mode, **agg)
        return loss, metrics

    return loss_fn


def critic_loss_fn(cfg, *, agg: dict):
    def loss_fn(values, _entropy, mb):
        mask = mb["response_mask"]
        loss, m = value_loss(values, mb["values"], mb["returns"], mask,
                             value_clip=cfg.value_clip, loss_agg_mode=cfg.loss_agg_mode, **agg)
        return loss, {"critic/vf_clipfrac": float(m["vf_clipfrac"])}

    return loss_fn
