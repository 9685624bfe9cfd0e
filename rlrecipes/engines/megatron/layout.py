"""What the megatron engine asks of megatron-core for a layout, in plain Python (no megatron import).

One function builds every ``TransformerConfig`` / ``MLATransformerConfig`` keyword the engine uses
(:func:`engine_config_kwargs`), one the ``OptimizerConfig`` keywords (:func:`optimizer_config_kwargs`),
and :func:`layout_problems` says, before anything is placed, what of a layout megatron-core would
refuse on a device; ``plan`` calls it, tests build the real configs from the same keywords.

Decisions (the upstream lines behind each are in docs/upstream_contracts.md):

* **sequence parallelism whenever TP > 1**, dense or MoE. megatron's MoE layer raises in training
  with TP > 1 without it (``moe_layer.py``), and MLA's q / kv norms are only reduced right with it
  (their inputs are sequence-sharded, ``finalize_model_grads`` sums their gradients over TP). The
  embedding scatters the sequence, the output layer gathers it back, so the logits the engine
  reads stay ``[b, s, vocab / tp]``. Sequences are padded to a multiple of TP (:func:`padded_length`).
* **rows are right-aligned** (:func:`right_align`): each sample starts at column 0, padding follows
  it, so the causal mask alone is the right mask: megatron's local attention, TransformerEngine's
  and MindSpeed's fused attention (which apply their own causal mask) give the same log-probs.
* **optimizer offload**: megatron's ``HybridDeviceOptimizer`` with every parameter on the host
  (``optimizer_offload_fraction=1.0``; megatron's default 0.0 offloads nothing) and the
  precision-aware optimizer path it reuses (Megatron-LM's own argument check requires it).
* **context parallelism** (``layout.sp`` = ``context_parallel_size``, carved out of DP): every
  layer's core attention must be TransformerEngine's ``DotProductAttention`` on CUDA (megatron's own
  asserts CP size 1) or MindSpeed's CP attention on Ascend (``megatron_cp_algo``, :func:`mindspeed_args`);
  rows are padded to ``2 * cp`` load-balanced chunks (cp.py, :func:`padded_length`).
* **fp16**: megatron's dynamic loss scaler, starting at 2**16 (megatron's default 2**32 makes the
  first ~16 steps overflow and skip, most of a short RL run); the engine wires
  ``config.grad_scale_func = optimizer.scale_loss`` so the schedule scales the loss.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from ...models import ModelDims
from . import cp as cpmod
from .convert import rope_theta, transformer_config
from .shard import Ranks, layout_errors

#: fp16's first loss scale (megatron's DynamicGradScaler then halves on overflow, doubles every
#: ``loss_scale_window`` clean steps)
FP16_INITIAL_LOSS_SCALE = 2.0 ** 16


def pipeline_layout(pp_layers) -> list[list[str]]:
    """megatron's ``pipeline_model_parallel_layout`` for a per-stage layer split (any split, uneven
    included): the embedding on the first stage, the loss on the last."""
    out = [["decoder"] * int(n) for n in pp_layers]
    out[0].insert(0, "embedding")
    out[-1].append("loss")
    return out


def sequence_parallel(tp: int) -> bool:
    """Whether the engine runs megatron's sequence parallelism: whenever TP > 1 (module docstring)."""
    return int(tp) > 1


def dtype_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    return dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)


def parallel_kwargs(r: Ranks, dtype: torch.dtype) -> dict[str, Any]:
    """``TransformerConfig`` fields of a layout. With PP, micro-batches of different lengths cross
    the stages (``variable_seq_lengths``: megatron sends each tensor's shape first), which megatron
    allows with the all-to-all token dispatcher only (set for dense models too, where it is unused)."""
    kw: dict[str, Any] = dict(tensor_model_parallel_size=r.tp, pipeline_model_parallel_size=r.pp,
                              expert_model_parallel_size=r.ep, expert_tensor_parallel_size=r.etp,
                              context_parallel_size=r.cp, sequence_parallel=sequence_parallel(r.tp))
    if r.pp > 1:
        kw.update(pipeline_dtype=dtype, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
                  pipeline_model_parallel_layout=pipeline_layout(r.pp_layers))
    return kw


