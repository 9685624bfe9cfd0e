"""The recipe schema: one pydantic model per section, every field with its docstring.

A recipe folder holds ``recipe.yaml`` (the full-scale run) and ``smoke.yaml`` (the same recipe
at tiny size on CPU), which inherits ``recipe.yaml`` through ``defaults: [recipe.yaml]`` and
holds only the differences. Every field below has a docstring; ``rlrecipes show --resolved``
prints the merged result.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from ..algos.registry import TABLES as _ALG_TABLES
from ..models import PRESETS, ModelDims, smoke_dims
from .base import RecipeError, _Strict, registered_name
from .rollout_sections import (InferenceSettings, MultiTurnConfig, RolloutConfig, RolloutLayout,  # noqa: F401
                               SamplingConfig)
from .run_sections import ReshardConfig, ResourcesConfig, TrainerConfig  # noqa: F401
from .train_sections import ActorConfig, CriticConfig, LoraConfig, RefConfig, TrainLayout  # noqa: F401




# ---------------------------------------------------------------------------------------------
# model / data
# ---------------------------------------------------------------------------------------------
class SmokeDims(_Strict):
    """Overrides of the family's tiny smoke dimensions (see rlrecipes.models.SMOKE)."""

    vocab_size: Optional[int] = Field(None, ge=1)
    hidden_size: Optional[int] = Field(None, ge=1)
    num_layers: Optional[int] = Field(None, ge=1)
    num_heads: Optional[int] = Field(None, ge=1)
    num_kv_heads: Optional[int] = Field(None, ge=1)
    head_dim: Optional[int] = Field(None, ge=1)
    intermediate_size: Optional[int] = Field(None, ge=1)
    num_experts: Optional[int] = Field(None, ge=1)
    moe_intermediate_size: Optional[int] = Field(None, ge=1)
    experts_per_token: Optional[int] = Field(None, ge=1)
    max_position_embeddings: Optional[int] = Field(None, ge=1)


class ModelConfig(_Strict):
    family: str
    """Architecture family, by its name in ``rlrecipes/models/families`` (``FAMILIES``): qwen2 (dense),
    qwen3_moe (MoE), deepseek_v3 (MLA + MoE)."""
    preset: Optional[str] = None
    """Pinned real dimensions used by the planner (qwen2.5-7b, qwen2.5-32b, qwen3-30b-a3b, deepseek-v3-671b)."""
    path: Optional[str] = None
    """Local HF folder (config.json + safetensors + tokenizer). Never a hub id: nothing is downloaded."""
    smoke: Optional[SmokeDims] = None
    """Build a tiny randomly initialised model of the family from config instead of loading `path`
    (with both set, `path` is loaded and the smoke task and tokenizer are kept)."""
    tokenizer: Optional[str] = None
    """Local tokenizer folder; defaults to `path`, or the bundled character tokenizer for smoke runs."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Training dtype. auto: bf16 on accelerators that support it, fp32 on CPU."""

    @field_validator("family")
    @classmethod
    def _registered_family(cls, v: str) -> str:
        from ..models import FAMILIES  # the one list of families: a new one needs no schema edit

        return registered_name(v, FAMILIES, "model.family", "model family")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; choose one of {', '.join(PRESETS)}")
        return v

    @model_validator(mode="after")
    def _source(self) -> "ModelConfig":
        if self.path is None and self.smoke is None and self.preset is None:
            raise ValueError("set model.path (a local HF folder), model.preset, or model.smoke")
        if self.preset and PRESETS[self.preset].family != self.family:
            raise ValueError(f"preset {self.preset!r} is family {PRESETS[self.preset].family!r}, not {self.family!r}")
        return self

    def dims(self) -> ModelDims:
        """Dimensions of the model this recipe trains: smoke dims; else the folder at ``path`` when it
        is there (it is what gets trained, smoke task or not); else the pinned real ``preset`` (plan a
        cluster run from a machine without the checkpoint)."""
        if self.smoke is not None and not self.path:
            return smoke_dims(self.family, **self.smoke.model_dump(exclude_none=True))
        from transformers import AutoConfig

        from ..models import dims_from_hf_config

        folder = Path(os.path.expanduser(self.path)) if self.path else None
        if self.preset is not None and self.smoke is None and (folder is None or not (folder / "config.json").is_file()):
            return PRESETS[self.preset]  # a smoke run with a path trains that folder: never plan the preset for it
        if folder is None:
            raise RecipeError("model: set model.preset (a pinned real model), model.path (a local HF folder) "
                              "or model.smoke")
        if not (folder / "config.json").is_file():
            what = "does not exist" if not folder.exists() else ("is a file" if not folder.is_dir() else
                                                                  "has no config.json")
            fix = ("set model.path=null to train the tiny smoke model" if self.smoke is not None else
                   "set model.preset to plan a pinned real model")
            raise RecipeError(f"model.path: {folder} {what}; pass a local HF model folder (config.json + "
                              f"*.safetensors), or {fix}")
        try:
            return dims_from_hf_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
        except (ValueError, OSError) as e:  # OSError: transformers' "not a valid JSON file"
            raise RecipeError(f"model.path: {folder}/config.json: {e}") from None


