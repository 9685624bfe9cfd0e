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

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..algos.registry import TABLES as _ALG_TABLES
from ..models import PRESETS, ModelDims, smoke_dims


class RecipeError(ValueError):
    """A bad recipe, override or recipe name. The message names the file/key and suggests a fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # inf/nan: an error


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


class ModelConfig(_Strict):
    family: Literal["qwen2", "qwen3_moe", "deepseek_v3"]
    """Architecture family: qwen2 (dense), qwen3_moe (MoE), deepseek_v3 (MLA + MoE)."""
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
    synthetic: Optional[Literal["copy", "reverse", "add", "longtail"]] = None
    """Use the bundled deterministic synthetic digit task instead of files (smoke runs); `longtail`
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
    name: Literal["grpo", "dapo", "ppo"]
    """The algorithm: its stage DAG and defaults."""
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
    fn: str = "math_verify"
    """Reward function: a registered name (math_verify, format, smoke) or `module:function`."""
    format_weight: float = Field(0.0, ge=0)
    """Weight of the format reward added to the outcome reward."""
    max_failure_rate: float = Field(0.5, ge=0, le=1)
    """The share of a step's reward calls that may fail (raise, or return NaN / inf; such a sample
    scores 0 and is counted in ``reward/errors``, its step's share in ``reward/failure_rate``). A step
    above it stops the run with the rate, the step and the first error; 1.0 never stops."""


# ---------------------------------------------------------------------------------------------
# layouts and engines
# ---------------------------------------------------------------------------------------------
class TrainLayout(_Strict):
    tp: int = Field(1, ge=1)
    """Tensor-parallel size."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size."""
    ep: int = Field(1, ge=1)
    """Expert-parallel size (carved out of dp*tp)."""
    sp: int = Field(1, ge=1)
    """Sequence-parallel size: each micro-batch's sequences are split over ``sp`` devices, which see
    the same samples (carved out of DP: DP = devices / (tp * pp * sp)). The native engine runs
    Ulysses (attention over all-to-all head shards); megatron runs it as ``context_parallel_size``."""
    pp_layers: Optional[list[int]] = None
    """Layers per pipeline stage, e.g. [7,7,8,8,8,8,8,7]; even split when null."""


class RolloutLayout(_Strict):
    tp: int = Field(1, ge=1)
    """Tensor-parallel size of one rollout instance."""
    pp: int = Field(1, ge=1)
    """Must be 1: rollout runs without pipeline parallelism."""
    ep: int = Field(1, ge=1)
    """Expert-parallel size of the rollout (experts are routed here by the resharder)."""


class LoraConfig(_Strict):
    """LoRA adapters on the actor (PEFT); ``rank: 0`` is off."""

    rank: int = Field(0, ge=0)
    """Adapter rank r; 0: full-parameter training."""
    alpha: float = Field(16.0, gt=0)
    """Scale alpha (the update is alpha / r * B A)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    """Linear layers (by name) that get adapters."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ActorConfig(_Strict):
    engine: Literal["native", "megatron"] = "native"
    """Training engine: native (HF + FSDP2 + DTensor TP/EP, any device) or megatron (megatron-core / MindSpeed)."""
    layout: TrainLayout = Field(default_factory=TrainLayout)
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip."""
    offload_optimizer: bool = False
    """Keep Adam state on the host between optimizer steps (native: swapped in for each step; megatron:
    swap-optimizer); the planner counts it off-device."""
    recompute: bool = True
    """Activation recomputation per decoder layer (native: activation checkpointing; megatron: full
    recompute); the planner's activation estimate uses it."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA: adapters trained, the base frozen; the reference policy is the base (adapters off)."""


class RefConfig(_Strict):
    enabled: bool = True
    """Compute reference log-probs (needed for a KL term)."""
    layout: Optional[TrainLayout] = None
    """Reference layout; null reuses the actor layout (colocated)."""


class CriticConfig(_Strict):
    layout: Optional[TrainLayout] = None
    """Critic layout (PPO); null reuses the actor layout."""
    lr: float = Field(1e-5, gt=0)
    """Critic learning rate."""


