"""Per-device memory models of ``rlrecipes plan``: the bytes one device holds, per phase.

A train engine names the model that describes it in its capabilities
(``Capabilities.memory_model``, see :data:`TRAIN_MEMORY_MODELS`):

* ``"fsdp"`` (:func:`fsdp_train_memory`): the whole model per rank, fp32 master weights,
  gradients and Adam state sharded over DP (FSDP2), with the transient peaks of FSDP units; a
  model of at most ``Capabilities.small_model_bytes`` is replicated or kept gathered, the rule the
  engine applies;
* ``"pipeline"`` (:func:`pipeline_train_memory`): the worst pipeline stage, compute-dtype weights,
  an fp32 DDP gradient buffer and a distributed optimizer over DP; experts also split over TP
  when the engine declares ``expert_tensor_parallel``.

With ``actor.lora`` (only engines that declare ``Capabilities.lora`` pass ``plan``: the ``"fsdp"``
model) the base is frozen: gradients, Adam state and FSDP's unsharded gradients / reduce buffers
count the adapters only (:func:`lora_params`, from the tensors PEFT creates:
:func:`rlrecipes.models.lora_shapes.lora_shapes`), and :func:`ref_memory` is nothing (the reference
policy is the actor with its adapters off).

:func:`rollout_memory` gives a rollout device's weights and the KV cache left in its budget,
:func:`kv_needed` the KV cache a rollout rank's rows need. :func:`rlrecipes.plan.build.build_plan`
compares them with the device.

Sequence parallelism (``layout.sp``): both train models count the activations, the layer in flight
and the logits for the tokens one SP / CP rank holds (:mod:`.long_context`), and shard what DP
shards over DP x SP (FSDP2 over the ``dp x sp`` ranks; megatron's distributed optimizer over DP x CP).
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Callable

from .. import device as devmod
from ..engines.base import Capabilities
from ..models import ModelDims
from ..models.lora_shapes import lora_shapes
from ..models.sharding import layer_of
from ..recipe import Recipe
from ..core.parallel import ParallelLayout
from .vision import vision_activation_bytes
from .long_context import (kv_token_bytes, layer_bytes, local_attention_bytes, logits_bytes, longest_sample,
                           mask_bytes, packed_tokens, padded_row, rank_tokens)

GiB = 1024 ** 3
DTYPE_BYTES = 2  # weights and activations in bf16 on accelerators


@dataclass
class Memory:
    """Per-device memory of one phase, in bytes."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    transient: float = 0.0
    """Short-lived peaks on top of the rest: FSDP-gathered units and their gradients/reduce buffers,
    optimizer-step temporaries (whichever phase peaks higher)."""
    kv_cache: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient + self.kv_cache

    def gib(self) -> dict[str, float]:
        d = {k: round(v / GiB, 2) for k, v in asdict(self).items()}
        d["total"] = round(self.total / GiB, 2)
        return d


@dataclass(frozen=True)
class LoraParams:
    """The adapter parameters of a LoRA actor, by the FSDP unit that holds them."""

    total: int = 0
    max_layer: int = 0
    """The most adapter parameters in one decoder layer (a unit in flight)."""
    outside: int = 0
    """Adapters outside the decoder layers (``lm_head`` / ``embed_tokens`` targets)."""


def lora_params(dims: ModelDims, recipe: Recipe) -> LoraParams | None:
    """``None`` without LoRA; else the adapters PEFT creates for ``actor.lora`` (none counted when
    PEFT would refuse the targets: ``build_plan`` reports that as a violation)."""
    lora = recipe.actor.lora
    if not lora.enabled:
        return None
    return _lora_params(dims, lora.rank, tuple(lora.target_modules), lora.dropout)


@functools.lru_cache(maxsize=64)  # plan's nearest-node search plans the same recipe many times
def _lora_params(dims: ModelDims, rank: int, targets: tuple[str, ...], dropout: float) -> LoraParams:
    try:
        shapes = lora_shapes(dims, SimpleNamespace(rank=rank, target_modules=targets, dropout=dropout))
    except ValueError:
        return LoraParams()
    per_layer: dict[int, int] = {}
    outside = 0
    for name, shape in shapes:
        n = 1
        for s in shape:
            n *= s
        layer = layer_of(name)
        if layer is None:
            outside += n
        else:
            per_layer[layer] = per_layer.get(layer, 0) + n
    return LoraParams(total=sum(per_layer.values()) + outside, max_layer=max(per_layer.values(), default=0),
                      outside=outside)