class DataConfig(_Strict):
    train_files: list[str] = Field(default_factory=list)
    """JSONL or Parquet files of prompts, relative to the recipe folder or absolute."""
    synthetic: Optional[str] = None
    """Use the bundled deterministic synthetic digit task instead of files (smoke runs), by its name in
    ``rlrecipes/data/smoke.py`` (``SMOKE_TASKS``: copy, reverse, add, longtail); `longtail`
    has heavy-tailed answer lengths (most 2-4 digits, a tenth 40-60: set
    rollout.sampling.max_new_tokens=64)."""
    synthetic_digits: int = Field(3, ge=1)
    """Digits per synthetic prompt."""
    synthetic_size: int = Field(2048, ge=1)
    """Number of synthetic prompts generated from the seed."""
    prompt_key: str = "prompt"
    """Field holding the prompt text (or chat messages)."""
    answer_key: str = "answer"
    """Field holding the reference answer given to the reward function."""
    max_prompt_length: int = Field(2048, ge=1)
    """Prompts longer than this (in tokens) are dropped and counted."""
    expected_prompt_tokens: Optional[int] = Field(None, ge=1)
    """The mean prompt length (tokens, chat template included) ``plan`` predicts the step with. Null:
    a tenth of max_prompt_length (math prompts are short: the DeepSeek-R1 run on deepscaler that
    cann-recipes-train publishes averages 78 tokens of its 1,024)."""
    apply_chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template when it has one."""
    shuffle: bool = True
    """Shuffle deterministically by trainer.seed each epoch."""
    on_malformed: Literal["error", "skip"] = "error"
    """A malformed row either stops the run with its file:line, or is skipped and counted."""
    image_key: Optional[str] = None
    """Vision-language data: the field with each row's images (verl's Parquet: ``images``, a list of
    ``{bytes, path}``; JSONL: a list of paths relative to the file's folder). Null: text only."""
    min_pixels: int = Field(56 * 56, ge=1)
    """The image processor's lower bound on an image's area (pixels, after resizing)."""
    max_pixels: int = Field(28 * 28 * 1280, ge=1)
    """The image processor's upper bound on an image's area: an image costs at most
    max_pixels / 28^2 image tokens (Qwen2.5-VL's 14-pixel patches merged 2x2); ``plan`` counts this."""
    blank_images: bool = False
    """Replace every image by a black one of the same size (a control run: with nothing to see, an
    image-only task's reward must not rise)."""

    @field_validator("synthetic")
    @classmethod
    def _registered_task(cls, v: Optional[str]) -> Optional[str]:
        from ..data import SMOKE_TASKS  # the one list of synthetic tasks

        return None if v is None else registered_name(v, SMOKE_TASKS, "data.synthetic", "synthetic task")

    @model_validator(mode="after")
    def _some_data(self) -> "DataConfig":
        if not self.train_files and self.synthetic is None:
            raise ValueError("set data.train_files (JSONL/Parquet) or data.synthetic: copy")
        if self.train_files and self.synthetic is not None:
            raise ValueError(f"data.synthetic={self.synthetic} and data.train_files are both set, and the synthetic "
                             "task would silently win; set data.synthetic=null to train on the files")
        return self