def engine_config_kwargs(dims: ModelDims, hf_config: Optional[Mapping], r: Ranks, dtype: torch.dtype, *,
                         recompute: bool = False, training: bool = True) -> dict[str, Any]:
    """Every keyword of the ``TransformerConfig`` (``MLATransformerConfig`` when ``dims.is_mla``) the
    engine builds: the architecture (:func:`convert.transformer_config`), the layout
    (:func:`parallel_kwargs`), the dtype and, for a training engine with ``recompute``, full uniform
    recomputation of every layer. ``hf_config``: the HF ``config.json`` dict (RoPE, norm epsilon,
    routing details)."""
    hf = dict(hf_config or {})
    kw = transformer_config(dims, rope_theta=rope_theta(hf), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                            hf_config=hf)
    kw.update(dtype_kwargs(dtype))
    kw.update(parallel_kwargs(r, dtype))
    if recompute and training:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return kw


def optimizer_config_kwargs(*, lr: float, weight_decay: float, grad_clip: float, dtype: torch.dtype,
                            offload: bool) -> dict[str, Any]:
    """``OptimizerConfig`` keywords: Adam over megatron's distributed optimizer; ``offload``: every
    parameter's Adam step on the host (``HybridDeviceOptimizer``, which megatron builds only for
    ``decoupled_weight_decay`` = AdamW, its default; the precision-aware path with fp32 main
    parameters and gradients, megatron's defaults); fp16: the dynamic loss scaler."""
    kw: dict[str, Any] = dict(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=grad_clip,
                              adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, use_distributed_optimizer=True,
                              **dtype_kwargs(dtype))
    if offload:
        kw.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True,
                  main_params_dtype=torch.float32, main_grads_dtype=torch.float32, decoupled_weight_decay=True)
    if dtype == torch.float16:
        kw.update(loss_scale=None, initial_loss_scale=FP16_INITIAL_LOSS_SCALE, min_loss_scale=1.0,
                  loss_scale_window=1000, hysteresis=2)
    return kw


def ddp_config_kwargs() -> dict[str, Any]:
    """``DistributedDataParallelConfig`` keywords: fp32 gradient buffer, distributed optimizer."""
    return dict(grad_reduce_in_fp32=True, use_distributed_optimizer=True)


# ------------------------------------------------------------------------------------- rows
def padded_length(length: int, tp: int, cp: int = 1) -> int:
    """The micro-batch length megatron gets: ``length`` rounded up to a multiple of TP under
    sequence parallelism (megatron splits the sequence evenly over TP), unchanged otherwise; with
    context parallelism ``cp > 1``, to ``2 * cp`` equal chunks whose pairs divide by TP
    (:func:`cp.padded_length`)."""
    return cpmod.padded_length(length, tp, cp)  # at CP 1: a multiple of TP exactly when TP > 1


def leading_padding(keep: torch.Tensor) -> torch.Tensor:
    """``[b]``: the padding columns before each row's first real token (``keep [b, T]``, 1 = real)."""
    return (~keep.bool()).long().cumprod(-1).sum(-1)


