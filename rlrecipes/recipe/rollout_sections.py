"""Recipe sections of the rollout: its layout, the inference engine's settings, sampling, multi-turn tools and the pooled rollout."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from .base import _Strict, registered_engine


class RolloutLayout(_Strict):
    """The rollout's layout keys (``recipe.roles.role_layout`` makes its ``ParallelLayout``)."""

    tp: int = Field(1, ge=1)
    """Tensor-parallel size of one rollout instance."""
    pp: int = Field(1, ge=1)
    """Must be 1: rollout runs without pipeline parallelism."""
    ep: int = Field(1, ge=1)
    """Expert-parallel size of the rollout (experts are routed here by the resharder)."""




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

    @field_validator("tool_format")
    @classmethod
    def _registered_format(cls, v: str) -> str:
        from ..agent.parsing import TOOL_FORMATS  # the one list of formats: a new one needs no schema edit

        if v != "auto" and v not in TOOL_FORMATS:
            raise ValueError(f"rollout.multi_turn.tool_format={v!r} is not a registered tool format; one of: auto, "
                             f"{', '.join(TOOL_FORMATS)}")
        return v

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
    tool_format: str = "auto"
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
    @field_validator("engine")
    @classmethod
    def _rollout_engine(cls, v: str) -> str:
        return registered_engine(v, "rollout", "rollout.engine")

    engine: str = "native"
    """Rollout engine, by its name in the engine registry: native (batched KV-cache sampler, any
    device) or vllm (vLLM / vllm-ascend)."""
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
    groups, the unfinished ones stay in the dock and continue in the next step (never dropped;
    within algorithm.max_token_staleness, see on_stale). A complete group the next step could not
    take is trained at once, so a step may train on more than its batch: with the token bound at 1,
    on every group that completes in it. Above 1 needs disaggregated placement and
    algorithm.max_staleness >= 1."""
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