# ---------------------------------------------------------------------------------------------
# algorithm
# ---------------------------------------------------------------------------------------------
class DynamicSampling(_Strict):
    enabled: bool = False
    """DAPO: drop groups whose scores are all equal and generate more until the batch is full."""
    metric: Literal["score", "acc"] = "score"
    """Per-sample metric a group must vary in to be kept: score (shaped reward) or acc (raw reward)."""
    max_gen_batches: int = Field(4, ge=1)
    """Cap on generation rounds per step; the step trains on what it has when the cap is hit."""


class Overlong(_Strict):
    enabled: bool = False
    """DAPO overlong reward shaping: a linear penalty in the last `buffer_len` tokens."""
    buffer_len: int = Field(512, ge=1)
    """Length of the soft-penalty zone before the response length limit."""
    penalty_factor: float = Field(1.0, ge=0)
    """Penalty at the hard limit."""


class AlgorithmConfig(_Strict):
    name: str
    """The algorithm, by its name in ``rlrecipes/algos/spec.py``'s ``ALGORITHMS`` (grpo, dapo, ppo):
    its stage DAG and defaults."""
    adv_estimator: str = "grpo"
    """Advantage: group-normalised outcome (grpo), without std (Dr. GRPO), or GAE with a critic (ppo)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (+1e-6)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip eps below 1."""
    clip_ratio_high: float = Field(0.2, ge=0)
    """PPO clip eps above 1 (DAPO clip-higher: 0.28)."""
    policy_loss: str = "ppo_clip"
    """Policy loss, by its registered name: ppo_clip (token ratios, clip_ratio_low/high) or gspo
    (one length-normalised ratio per sequence, gspo_clip_low/high; use loss_agg_mode seq-mean-token-mean)."""
    gspo_clip_low: float = Field(3e-4, ge=0, lt=1)
    """GSPO: clip range below 1 of the sequence ratio."""
    gspo_clip_high: float = Field(4e-4, ge=0)
    """GSPO: clip range above 1 of the sequence ratio."""
    dual_clip_c: Optional[float] = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages; null disables."""
    loss_agg_mode: str = "token-mean"
    """How token losses are aggregated; invariant to the DP/micro-batch split."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    use_kl_loss: bool = True
    """Add a KL(actor || ref) term to the loss."""
    kl_coef: float = Field(0.001, ge=0)
    """KL coefficient (initial value for the adaptive controller)."""
    kl_estimator: str = "low_var_kl"
    """KL estimator."""
    use_kl_in_reward: bool = False
    """Subtract the KL penalty from the token rewards instead of (or as well as) the loss."""
    kl_controller: str = "fixed"
    """KL coefficient controller."""
    kl_target: float = Field(0.1, gt=0)
    """Adaptive controller: target KL."""
    kl_horizon: int = Field(10000, ge=1)
    """Adaptive controller: horizon."""
    value_clip: float = Field(0.5, gt=0)
    """PPO critic value clipping range."""
    ppo_epochs: int = Field(1, ge=1)
    """Optimizer passes over each rollout batch. 1 (with one mini-batch) is on-policy."""
    skip_old_log_prob: Literal["auto", "true", "false"] = "auto"
    """Skip the old-log-prob forward when on-policy (auto decides from ppo_epochs and mini-batches)."""
    routing_replay: bool = False
    """MoE rollout routing replay (R3): the rollout records each token's routed experts and the actor's
    training forwards use exactly those experts (native engines, MoE models)."""
    rollout_correction: Literal["auto", "none", "tis", "mis"] = "auto"
    """Rollout-train mismatch correction per token, with w = pi_train / pi_rollout of the sampled token:
    tis multiplies the policy loss by min(w, cap) (truncated importance sampling); mis by w where
    w <= cap and 0 past it (masked importance sampling). The mismatch is reported either way
    (rollout/logprob_diff_mean, _max). auto: none when on-policy, tis when max_staleness > 0 (the
    decoupled objective: the clipped ratio against the proximal policy of the old pass, weighted by
    the truncated proximal / behaviour ratio)."""
    rollout_correction_cap: float = Field(2.0, gt=1.0)
    """The cap C of tis / mis (> 1)."""
    max_staleness: int = Field(0, ge=0)
    """Asynchronous RL: how many optimizer versions the rollout weights may lag behind the actor's when
    a batch is trained on (0: on-policy, synchronous). Above 0 needs resources.placement=disaggregated
    (rollout and training on their own devices, so generation overlaps training)."""
    max_token_staleness: Optional[int] = Field(None, ge=0)
    """A pooled rollout (rollout.partial / rollout.oversample): the most policy versions any trained
    response token may lag behind the weights trained on it (a sample continued across steps holds
    tokens of several versions). Null: max_staleness; never below it. A carried sample whose oldest
    token would pass it is regenerated from its prompt under the current policy
    (rollout/pool_restarted_samples, _tokens). A sample must then be generated within about this
    many steps, so 1 leaves the pool little speed-up on a long tail (docs/workflow.md)."""
    dynamic_sampling: DynamicSampling = Field(default_factory=DynamicSampling)
    overlong: Overlong = Field(default_factory=Overlong)

    @field_validator("skip_old_log_prob", mode="before")
    @classmethod
    def _bool_to_str(cls, v: Any) -> Any:
        return str(v).lower() if isinstance(v, bool) else v

    @field_validator("adv_estimator", "policy_loss", "loss_agg_mode", "kl_estimator", "kl_controller")
    @classmethod
    def _registered(cls, v: str, info) -> str:
        # the registries in rlrecipes/algos are the one list of names (a new estimator registers itself)
        _ALG_TABLES[f"algorithm.{info.field_name}"].get(v)
        return v

    @field_validator("name")
    @classmethod
    def _algorithm(cls, v: str) -> str:
        from ..algos.spec import get_algorithm  # ALGORITHMS is the one list: a new algorithm needs no schema edit

        get_algorithm(v)
        return v

    @model_validator(mode="after")
    def _ranges(self) -> "AlgorithmConfig":
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"algorithm.dual_clip_c must be > 1 or null; got {self.dual_clip_c}")
        if not (0 <= self.clip_ratio_low < 1) or not self.clip_ratio_high >= 0:
            raise ValueError("algorithm.clip_ratio_low must be in [0, 1) and clip_ratio_high >= 0; got "
                             f"{self.clip_ratio_low}, {self.clip_ratio_high}")
        if self.ppo_epochs < 1:
            raise ValueError(f"algorithm.ppo_epochs must be >= 1; got {self.ppo_epochs}")
        if self.rollout_correction == "auto":
            self.rollout_correction = "tis" if self.max_staleness > 0 else "none"
        if self.max_token_staleness is not None and self.max_token_staleness < self.max_staleness:
            raise ValueError(f"algorithm.max_token_staleness={self.max_token_staleness} is below algorithm.max_staleness="
                             f"{self.max_staleness}, which rows (and so their tokens) may lag: set "
                             f"algorithm.max_token_staleness={self.max_staleness} or more, or null (= max_staleness)")
        return self

    @property
    def token_staleness(self) -> int:
        """The bound on every trained token's version lag (max_token_staleness, else max_staleness)."""
        return self.max_staleness if self.max_token_staleness is None else self.max_token_staleness