def even_split(layers: int, pp: int) -> list[int]:
    """``layers`` over ``pp`` stages, the first stages one longer when it does not divide."""
    base, extra = divmod(layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


def stage_params(dims: ModelDims, pp_layers: list[int]) -> list[tuple[float, float]]:
    """(non-expert, expert) parameters held by each pipeline stage (embedding first, head last)."""
    out, start = [], 0
    for s, n in enumerate(pp_layers):
        ne = e = 0.0
        for layer in range(start, start + n):
            a, b = dims.layer_params(layer)
            ne += a
            e += b
        if s == 0:
            ne += dims.vocab_size * dims.hidden_size
        if s == len(pp_layers) - 1:
            ne += dims.hidden_size + (0 if dims.tie_embeddings else dims.vocab_size * dims.hidden_size)
        out.append((ne, e))
        start += n
    return out


def micro_batch_tokens(recipe: Recipe) -> int:
    """Tokens in one micro-batch of an engine that packs: the token budget, but at least one whole
    sample (a longer sample gets a micro-batch of its own); without a budget, micro_batch padded rows."""
    return packed_tokens(recipe)


def norm_upcast_bytes(dims: ModelDims, tokens: float, c: int, tp: int, hidden_split: bool) -> float:
    """What one decoder layer's two RMSNorms save beyond the compute-dtype input :func:`layer_bytes`
    counts for them, in the megatron engine: its norm keeps an fp32 weight (``engines/megatron/model.py``
    ``RMSNorm``), so with a bf16 / fp16 input torch's ``rms_norm`` cannot take its fused kernel (the
    dtypes differ) and runs its composite, which saves 8 bytes per hidden element (an fp32 copy of the
    input and the normalised compute-dtype tensor; measured on CPU with torch 2.13's composite, the
    path CUDA takes for mixed dtypes too): ``8 - c`` more per norm. Nothing for an fp32 model."""
    if c >= 4:
        return 0.0
    return 2 * tokens * dims.hidden_size / (tp if hidden_split else 1) * (8 - c)


def pipeline_logits_per_element(c: int, sp: int, response_share: float) -> float:
    """Bytes per ``[token, vocab / tp]`` element the megatron engine's head and log-probs hold at their
    peak, the start of backward, while every layer's activations are still saved: the logits' fp32
    copy (``logits.float()``, kept by the response ``gather`` for its backward), the fp32 response
    slice (``response_share`` of the columns, kept by ``logsumexp``) and its gradient, the gather's
    fp32 gradient over every column and its compute-dtype cast (``c``; none for an fp32 model, whose
    ``.float()`` is the logits themselves): 14 bytes at bf16 with half the columns a response
    (measured on CPU with the engine's own ``_logprobs``, one micro-batch of one 512 + 512 row).
    Under context parallelism (``sp > 1``) the engine takes every local column's log-prob without
    the gather: the fp32 copy, its gradient and the cast, ``c + 8`` (the count before; not measured)."""
    cast = c if c < 4 else 0
    return cast + 8 if sp > 1 else cast + 8 + 8 * response_share


def pipeline_train_memory(dims: ModelDims, role: ParallelLayout, recipe: Recipe, dp: int, caps: Capabilities) -> Memory:
    """The worst pipeline stage of a megatron-style engine: compute-dtype weights, an fp32 DDP
    gradient buffer, fp32 master + Adam over DP x CP (distributed optimizer), and activations.

    A micro-batch is ``trainer.micro_batch`` rows padded to the longest sample (megatron packs
    nothing), rounded up to megatron's multiple (:func:`~.long_context.padded_row`); a CP rank holds
    ``1 / sp`` of every row, a TP rank ``1 / tp`` of its hidden states (sequence parallelism).
    Under 1F1B stage ``s`` of ``pp`` keeps ``pp - s`` micro-batches in flight: with recomputation
    each layer's input per micro-batch (``activations``), and in ``transient`` the one layer rebuilt
    in backward with its attention; without, every layer's activations (with the fp32 copies the
    engine's fp32-weight norms save, :func:`norm_upcast_bytes`). megatron's local attention
    (``sp = 1``) holds ``[rows, heads / tp, T, T]`` scores, and saves for backward the fp32 softmax
    and its compute-dtype copy (``attention_softmax_in_fp32``, megatron's default); with context
    parallelism the fused attention it needs holds none. The last stage adds the logits at the start
    of backward (:func:`pipeline_logits_per_element`). Checked against one H200 (megatron-core 0.19.2,
    Qwen2.5-1.5B shape, 8 rows of 512 + 512, no recompute): 82.6 GiB measured, see docs/planner.md."""
    pp_layers = role.pp_layers or even_split(dims.num_layers, role.pp)
    if len(pp_layers) != role.pp or sum(pp_layers) != dims.num_layers:
        pp_layers = even_split(dims.num_layers, role.pp)
    worst = Memory()
    c = devmod.compute_bytes(recipe.resources.device, recipe.model.dtype)
    rows, sp, tp = recipe.trainer.micro_batch, role.sp, role.tp
    T = padded_row(longest_sample(recipe), sp, tp)
    tokens = rows * T / sp  # this CP rank's tokens of the micro-batch
    hidden_split = tp > 1  # megatron's sequence parallelism whenever TP > 1
    kept = tokens * c * dims.hidden_size / (tp if hidden_split else 1)  # one layer's input
    full = layer_bytes(dims, tokens, c, tp, hidden_split) + norm_upcast_bytes(dims, tokens, c, tp, hidden_split)
    attention = 0.0 if sp > 1 else local_attention_bytes(rows, dims.num_heads / tp, T, c)
    # saved without recompute: megatron's local attention keeps the fp32 softmax for its backward and
    # the compute-dtype copy for the probs x V matmul (one fp32 tensor for an fp32 model)
    probs = 0.0 if sp > 1 else rows * dims.num_heads / tp * float(T) * T * (c + 4 if c < 4 else 4)
    response = min(T, recipe.rollout.max_response_len)  # the response columns the log-probs are taken at
    samples = recipe.trainer.mini_batch * recipe.trainer.n_samples_per_prompt / max(1, dp)
    micro_batches = max(1, math.ceil(samples / rows))
    shard = dp * sp  # megatron's distributed optimizer and gradient reduce run over DP x CP
    etp = role.tp if caps.expert_tensor_parallel else 1  # experts split over TP as well
    for s, (ne, e) in enumerate(stage_params(dims, pp_layers)):
        params = ne / role.tp + e / (role.ep * etp)
        expert_dp = max(1, shard * role.tp // (role.ep * etp))
        m = Memory()
        m.weights = params * DTYPE_BYTES
        m.grads = params * 4  # the DDP gradient buffer in fp32 (grad_reduce_in_fp32, as megatron engines set)
        if not recipe.actor.offload_optimizer:
            # fp32 master + Adam m, v, sharded over DP x CP (distributed optimizer)
            m.optimizer = 12 * (ne / role.tp / shard + e / (role.ep * etp) / expert_dp)
        layers = pp_layers[s]
        in_flight = min(role.pp - s, micro_batches)
        if recipe.actor.recompute:
            m.activations = kept * layers * in_flight
            m.transient = full + attention
        else:
            m.activations = (full + probs) * layers * in_flight
            m.transient = attention
        if s == len(pp_layers) - 1:
            m.activations += logits_bytes(dims, tokens, tp, pipeline_logits_per_element(c, sp, response / T))
        if m.total > worst.total:
            worst = m
    return worst


def fsdp_train_memory(dims: ModelDims, role: ParallelLayout, recipe: Recipe, dp: int, caps: Capabilities) -> Memory:
    """Per-device memory of an FSDP2 engine (HF model, DTensor TP/EP, FSDP2 over DP), steady state.

    FSDP2 keeps fp32 master weights, fp32 gradients and Adam's two moments sharded over DP (experts
    over the ranks that share an expert shard). On top, for the worst phase of a step:

    * backward: saved activations and the logits, beside the FSDP unit in flight (gathered in the
      compute dtype, its unsharded gradient and the reduce-scatter input); a tied embedding stays
      gathered in the root unit through backward and reduce-scatters at its very end;
    * optimizer step: one fp32 temporary per parameter (the foreach ``sqrt`` of the second moment).

    Activations and logits count the tokens of this rank: a micro-batch holds the token budget but
    at least one whole sample, and with ``layout.sp`` (Ulysses) a rank holds ``1 / sp`` of every row;
    FSDP2 then shards over the DP x SP ranks. Without SP, the attention mask of rows that pack several
    samples (a boolean ``[rows, 1, T, T]``, and SDPA's additive bias in the compute dtype that it makes
    of it for a layer at a time) sits beside the backward phases in ``transient``; under SP every
    sample is a row of its own and there is no mask.

    ``activations`` holds the saved activations and logits, ``transient`` the rest of the worst
    phase. A small model (at most ``caps.small_model_bytes`` of fp32 parameters) is replicated over
    DP in full precision, and kept gathered through a call under FSDP: the same rule the engine
    applies. Checked against the native engine's measurement by ``benchmarks/engine_memory.py``.

    LoRA (``actor.lora``): the engine builds the whole model in its master dtype (fp32) and freezes
    the base, so ``weights`` are the fp32 base plus adapters, sharded over DP like before; gradients,
    Adam state, the unsharded gradients and reduce-scatter inputs of a unit in flight and the
    optimizer temporary are the adapters' only; a frozen unit in flight is its gathered weights
    (twice over while FSDP2 copies the all-gather output out), and a frozen tied embedding never
    reduce-scatters, so its gathering at the start of forward is the peak of a large-vocabulary
    model. Activations are unchanged: every adapted
    Linear still saves its input (now for ``lora_A``'s gradient) and back-propagation still runs
    through every layer to reach the first adapters.
    """
    c = devmod.compute_bytes(recipe.resources.device, recipe.model.dtype)
    tp, ep = role.tp, role.ep
    shard = dp * role.sp  # FSDP2 / replication over the DP x SP ranks
    expert_dp = max(1, shard * tp // ep)
    embed = dims.vocab_size * dims.hidden_size / tp
    per_layer = [dims.layer_params(i) for i in range(dims.num_layers)]  # (non-expert, expert)
    layer_ne = max(a for a, _ in per_layer) / tp
    layer_e = max(b for _, b in per_layer) / ep
    vision = dims.vision_params()  # a VL model's tower and merger: replicated over TP, sharded over DP
    ne = sum(a for a, _ in per_layer) / tp + embed * (1 if dims.tie_embeddings else 2) + dims.hidden_size + vision
    e = sum(b for _, b in per_layer) / ep
    lora = lora_params(dims, recipe)
    adapters = lora.total if lora else 0  # (LoRA is refused at TP/EP > 1: adapters are whole per DP rank)
    param_bytes = 4 * (sum(a + b for a, b in per_layer) + dims.vocab_size * dims.hidden_size
                       * (1 if dims.tie_embeddings else 2) + dims.hidden_size + adapters + vision)
    small = param_bytes <= caps.small_model_bytes  # 0: nothing is small
    replicated = small and c == 4 and shard > 1
    local = ne + e if replicated else ne / shard + e / expert_dp  # this rank's part of every parameter
    trained = local if lora is None else (adapters if replicated else adapters / shard)
    m = Memory(weights=4 * (local + (0 if lora is None else trained)), grads=4 * trained)
    if not recipe.actor.offload_optimizer:
        m.optimizer = 8 * trained
    whole = micro_batch_tokens(recipe)
    tokens = rank_tokens(whole, role.sp)  # this SP rank's part of every row
    # per layer without recompute: ~10 hidden-sized tensors per token (replicated over TP: no
    # sequence parallelism) and ~4 of the MLP width (split over TP); with recompute, each layer's
    # input, plus one layer rebuilt during its backward
    full_layer = layer_bytes(dims, tokens, c, tp, hidden_split=False)
    kept = tokens * c * dims.hidden_size
    act = (kept * dims.num_layers + full_layer) if recipe.actor.recompute else full_layer * dims.num_layers
    # the head runs from the hidden states a chunk of tokens at a time (engines/native/head.py): one
    # chunk's compute-dtype logits, their fp32 softmax and its gradient at a time, recomputed in
    # backward. Not where head.unsupported refuses: an untied vocab-parallel head that is an FSDP2
    # unit of its own (TP x FSDP) writes its [tokens, vocab / tp] logits whole, as the HF head does
    fsdp_head = tp > 1 and not dims.tie_embeddings and (shard > 1 and not replicated)
    if fsdp_head or not caps.head_chunk_tokens:
        logits = logits_bytes(dims, tokens, tp, c + 4)
    else:
        logits = logits_bytes(dims, min(tokens, caps.head_chunk_tokens), tp, c + 8) + tokens * dims.hidden_size * c
    m.activations = act + logits + vision_activation_bytes(dims, recipe)  # plan/vision.py (0: text only)
    # the attention mask over rows that pack several samples, beside the backward phases; under SP the
    # engine gives every sample a row of its own and needs none (batching's one_per_row)
    mask = 0.0 if role.sp > 1 else mask_bytes(whole, min(longest_sample(recipe), whole), c)
    # FSDP units: gathered params (c), unsharded grad (c), the fp32 reduce-scatter input (4; on CPU
    # gloo reduces through one more buffer of that size, measured); two decoder layers in flight.
    # Untied, the embedding and the head are units of their own, gathered only around their use.
    # Tied, they sit in the root unit: gathered from forward through backward with the head's
    # gradient, and at the end of backward the embedding's own gradient joins before the root
    # reduce-scatters; the activations are gone by then.
    reduce = 4 * (1 if devmod.is_accelerator(recipe.resources.device) else 2)
    unit = 2 * c + reduce
    after: list[float] = []
    if lora is None:
        phases = [2 * (layer_ne + layer_e) * unit]  # backward, beside the activations
        if dims.tie_embeddings:
            phases += [embed * 2 * c]
            after = [embed * (3 * c + reduce) - m.activations]  # activations (and the mask) gone
        else:
            phases += [embed * unit]
        in_flight_all = (ne + e) * unit
    else:
        # frozen units hold gathered weights only (the adapters' gradients and reduce buffers ride
        # along), but a unit being gathered holds two copies for a moment: FSDP2's all-gather output
        # and the unsharded parameters it is copied into. Backward: the unit computing and the next
        # one gathering. The embedding's unit (tied: the root, with the head) gathers at the start
        # of forward, while the previous step's activation memory is still held by the allocator
        # (measured: benchmarks/engine_memory.py, dp4-lora)
        phases = [3 * (layer_ne + layer_e) * c + 2 * lora.max_layer * unit, embed * 2 * c + lora.outside * unit]
        in_flight_all = (ne + e) * c + adapters * unit
    if small:  # FSDP, every unit kept gathered (with its unsharded gradient) through the call
        phases.append(in_flight_all)
    if replicated:  # no units in flight: the gradients' flat all-reduce buffer or the optimizer temporary
        phases, after = [0.0], []
    phases = [p + mask for p in phases] + after
    phases.append(4 * trained - m.activations)  # optimizer step: the foreach temporary, activations gone
    m.transient = max(0.0, *phases)
    return m


def ref_memory(dims: ModelDims, role: ParallelLayout, recipe: Recipe, dp: int, caps: Capabilities) -> Memory:
    """The reference model's weights on a train device, resident beside the actor (colocated or in
    the train group). ``Memory()`` with LoRA: the reference policy is the actor's base with the
    adapters off, no model of its own. Its forward pass runs outside the train step, so only the
    weights add to the step's peak.

    ``fsdp``: the native engine builds the reference in the compute dtype (no master copy), FSDP2
    over DP unless the model is small (then whole per DP rank); ``pipeline``: the worst stage's
    compute-dtype weights."""
    if recipe.actor.lora.enabled:
        return Memory()
    if caps.memory_model == "pipeline":
        pp_layers = role.pp_layers or even_split(dims.num_layers, role.pp)
        if len(pp_layers) != role.pp or sum(pp_layers) != dims.num_layers:
            pp_layers = even_split(dims.num_layers, role.pp)
        etp = role.tp if caps.expert_tensor_parallel else 1
        return Memory(weights=max(ne / role.tp + e / (role.ep * etp) for ne, e in stage_params(dims, pp_layers))
                      * DTYPE_BYTES)
    c = devmod.compute_bytes(recipe.resources.device, recipe.model.dtype)
    experts = dims.expert_params()
    ne, e = (dims.total_params() - experts) / role.tp, experts / role.ep
    shard = dp * role.sp  # FSDP2 over DP x SP
    sharded = shard > 1 and not dims.total_params() * c <= caps.small_model_bytes
    return Memory(weights=c * ((ne / shard + e / max(1, shard * role.tp // role.ep)) if sharded else ne + e))


TRAIN_MEMORY_MODELS: dict[str, Callable[[ModelDims, ParallelLayout, Recipe, int, Capabilities], Memory]] = {
    "fsdp": fsdp_train_memory,
    "pipeline": pipeline_train_memory,
}
"""``Capabilities.memory_model`` -> the model of a train device of that engine."""


def train_memory(dims: ModelDims, role: ParallelLayout, recipe: Recipe, dp: int, caps: Capabilities) -> Memory:
    """A train device's memory under the model its engine declares (``caps.memory_model``)."""
    model = TRAIN_MEMORY_MODELS.get(caps.memory_model)
    if model is None:
        raise ValueError(f"engine {caps.name!r} declares memory_model={caps.memory_model!r}; plan has "
                         f"{', '.join(map(repr, TRAIN_MEMORY_MODELS))}")
    return model(dims, role, recipe, dp, caps)


def node_independent_bytes(train: Memory, ref: Memory, caps: Capabilities) -> float:
    """A lower bound of a train device's memory on any node count (more DP shards only the rest):
    ``pipeline``: the stage's weights, gradient buffer, activations, the layer in flight and the
    reference weights (only the distributed optimizer shards over DP); ``fsdp``: the activations
    (weights, gradients, Adam state and the reference shard over DP)."""
    if caps.memory_model == "pipeline":
        return train.weights + train.grads + train.activations + train.transient + ref.total
    return train.activations


def rollout_params_per_device(dims: ModelDims, role: ParallelLayout, expert_tp: bool = False) -> float:
    """Parameters one rollout device holds: the dense part over TP, the experts over EP; at EP 1,
    over TP too where the engine splits them so (``Capabilities.expert_tensor_parallel``: vLLM's
    fused-MoE layers split every expert's width over the TP ranks; the resharder, and the native
    engine, split experts over EP only)."""
    experts = dims.expert_params()
    over = role.ep if role.ep > 1 else (role.tp if expert_tp else 1)
    return (dims.total_params() - experts) / role.tp + experts / over


def rollout_memory(dims: ModelDims, role: ParallelLayout, recipe: Recipe, device_bytes: float,
                   expert_tp: bool = False) -> Memory:
    """A rollout device's weights (TP / EP shards) and the KV cache its memory budget leaves."""
    m = Memory()
    m.weights = rollout_params_per_device(dims, role, expert_tp) * DTYPE_BYTES
    budget = device_bytes * recipe.rollout.inference.gpu_memory_utilization
    m.kv_cache = max(0.0, budget - m.weights)
    return m


def kv_needed(dims: ModelDims, role: ParallelLayout, recipe: Recipe, rows_per_instance: float) -> float:
    """KV cache bytes a device of one rollout rank (an attention-TP group scheduling its own rows)
    needs for its share of a step's rows at the longest sample (at most max_num_seqs at once)."""
    seqs = min(recipe.rollout.inference.max_num_seqs, max(1.0, rows_per_instance))
    return seqs * longest_sample(recipe) * kv_token_bytes(dims, role.tp)


__all__ = ["DTYPE_BYTES", "GiB", "LoraParams", "Memory", "TRAIN_MEMORY_MODELS", "even_split", "fsdp_train_memory",
           "kv_needed", "lora_params", "micro_batch_tokens", "node_independent_bytes", "norm_upcast_bytes",
           "pipeline_logits_per_element", "pipeline_train_memory",
           "ref_memory", "rollout_memory", "stage_params", "train_memory"]