def right_align(ids: torch.Tensor, keep: torch.Tensor, length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows -> right-aligned rows of ``length`` columns.

    ``ids, keep [b, T]`` (``keep``: 1 for a real token; the engine's micro-batches are a left-padded
    prompt then a right-padded response). Row ``i`` moves left by its count of leading padding
    ``lead[i]`` so its first token sits at column 0; everything after the row's tokens is
    ``pad_id``. Returns ``(ids [b, length], lead [b])``. With the causal mask no real token ever
    sees a padding token, whatever attention kernel applies it."""
    b, T = ids.shape
    if length < T:
        raise ValueError(f"right_align: length {length} is shorter than the rows ({T})")
    keep = keep.bool()
    lead = leading_padding(keep)  # [b]
    src = torch.arange(length, device=ids.device)[None, :] + lead[:, None]  # [b, length]
    inside = src < T
    src = src.clamp(max=T - 1)
    real = inside & keep.gather(1, src)
    out = torch.where(real, ids.gather(1, src), torch.full_like(src, int(pad_id)))
    return out, lead


def response_logit_index(lead: torch.Tensor, prompt_width: int, response_width: int) -> torch.Tensor:
    """``[b, R]`` columns of the right-aligned logits that predict each response token: response token
    ``j`` of row ``i`` sat at column ``P + j`` of the left-padded row and moved ``lead[i]`` left; the
    logits one column before it predict it."""
    j = torch.arange(response_width, device=lead.device)
    return (prompt_width - 1 - lead)[:, None] + j[None, :]


# ------------------------------------------------------------------------------------- checks
def mla_core_attention(device: str, have_te: bool) -> str:
    """Which core attention MLA layers get: ``"te"`` (TransformerEngine's fused attention, CUDA with
    TE installed) or ``"local"`` (megatron's ``DotProductAttention`` through the engine's adapter,
    which takes MLA's separate q/k and v head sizes; O(s^2) memory per head, everywhere else)."""
    return "te" if device == "cuda" and have_te else "local"


def cp_attention_problem(device: str, sp: int, have_te: bool) -> Optional[str]:
    """Why megatron cannot run context parallelism ``sp`` on ``device`` as the engine builds it, with
    the fix; None when it can. megatron's local ``DotProductAttention`` asserts a CP size of 1 and
    TransformerEngine's is the CP attention on CUDA; on Ascend MindSpeed provides it (its absence is
    refused by :func:`layout_problems` already)."""
    if int(sp) > 1 and device != "npu" and not have_te:
        return (f"layout.sp={sp} on the megatron engine is megatron's context parallelism, whose attention is "
                "TransformerEngine's DotProductAttention (megatron's local attention refuses context_parallel_size "
                "> 1): install TransformerEngine (pip install --no-build-isolation 'transformer-engine[pytorch]'), "
                "set layout.sp: 1, or use the native engine (actor.engine: native, Ulysses sequence parallelism)")
    return None


def core_attention(device: str, have_te: bool, sp: int = 1) -> str:
    """The core attention the engine's layer spec gets (``model.decoder_block_spec``): with context
    parallelism on CUDA, ``"te"`` in every layer (TransformerEngine's ``DotProductAttention``, the one
    megatron-core class that runs CP; raises :func:`cp_attention_problem` without TE); on Ascend
    ``"local"`` (the spec's own slot, into which MindSpeed patches its CP attention, see
    :func:`mindspeed_args`); without CP, :func:`mla_core_attention` (MLA layers only)."""
    why = cp_attention_problem(device, sp, have_te)
    if why:
        raise RuntimeError(why)
    if int(sp) > 1:
        return "local" if device == "npu" else "te"
    return mla_core_attention(device, have_te)


def layout_problems(dims: ModelDims, *, tp: int, pp: int, ep: int, etp: Optional[int] = None, device: str,
                    have_te: bool, have_mindspeed: bool, pp_layers=None, offload_optimizer: bool = False,
                    megatron_core: Optional[str] = None, sp: int = 1) -> list[str]:
    """Sentences naming what megatron-core (as this engine drives it) cannot do with this model and
    layout on ``device``, each with its fix; empty when it can. Pure: ``plan`` calls it with what
    the cluster has (``have_te``: ``transformer_engine`` importable; ``have_mindspeed``: MindSpeed;
    ``megatron_core``: the installed version string, when known; ``sp``: ``layout.sp``, megatron's
    context-parallel size)."""
    out: list[str] = []
    etp = int(etp or tp)
    if device not in ("cuda", "npu"):
        out.append(f"megatron-core computes on CUDA or NPU, not {device}; use the native engine (actor.engine: native)")
    if device == "npu" and not have_mindspeed:
        out.append("megatron-core on Ascend needs MindSpeed (it adapts megatron to torch_npu); install it from "
                   "source (docs/ascend.md) or use actor.engine: native")
    r = Ranks(tp=int(tp), pp_layers=tuple(int(n) for n in pp_layers) if pp_layers else (), ep=int(ep), etp=etp)
    # heads, KV heads, experts and the layer split are the layout rules every engine shares
    # (ParallelLayout.model_problems: plan reports them once, the engine's check_layout raises them)
    out += [f"megatron layout TP{tp} PP{pp} EP{ep} ETP{etp}: {why}; choose sizes that divide it" for why in
            layout_errors(dims, r)]
    why = cp_attention_problem(device, sp, have_te) if device in ("cuda", "npu") else None
    if why:
        out.append(why)
    if offload_optimizer and not have_te and not (device == "npu" and have_mindspeed) and \
            megatron_core is not None and _version(megatron_core) < (0, 19):
        # on NPU, MindSpeed's pre-patches answer importlib.metadata.version("transformer-engine") with
        # "2.2.0" and register dummy transformer_engine modules, so is_te_min_version answers there
        out.append(f"actor.offload_optimizer on megatron-core {megatron_core} needs TransformerEngine installed: its "
                   "OptimizerConfig compares TE's version when the precision-aware optimizer (which the host "
                   "optimizer requires) is on, and fails without TE before 0.19; install transformer-engine, use megatron-core >= 0.19 "
                   "(Python >= 3.12), or set actor.offload_optimizer: false (resharding.swap_optimizer still moves "
                   "the Adam state to the host while the rollout runs)")
    return out


#: the megatron-core a device's stack installs when ``plan`` runs where it is not installed: the
#: ``ascend`` extra's (MindSpeed core_r0.16.0 -> 0.16.x); CUDA's depends on the Python version
STACK_MEGATRON_CORE = {"npu": "0.16.1"}


def plan_rules(*, layout, dims: ModelDims, etp: Optional[int], device: str, installed: bool,
               recipe=None) -> list[str]:
    """``Capabilities.layout_rules``: :func:`layout_problems` for one train role's layout (a
    ``ParallelLayout``: its sizes, layer split and ``sp``, megatron's context-parallel size), judged
    with what is installed here (``installed=True``: the engine's own inputs) or with the device's
    supported stack (``installed=False``, ``plan`` for another machine: on NPU MindSpeed and the
    ascend extra's megatron-core; TransformerEngine is never assumed, an unknown CUDA megatron-core
    skips its version rule)."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    def have(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ModuleNotFoundError, ValueError):
            return False

    mcore: Optional[str] = STACK_MEGATRON_CORE.get(device)
    if installed:
        try:
            mcore = version("megatron-core")
        except PackageNotFoundError:
            pass
    offload = bool(recipe.actor.offload_optimizer) if recipe is not None and layout.role == "actor" else False
    vision = ([f"megatron trains text decoders only; {dims.family} has a vision tower: set actor.engine: native "
               "(HF Qwen2.5-VL + FSDP2)"] if dims.has_vision else [])
    # context parallelism (layout.sp -> context_parallel_size): layout_problems refuses it without the
    # attention that runs it (TransformerEngine's on CUDA, never assumed for another machine; MindSpeed's
    # on Ascend, part of the supported stack). megatron-core cuts every row into 2 x CP load-balanced
    # chunks (seq_length % (2 * cp) == 0, Megatron-LM's argument check): the engine pads rows to it
    # (cp.padded_length), so no recipe length is refused; plan counts the padding in its memory model
    return vision + layout_problems(dims, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=etp, device=device,
                           have_te=have("transformer_engine") if installed else False,
                           have_mindspeed=have("mindspeed") if installed else True, pp_layers=layout.pp_layers,
                           offload_optimizer=offload, megatron_core=mcore, sp=layout.sp)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in str(text).split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


#: MindSpeed (core_r0.16.0) arguments for megatron-core context parallelism: ring attention with the
#: load-balanced split the engine feeds (``megatron_cp_algo``; MindSpeed's ``ulysses_cp_algo`` splits
#: the sequence contiguously instead), a causal mask, one ring window, no extra send/recv group, and
#: ``use_flash_attn`` (MindSpeed's own argument check sets it for CP; without it MindSpeed's causal
#: mask would be built from Megatron-LM's ``seq_length`` / ``micro_batch_size``, which the engine has not)
MINDSPEED_CP_ARGS = dict(context_parallel_algo="megatron_cp_algo", attention_mask_type="causal", cp_window_size=1,
                         use_cp_send_recv_overlap=False, use_flash_attn=True)


def mindspeed_args(dims: ModelDims, cp: int = 1) -> dict[str, Any]:
    """MindSpeed feature arguments for the model and layout: with context parallelism ``cp > 1``,
    ``context_parallel_size`` and :data:`MINDSPEED_CP_ARGS` (the engine passes them to
    ``mindspeed.megatron_adaptor.repatch`` before megatron's parallel state is initialised: MindSpeed's
    ``ContextParallelFeature`` registers its CP attention, its ``initialize_model_parallel`` wrapper
    and its RoPE slicing only when ``context_parallel_size > 1`` at patch time, and MindSpeed imports
    with its defaults, CP 1); nothing without CP. MindSpeed reads its arguments from
    ``sys.argv`` when ``mindspeed.megatron_adaptor`` is first imported (``args_utils.get_mindspeed_args``)
    and ``mindspeed.megatron_adaptor.repatch(dict)`` re-applies its patches with changed ones. Its MLA
    feature (``--multi-head-latent-attention``) replaces megatron's ``MultiLatentAttention.__init__``
    (core_r0.16.0 / core_r0.17.0; a no-op in core_r0.18.0) with one whose YaRN RoPE takes the
    original context length from ``config.max_position_embeddings``, a field megatron-core's config
    does not have; the engine's own MLA adapter (model.py) makes that patch unnecessary, so it is
    left off."""
    if int(cp) > 1:
        return dict(context_parallel_size=int(cp), **MINDSPEED_CP_ARGS)
    return {}