class RewardConfig(_Strict):
    @field_validator("fn")
    @classmethod
    def _registered_reward(cls, v: str) -> str:
        from ..rewards import BUILTIN_REWARDS  # the one list of built-in rewards: a new one needs no schema edit

        if ":" not in v and v.strip() not in BUILTIN_REWARDS:
            import difflib

            close = difflib.get_close_matches(v, BUILTIN_REWARDS, n=1, cutoff=0.5)
            raise ValueError(f"reward.fn={v!r} is not a registered reward; one of: {', '.join(sorted(BUILTIN_REWARDS))}, "
                             "or an import path 'pkg.module:function'" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return v

    fn: str = "math_verify"
    """Reward function: a registered name (``rlrecipes/rewards/registry.py``: math_verify, format,
    smoke) or ``module:function``."""
    format_weight: float = Field(0.0, ge=0)
    """Weight of the format reward added to the outcome reward."""
    max_failure_rate: float = Field(0.5, ge=0, le=1)
    """The share of a step's reward calls that may fail (raise, or return NaN / inf; such a sample
    scores 0 and is counted in ``reward/errors``, its step's share in ``reward/failure_rate``). A step
    above it stops the run with the rate, the step and the first error; 1.0 never stops."""




class Recipe(_Strict):
    name: str
    """Registered name of the recipe."""
    description: str = ""
    """One line shown by `rlrecipes list`."""
    model: ModelConfig
    data: DataConfig
    algorithm: AlgorithmConfig
    reward: RewardConfig = Field(default_factory=RewardConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    resharding: ReshardConfig = Field(default_factory=ReshardConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    @model_validator(mode="after")
    def _cross(self) -> "Recipe":
        if self.algorithm.name == "ppo" and self.algorithm.adv_estimator != "gae":
            raise ValueError("algorithm.name=ppo needs algorithm.adv_estimator=gae")
        if self.algorithm.use_kl_in_reward and self.algorithm.name != "ppo":
            raise ValueError(f"algorithm.use_kl_in_reward penalises token rewards, which only GAE (ppo) uses; for "
                             f"{self.algorithm.name} set algorithm.use_kl_in_reward=false (algorithm.use_kl_loss=true keeps "
                             "a KL term, in the loss)")
        if self.algorithm.name != "ppo" and self.algorithm.adv_estimator == "gae":
            raise ValueError(f"algorithm.adv_estimator=gae needs a critic: set algorithm.name=ppo (got {self.algorithm.name})")
        res = self.resources
        if res.placement == "disaggregated" and res.rollout_devices is None:
            raise ValueError("resources.placement=disaggregated needs resources.rollout_devices: set it to the devices "
                             "the rollout gets (e.g. resources.rollout_devices=8); training takes the rest")
        if res.placement == "colocated" and res.rollout_devices is not None:
            raise ValueError(f"resources.rollout_devices={res.rollout_devices} only applies to "
                             f"resources.placement=disaggregated; set resources.placement=disaggregated, or "
                             f"resources.rollout_devices=null to keep rollout and training on the same devices")
        ro = self.rollout
        if ro.pooled:
            what = "rollout.partial=true" if ro.partial else f"rollout.oversample={ro.oversample:g}"
            if res.placement != "disaggregated" or self.algorithm.max_staleness < 1:
                raise ValueError(f"{what} continues samples across policy versions, so it needs the rollout on its "
                                 "own devices running ahead of training: set resources.placement=disaggregated "
                                 "resources.rollout_devices=1 algorithm.max_staleness=1 (or more), or "
                                 "rollout.partial=false rollout.oversample=1")
            if ro.multi_turn.enabled:
                raise ValueError(f"{what} continues single-turn responses; a multi-turn rollout's turns already "
                                 "end at tool calls: set rollout.multi_turn.enabled=false, or "
                                 "rollout.partial=false rollout.oversample=1")
        if res.placement == "colocated" and self.algorithm.max_staleness > 0:
            raise ValueError(f"algorithm.max_staleness={self.algorithm.max_staleness} needs rollout and training on "
                             f"their own devices: set resources.placement=disaggregated resources.rollout_devices=1 (or more), "
                             f"or algorithm.max_staleness=0 for synchronous on-policy training")
        return self

    # convenience -------------------------------------------------------------------------------
    @property
    def rows_per_step(self) -> int:
        return self.trainer.global_batch * self.trainer.n_samples_per_prompt

    @property
    def folder(self) -> Optional[Path]:
        return getattr(self, "_folder", None)
