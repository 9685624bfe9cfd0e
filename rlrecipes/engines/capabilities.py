"""What a backend declares it can do: ``plan`` checks every recipe layout against it before anything is
placed. Re-exported by ``engines/base.py``, where the engines and the planner import it from."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports; ``plan`` checks every recipe layout against it."""

    name: str
    roles: frozenset[str]
    """``{"train"}``, ``{"rollout"}`` or both."""
    pipeline_parallel: bool = False
    """Train layouts with PP > 1 (uneven layer splits included)."""
    expert_parallel: bool = False
    """EP > 1 for MoE models."""
    ep_groups: str = "stage"
    """Where the engine lays its expert-parallel groups (``rlrecipes.core.parallel.EP_GROUPS``, the one
    statement of the EP rule): ``"stage"`` anywhere among a pipeline stage's ranks (EP divides
    DP x SP x TP); ``"within_tp"`` inside each TP group (EP divides TP too: the native engine);
    ``"across_dp"`` over data-parallel ranks, every expert split over TP as well (EP x TP divides the
    stage: megatron's expert-TP)."""
    expert_tensor_parallel: bool = False
    """Experts are split over TP as well: megatron's expert-TP in training; a rollout engine whose
    MoE layers split every expert over the TP ranks at EP 1 (vLLM). The planner's memory model uses it."""
    separate_ref_layout: bool = False
    """The reference model / critic may use a layout other than the actor's."""
    critic: bool = True
    """The engine trains a value model too (PPO's critic); its package then names the class in
    ``CRITIC`` (see ``engines/registry.py``)."""
    routing_replay: bool = False
    """MoE routing replay (``algorithm.routing_replay``): the rollout engine records every token's
    experts and the train engine routes each token to them."""
    memory_model: str = "pipeline"
    """Which of ``plan``'s per-device train memory models describes the engine
    (``rlrecipes.plan.memory.TRAIN_MEMORY_MODELS``): ``"fsdp"`` (the whole model per rank, fp32
    master weights, gradients and Adam state sharded over DP) or ``"pipeline"`` (the worst pipeline
    stage: compute-dtype weights, an fp32 DDP gradient buffer, a distributed optimizer)."""
    small_model_bytes: int = 0
    """``fsdp`` memory model: a model of at most this many fp32 parameter bytes is replicated over DP
    (full precision) or kept gathered through a call (FSDP), as the engine does; 0: none is."""
    devices: tuple[str, ...] = ("cpu", "cuda", "npu")
    """Device types the backend runs on."""
    dtypes: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32")
    """Compute dtypes it accepts (``recipe.model.dtype``)."""
    requires: tuple[str, ...] = ()
    """Python modules that must import for the backend to run (checked without importing them)."""
    requires_by_device: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Extra modules per device type, e.g. ``(("npu", ("mindspeed",)),)``."""
    install: str = ""
    """How to install what ``requires`` names (shown when it is missing)."""
    min_head_dim_by_device: tuple[tuple[str, int], ...] = ()
    """``(device, smallest attention head size its kernels take)`` (vLLM's CPU attention: 32)."""
    mla_latent_sizes_by_device: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``(device, MLA latent sizes kv_lora_rank + qk_rope_head_dim its kernels take)`` (vLLM CPU: 576)."""
    layout_rules: str = ""
    """``"module:function"`` of a pure function (no heavy imports) with the engine's own layout rules:
    ``fn(*, role, dims, tp, pp, ep, etp, world, device, installed, recipe) -> list[str]``, one sentence per
    problem, each with the fix. ``plan`` calls it for every role the engine serves, and the engine
    runs the same function when it is built, so a layout ``plan`` passes is one the engine accepts."""
    inference_settings: str = ""
    """``"module:function"`` of a pure function that renders ``rollout.inference`` for the target
    platform: ``fn(*, inference, dims) -> (dict | None, list[str])``, what ``plan`` prints (None:
    nothing to render here) and one sentence per setting the target cannot serve, each with the fix.
    Empty: the engine renders nothing."""
    decode_graphs: bool = False
    """A rollout engine that captures its decode step as a graph (vLLM: CUDA / ACL graphs) when
    ``rollout.inference.graph_mode`` is on. False: the host launches every kernel of every decode
    iteration, which ``plan``'s step-time model prices per layer (:mod:`rlrecipes.plan.steptime`)."""
    image_prompts: bool = False
    """A rollout engine that generates from prompts with images (vision-language models: the
    pixels and their positions reach its forward). ``plan`` notes a VL recipe whose rollout engine
    cannot, since such a run stops at its first rollout."""
    image_activations_profiled: bool = True
    """A rollout engine with ``image_prompts`` that measures its vision tower's activation peak when it
    sizes its caches. False (vLLM: no dummy images, ``skip_mm_profiling``): ``plan`` notes how much the
    memory setting must leave for them on an accelerator."""
    lora: bool = False
    """LoRA adapters (``actor.lora``): a train engine trains them with its base frozen and serves the
    base as the reference policy; a rollout engine applies adapters synced from the trainer."""
    head_chunk_tokens: int = 0
    """A train engine that scores tokens from the final hidden states this many at a time (one chunk's
    ``[chunk, vocab]`` logits live at once, recomputed in backward); 0: it writes the head's logits
    for every token. ``plan`` sizes the logits with it."""
    sequence_parallel: str = ""
    """How a train engine splits one sequence over ``layout.sp`` devices: ``"ulysses"`` (all-to-all
    head-sharded attention), ``"context_parallel"`` (megatron's ``context_parallel_size``), or ``""``
    (it cannot: ``plan`` refuses ``sp > 1``)."""
    multi_turn_multi_rank: bool = True
    """Multi-turn rollouts (``rollout.multi_turn``) on instances of several ranks (rollout TP or
    EP > 1): the instance's leader runs the agent loop and mirrors every turn call to its peers."""
    implemented: bool = True
    """False while a backend is declared but not complete: ``plan`` reports it and ``run`` refuses."""
    status: str = ""
    """What an incomplete backend has and lacks (shown with the refusal)."""


__all__ = ["Capabilities"]