class InferenceSettings(_Strict):
    """Rollout-engine settings rendered for vllm-ascend (see rlrecipes.engines.vllm.settings)."""

    kv_cache_format: Literal["nd", "nz"] = "nd"
    """KV-cache storage format: nd, or nz (ACL FRACTAL_NZ on Ascend)."""
    multistream_mla: bool = False
    """Overlap MLA preprocessing on a second stream (DeepSeek)."""
    multistream_moe: bool = False
    """Overlap the MoE shared expert with routed experts on a second stream."""
    graph_mode: bool = False
    """Capture decode in a graph (torchair / ACL graph)."""
    enforce_eager: bool = False
    """Disable graph capture entirely."""
    max_num_seqs: int = Field(256, ge=1)
    """Max concurrent sequences per instance."""
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    """Share of device memory the rollout may take (weights + KV cache)."""
    max_num_batched_tokens: Optional[int] = Field(None, ge=1)
    """Chunked-prefill budget per scheduler step."""
    vllm_ascend_version: Optional[str] = None
    """vllm-ascend release the settings are rendered and checked for; null: the installed one (if any)."""


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables."""
    max_new_tokens: int = Field(2048, ge=1)
    """Response length limit."""


class MultiTurnConfig(_Strict):
    """Multi-turn agentic rollout: tool calls inside the rollout (docs/agentic.md)."""

    enabled: bool = False
    """Run the agent loop: generate until a tool call, run the tools, append their results as
    observation tokens (``response_mask`` 0), continue until EOS or a limit."""
    max_turns: int = 4
    """Assistant turns (generated segments) per sample, the first included."""
    max_tool_calls: int = 4
    """Tool calls per sample; calls past it are not run and end the sample."""
    max_response_tokens: int = Field(256, ge=1)
    """The whole response (model tokens and observations) per sample; ``sampling.max_new_tokens``
    limits each turn."""
    tools: list[str] = Field(default_factory=lambda: ["calculator"])
    """Built-in tool names (calculator, python) or ``module:function`` of your own."""
    tool_format: Literal["auto", "qwen", "smoke"] = "auto"
    """How the model writes calls and reads results: qwen (``<tool_call>`` JSON, the chat template
    renders results), smoke (the smoke tokenizer's one-letter calls); auto: smoke for smoke models,
    qwen otherwise."""
    tool_workers: int = Field(32, ge=1)
    """Tool calls that run at the same time on each rollout worker (a thread pool)."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Per-call timeout; a call past it becomes an error observation."""
    sandbox: Literal["bwrap", "rlimits"] = "bwrap"
    """How the ``python`` tool is isolated (docs/sandbox.md): bwrap (bubblewrap + rlimits; where
    bubblewrap is missing or cannot create namespaces the tool refuses to run and ``plan`` refuses
    the recipe) or rlimits (rlimits only, accepted in so many words: the network and the host's
    filesystem are NOT isolated)."""
    max_observation_tokens: int = Field(256, ge=1)
    """An observation longer than this is shortened: the results' text is cut and rendered again (the
    format's frame, e.g. the chat template's tool turn, stays whole); if not even that fits the
    sample ends on its call (truncated)."""

    @field_validator("max_turns")
    @classmethod
    def _turns(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_turns must be >= 1 (the first turn is a turn); got {v}")
        return v

    @field_validator("max_tool_calls")
    @classmethod
    def _calls(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"max_tool_calls must be >= 0; got {v}")
        return v


class RolloutConfig(_Strict):
    engine: Literal["native", "vllm"] = "native"
    """Rollout engine: native (batched KV-cache sampler, any device) or vllm (vLLM / vllm-ascend)."""
    layout: RolloutLayout = Field(default_factory=RolloutLayout)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    inference: InferenceSettings = Field(default_factory=InferenceSettings)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    expected_response_tokens: Optional[int] = Field(None, ge=1)
    """The mean response length (tokens) ``plan`` predicts the step with. Null: half of
    sampling.max_new_tokens (the DeepSeek-R1 run that cann-recipes-train publishes averages 1,577 of
    3,072). The longest response still sets the decode iterations (max_new_tokens)."""
    partial: bool = False
    """Partial rollout (disaggregated placement, algorithm.max_staleness >= 1): a new policy version
    that reaches a rollout worker mid-generation interrupts it; the weights load and the unfinished
    samples continue from their prefix (re-prefilled under the new weights). Every response token
    records the version and the behaviour log-prob that produced it (``token_versions``)."""
    oversample: float = Field(1.0, ge=1.0, le=8.0)
    """Generate this many times the batch's prompt groups; a step trains on the first complete
    groups, the unfinished ones stay in the dock and continue in the next step (never dropped).
    Above 1 needs disaggregated placement and algorithm.max_staleness >= 1."""
    chunk_tokens: int = Field(8, ge=1, le=65536)
    """Partial rollout / over-sampling: tokens each unfinished sample generates between two looks
    at the batch (enough complete groups? a new policy version waiting?)."""
    max_wait_steps: Optional[int] = Field(None, ge=1)
    """Pooled rollout: the most steps a group may wait in the pool after the step that drew it; the
    step it reaches this does not commit before the group is complete, and trains on it. 1: every
    carried group is finished, and trained on, in the next step (carried groups first). Bounds how
    far the trained batch leans to short responses (rollout/length_bias), at a cost in speed. Null:
    a group waits until it completes."""
    on_stale: Literal["regenerate", "finish"] = "regenerate"
    """Pooled rollout: how algorithm.max_token_staleness is kept. regenerate: a carried sample whose
    oldest token has passed the bound when a step starts is regenerated from its prompt under the
    current policy (its tokens thrown away: rollout/pool_restarted_tokens); steps stay short, but
    an answer that takes longer than the bound's steps to generate restarts again and again.
    finish: a group that would pass the bound at the next step is finished in this one (the step
    does not commit before it is complete); nothing is thrown away, and the step waits for it."""

    @property
    def pooled(self) -> bool:
        """Generation keeps a pool of groups across steps (partial rollout or over-sampling)."""
        return self.partial or self.oversample > 1.0

    @property
    def max_response_len(self) -> int:
        """The longest response a sample can have: one turn's limit, or a multi-turn trajectory's
        (every turn and observation); what the rollout serves and the planner sizes."""
        return self.multi_turn.max_response_tokens if self.multi_turn.enabled else self.sampling.max_new_tokens


class ReshardConfig(_Strict):
    strategy: Literal["auto", "allgather_naive", "allgather_swap", "alltoallv_experts", "tp_allgather_pp_alltoall"] = "auto"
    """How trained weights reach the rollout layout each step."""
    bucket_mb: int = Field(512, ge=1)
    """Bucket size of the bucketed strategies."""
    swap_grads: bool = False
    """Also swap gradients to host during rollout (the native engine swaps params, grads and optimizer together)."""
    swap_optimizer: bool = True
    """Swap training state to host during rollout so the KV cache gets the room (no-op on CPU)."""


class ResourcesConfig(_Strict):
    @field_validator("hardware")
    @classmethod
    def _known_hardware(cls, v: Optional[str]) -> Optional[str]:
        from ..hardware import get_hardware

        if v is not None:
            try:
                get_hardware(v)
            except KeyError as e:
                raise ValueError(e.args[0]) from None
        return v

    def hardware_name(self) -> str:
        """The hardware table row this recipe is predicted on (``hardware`` or the device's default)."""
        from ..hardware import default_hardware

        return self.hardware or default_hardware(self.device, self.dies_per_card)

    nodes: int = Field(1, ge=1, le=65536)
    """Nodes the pinned layout was published on (`--nodes` overrides)."""
    devices_per_node: int = Field(16, ge=1, le=1024)
    """Ray accelerator resources per node (an Atlas A3 node: 8 cards = 16 dies)."""
    device: Literal["auto", "npu", "cuda", "cpu"] = "npu"
    """Device type the recipe targets."""
    dies_per_card: int = Field(2, ge=1)
    """Ray devices per card; TPS/card divides by cards (A3: 2 dies per card)."""
    device_memory_gb: float = Field(64.0, gt=0)
    """Memory of one device, for the planner's fit check (A3 die: 64 GB HBM)."""
    hardware: Optional[str] = None
    """The machine ``plan`` predicts the step time on: a row of the hardware table
    (``rlrecipes/hardware.py``: atlas-a2, atlas-a3, h100, h200, h20, cpu). Null: from ``device``
    and ``dies_per_card`` (npu with 2 dies per card: atlas-a3; 1: atlas-a2; cuda: h100; cpu: cpu)."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs reserved per worker actor."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: every device holds the actor (ref, critic) and the rollout, in turn (weights
    resharded in place, training state swapped out while generating). disaggregated: the rollout
    gets resources.rollout_devices devices of its own (the last ranks), training the rest; weights
    move across once per step and generation can run ahead (algorithm.max_staleness)."""
    rollout_devices: Optional[int] = Field(None, ge=1)
    """disaggregated: devices given to the rollout (rollout TP x EP x DP fills exactly these);
    the actor, ref and critic layouts fill the other world - rollout_devices. Null when colocated."""
    dock_transport: Literal["direct", "ray"] = "direct"
    """How workers call the TransferDock's warehouses: direct (a ZeroMQ connection per worker thread
    and warehouse, on an ephemeral port of each node; a small fraction of a Ray call's CPU) or ray
    (Ray actor calls only). A worker that cannot open a connection uses Ray calls for it, with a
    warning; set ray where the nodes' ephemeral ports are firewalled from each other."""
    dock_encryption: bool = True
    """direct transport: encrypt and authenticate the dock's connections with ZeroMQ CURVE (keys made
    per run, passed only through Ray). false: traffic in clear, peers still checked by a per-run
    token; turn off only inside a trusted network (docs/transfer_dock.md has the measured cost)."""


class TrainerConfig(_Strict):
    @field_validator("loggers")
    @classmethod
    def _jsonl_always(cls, v: list) -> list:
        return list(dict.fromkeys(["jsonl", *v]))

    steps: int = Field(100, ge=1, le=100_000_000)
    """Training steps (one rollout batch each)."""
    global_batch: int = Field(32, ge=1)
    """Prompts per step."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Responses sampled per prompt (the GRPO group size)."""
    mini_batch: int = Field(32, ge=1)
    """Prompts per optimizer step; global_batch / mini_batch optimizer steps per rollout batch."""
    micro_batch: int = Field(4, ge=1)
    """Samples per forward/backward on one DP rank (gradient accumulation), when no token budget is set."""
    max_tokens_per_micro_batch: Optional[int] = Field(None, ge=1)
    """Dynamic batching: pack unpadded samples into micro-batches of at most this many prompt + response
    tokens (replaces micro_batch; null: fixed micro_batch samples, padded). A longer sample (a 32K
    response) forms a micro-batch of its own; ``plan`` counts at least one whole sample per micro-batch."""
    lr: float = Field(1e-6, gt=0)
    """Actor AdamW learning rate."""
    warmup_steps: int = Field(0, ge=0)
    """Linear LR warm-up steps."""
    seed: int = Field(1234, ge=0, le=2**63 - 1)
    """Seed of data order, sampling and initialisation."""
    checkpoint_interval: int = Field(0, ge=0)
    """Save the train state every K steps (0: never)."""
    out_dir: str = "runs"
    """Where run folders are created."""
    export_hf: bool = True
    """At the end of the run, write the trained actor as an HF folder (<run>/actor_hf) that transformers loads."""
    rebalance_tolerance: float = Field(0.1, ge=0)
    """Colocated runs whose actor has one DP rank per worker, as the rollout does: each worker trains on
    the rows it generated while the heaviest worker's prompt + response tokens are at most this fraction
    above the mean; beyond it the update re-balances rows by tokens through the TransferDock (one claim
    and a TensorCache all-to-all). 0: re-balance unless the loads are already even."""
    dock_timeout_s: float = Field(600.0, gt=0)
    """A stage waiting longer than this on the TransferDock fails with a named error."""
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(default_factory=lambda: ["jsonl"])
    """Where per-step metrics go: jsonl (<run>/metrics.jsonl, always on), tensorboard (<run>/tensorboard),
    wandb (online when logged in, else offline in <run>/wandb). tensorboard / wandb are extras."""
    fail_when_bad_share: float = Field(1.0, gt=0, le=1)
    """The run exits non-zero when this share of its steps skipped the update (non-finite loss or
    gradient), or this share of its samples' rewards raised; 1.0: only when all of them did."""

    @model_validator(mode="after")
    def _batches(self) -> "TrainerConfig":
        if self.global_batch % self.mini_batch:
            raise ValueError(f"trainer.global_batch={self.global_batch} is not a multiple of trainer.mini_batch={self.mini_batch}")
        return self


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
