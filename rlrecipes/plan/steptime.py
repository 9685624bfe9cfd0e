"""How long one step takes, stage by stage, before anything runs: ``plan``'s step-time model.

Each stage is priced on one row of the hardware table (:mod:`rlrecipes.hardware`) with a few named
efficiency factors (:class:`Factors`), the same for every recipe:

- **rollout**: prefill bound by compute; decode, one iteration per generated position up to the
  longest response, bound by memory bandwidth on the weights a device reads (MoE: the experts the
  iteration's tokens touch) plus its rows' KV cache, or by compute at high concurrency, plus the
  latency of the per-layer collectives (TP all-reduce, EP dispatch and combine), or by the host for
  an eager engine;
- **ref / old / values**: one forward over every sample; **update / critic_update**: forward +
  backward (+ a forward again with recompute), per epoch; both with the pipeline bubble, the TP and
  EP traffic of their layout, and the data-parallel gradient sync;
- **reshard**: the bytes the resharder's own plan moves per device, over the link its layouts span;
  colocated, the optimizer state swapped to the host and back;
- **dock hand-offs**: each stage's round trip to the TransferDock and the columns it carries.

Colocated, the stages run one after another; disaggregated with ``max_staleness >= 1`` the rollout
of the next step overlaps the training of this one, so the step is the longer of the two.

The factors and their sources are in :mod:`rlrecipes.plan.factors`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from ..core.parallel import ParallelLayout
from ..engines.registry import capabilities
from ..hardware import Hardware, get_hardware
from ..recipe import Recipe
from ..recipe.roles import roles_of
from .factors import RECORDED, RESULTS, Factor, Factors, layout_key, load_factors, measured_from_results
from .memory import DTYPE_BYTES

#: the mean lengths a recipe without expected_*_tokens is predicted with (schema docstrings say why)
PROMPT_FRACTION, RESPONSE_FRACTION = 0.1, 0.5


@dataclass
class StagePrediction:
    name: str
    seconds: float
    bound: str
    """What limits it: compute, memory, host, link (a collective or the reshard), latency or dock."""
    detail: str = ""


@dataclass
class StepPrediction:
    hardware: str
    stages: list[StagePrediction]
    step_s: float
    tokens: float
    cards: float
    tps_per_card: float
    prompt_tokens: float
    response_tokens: float
    overlap: bool = False
    """Disaggregated with max_staleness >= 1: rollout and training overlap (step = the longer)."""
    assumptions: list[str] = field(default_factory=list)
    factors: Optional[Factors] = None

    def to_json(self) -> dict:
        return {"hardware": self.hardware, "step_s": round(self.step_s, 3),
                "tps_per_card": round(self.tps_per_card, 2), "tokens": round(self.tokens),
                "cards": self.cards, "prompt_tokens": round(self.prompt_tokens, 1),
                "response_tokens": round(self.response_tokens, 1), "overlap": self.overlap,
                "stages": {s.name: {"s": round(s.seconds, 4), "bound": s.bound, "detail": s.detail}
                           for s in self.stages},
                "assumptions": self.assumptions,
                "factors": self.factors.to_json() if self.factors else {}}


# ----------------------------------------------------------------------------------- the model
@dataclass
class _Ctx:
    recipe: Recipe
    hw: Hardware
    f: Factors
    dims: object
    P: float
    L: float
    Lmax: int
    samples: int
    image_flops: float = 0.0
    """The vision tower's forward FLOPs over one sample's image (0: text only; ``plan/vision.py``)."""

    @property
    def kind(self) -> str:
        return "cpu" if self.hw.device == "cpu" else "accelerator"

    def link(self, span: int) -> float:
        """Bandwidth of a group of ``span`` devices: inside a node, or across nodes."""
        bw = self.hw.intra_node_bytes_s if span <= self.hw.scale_up_devices else self.hw.inter_node_bytes_s
        return bw * self.f.comm_bandwidth.value

    def mfu(self, engine: str) -> float:
        """The engine's measured MFU (an engine never measured: the lowest measured one's), scaled
        for a MoE model."""
        f = self.f.mfu.get(engine) or min(self.f.mfu.values(), key=lambda x: x.value)
        return f.value * (self.f.moe_mfu_scale.value if self.dims.is_moe else 1.0)


def _matmul_params(dims) -> float:
    """Parameters one token multiplies by (the input embedding is a lookup, the head a matmul)."""
    embed = dims.vocab_size * dims.hidden_size
    return dims.active_params() - (0 if dims.tie_embeddings else embed)


def _attn_flops_per_token(dims, context: float) -> float:
    """Forward attention FLOPs of one token attending ``context`` earlier positions (QK^T and AV)."""
    if dims.is_mla:
        width = dims.num_heads * (dims.qk_nope_head_dim + dims.qk_rope_head_dim + dims.v_head_dim)
    else:
        width = 2 * dims.num_heads * dims.head_dim
    return 2 * dims.num_layers * width * context


def _forward_flops(c: _Ctx, tokens: float, seq: float) -> float:
    return tokens * (2 * _matmul_params(c.dims) + _attn_flops_per_token(c.dims, seq / 2))


def _eager(c: _Ctx, kind: str, layers: float, passes: float, engine: str = "") -> float:
    """Host seconds of ``passes`` eager passes over ``layers`` layers (0 where the host never bounds).
    The most specific measurement wins: this engine on this model family, the family, the engine,
    the pass; where several fit less well, the slowest of them."""
    base, fam = f"{c.kind}/{kind}", c.dims.family
    for key in (f"{base}/{engine}/{fam}", f"{base}/{fam}", f"{base}/{engine}", base):
        if key in c.f.eager_layer_s:
            break
    else:
        own = [k for k in c.f.eager_layer_s if k.startswith(base + "/") and k.endswith("/" + fam)] or \
              [k for k in c.f.eager_layer_s if k.startswith(base + "/")]
        if not own:
            return 0.0
        key = max(own, key=lambda k: c.f.eager_layer_s[k].value)
    return _passes_s(c, key, layers, passes)


def _passes_s(c: _Ctx, key: str, layers: float, passes: float) -> float:
    """``passes`` passes over ``layers`` layers at the measured per-layer and fixed cost of ``key``."""
    return passes * (layers * c.f.eager_layer_s[key].value + c.f.eager_fixed_s.get(key, Factor(0.0, "")).value)


def _layout_tag(role: ParallelLayout, dims) -> str:
    """How a role splits its model, as the layout measurements name it: ``tp2``, ``tp2ep2``, ``dp2``
    (data-parallel only); "" for one device."""
    parts = [f"{k}{v}" for k, v in (("tp", role.tp), ("pp", role.pp), ("sp", role.sp),
                                     ("ep", role.ep if dims.is_moe else 1)) if v > 1]
    return "".join(parts) or (f"dp{role.dp}" if (role.dp or 1) > 1 else "")


def _eager_at_layout(c: _Ctx, kind: str, role: ParallelLayout, engine: str, layers: float,
                     passes: float, rollout: bool = False) -> Optional[float]:
    """Seconds of ``passes`` eager passes measured at the role's own layout (``layout_pass_cost.py``:
    the native engines over gloo, their collectives included), or None where none was. A rollout's
    data-parallel ranks decode alone: only its model-parallel layouts have a measurement of their own."""
    tag = _layout_tag(role, c.dims)
    if not tag or (rollout and tag.startswith("dp")):
        return None
    key = layout_key(kind, f"{engine}/{c.dims.family}/{tag}")  # only the engine measured at it has one
    if c.kind != "cpu" or key not in c.f.eager_layer_s:
        return None
    return _passes_s(c, key, layers, passes)


def _train_pass(c: _Ctx, name: str, role: ParallelLayout, engine: str, fwd_units: float, eager_kind: str,
                passes_per_step: int = 1, comm_units: float = 1, flushes: int = 1,
                vision_units: float = 1) -> StagePrediction:
    """A forward (``fwd_units`` = 1) or a training pass (3 forward-equivalents of FLOPs, 2 with
    LoRA's frozen base, +1 with recompute) over every sample. ``comm_units``: how many times the
    pass moves a forward's TP / EP traffic (a backward moves it once more, a recompute once more).
    ``flushes``: pipeline flushes per pass (one per optimizer step). ``vision_units``: the vision
    tower's forward-equivalents (a frozen tower only runs forward); the tower is replicated over TP,
    so each device of a TP group runs it for the group's samples (under PP, the first stage: the
    others wait for it)."""
    r, dims = c.recipe, c.dims
    tokens = c.samples * (c.P + c.L)
    flops = _forward_flops(c, tokens, c.P + c.L) * fwd_units * passes_per_step
    flops += c.samples / max(1, role.dp or 1) * c.image_flops * vision_units * passes_per_step * role.world
    compute = flops / role.world / (c.hw.bf16_flops * c.mfu(engine))
    dp = max(1, role.dp or 1)
    budget = r.trainer.max_tokens_per_micro_batch
    per_rank = tokens / dp
    micro = max(1.0, math.ceil(per_rank / budget) if budget else math.ceil(c.samples / dp / r.trainer.micro_batch))
    per_flush = max(1.0, micro / flushes)  # the pipeline drains at every optimizer step
    bubble = (per_flush + role.pp - 1) / per_flush if role.pp > 1 else 1.0
    # per device: TP all-reduces (2 per layer forward), EP dispatch + combine (per MoE layer)
    layers_here = dims.num_layers / role.pp
    act = per_rank / role.sp * dims.hidden_size * DTYPE_BYTES
    comm = 0.0
    if role.tp > 1:
        comm += 2 * layers_here * act * 2 * (role.tp - 1) / role.tp / c.link(role.tp)
    if dims.is_moe and role.ep > 1:
        moe_here = dims.num_moe_layers() / role.pp
        comm += 2 * moe_here * act / role.tp * dims.experts_per_token * (role.ep - 1) / role.ep / c.link(role.tp * role.ep)
    # and their latency: each collective of a micro-batch waits log2(group) small-message steps
    lat = 0.0
    if role.tp > 1:
        lat += 2 * layers_here * math.log2(role.tp)
    if dims.is_moe and role.ep > 1:
        lat += 2 * dims.num_moe_layers() / role.pp * math.log2(role.ep)
    comm += lat * c.hw.collective_latency_s * micro
    comm *= comm_units * passes_per_step
    if capabilities(engine).memory_model == "fsdp" and dp > 1:  # FSDP2: a unit per layer (+ the root) all-gathers for every
        # micro-batch's forward, again for its backward, and reduce-scatters its gradients
        units, per_unit = layers_here + 1, (1 if fwd_units == 1 else 3)
        shard = dims.total_params() / role.tp / role.pp * DTYPE_BYTES
        comm += passes_per_step * micro * (units * per_unit * c.hw.collective_latency_s * math.log2(dp)
                                           + per_unit * shard * (dp - 1) / dp / c.link(role.world))
    host = _eager_at_layout(c, eager_kind, role, engine, layers_here, micro * passes_per_step)
    if host is not None:
        comm = 0.0  # measured at this layout: its collectives are in the pass's seconds
    else:
        host = _eager(c, eager_kind, layers_here, micro * passes_per_step)
    seconds = max(compute * bubble, host) + comm  # collectives wait: not overlapped
    bound = "link" if comm > max(compute * bubble, host) else ("host" if host > compute * bubble else "compute")
    detail = (f"{flops / 1e15:.3g} PFLOP over {role.world} devices at MFU {c.mfu(engine):.3f}"
              + (f", pipeline bubble x{bubble:.2f} ({per_flush:g} micro-batches per flush, PP{role.pp})"
                 if role.pp > 1 else "")
              + (f", TP/EP traffic {comm:.3g} s" if comm else "") + (f", host {host:.3g} s" if host else ""))
    return StagePrediction(name, seconds, bound, detail)


def _grad_sync(c: _Ctx, role: ParallelLayout, engine: str, mini_batches: int) -> float:
    """Data-parallel gradient reduce-scatter + parameter all-gather (a distributed optimizer), once
    per optimizer step. None for an ``fsdp`` engine (its per-micro-batch gathers and scatters are
    in the pass) or LoRA (the adapters' are negligible)."""
    dp = role.dp or 1
    caps = capabilities(engine)
    if dp <= 1 or caps.memory_model == "fsdp" or c.recipe.actor.lora.enabled:
        return 0.0
    dims = c.dims
    etp = role.tp if caps.expert_tensor_parallel else 1  # as the memory model shards them
    per_device = ((dims.total_params() - dims.expert_params()) / (role.tp * role.pp)
                  + dims.expert_params() / (role.pp * max(role.ep, 1) * etp))
    moved = 2 * per_device * DTYPE_BYTES * (dp - 1) / dp
    return mini_batches * moved / c.link(role.world)


def _rollout(c: _Ctx, role: ParallelLayout, engine: str, weights_per_device: float, kv_budget: float) -> StagePrediction:
    r, dims, hw = c.recipe, c.dims, c.hw
    groups = max(1, role.dp or 1)  # attention groups (TP x PP devices each) that schedule their own rows
    rows = c.samples / groups
    inf = r.rollout.inference
    kvb = dims.kv_bytes_per_token() / ((1 if dims.is_mla else min(role.tp, max(1, dims.num_kv_heads))) * role.pp)
    # paged KV: a row holds its prompt and what it generated so far, and frees it when done; a
    # row's mean final length (P + L) sits between its mean occupancy and the worst case (P + Lmax)
    by_kv = kv_budget / max(1.0, (c.P + c.L) * kvb) if kv_budget > 0 else rows
    conc = max(1.0, min(rows, inf.max_num_seqs, by_kv))
    iterations = max(c.Lmax, rows * c.L / conc)
    active = rows * c.L / iterations  # mean rows per iteration over the step (they finish unevenly)
    # weights one device reads per iteration: dense shard, and the experts its tokens touch
    over = role.ep if role.ep > 1 else (role.tp if capabilities(engine).expert_tensor_parallel else 1)
    expert_bytes = dims.expert_params() / over * DTYPE_BYTES if dims.is_moe else 0.0
    dense_bytes = max(0.0, weights_per_device - expert_bytes)
    if dims.is_moe:
        tokens_ep = active * max(1, role.ep // role.tp)  # rows of the attention groups that share the experts
        touched = 1 - (1 - dims.experts_per_token / dims.num_experts) ** tokens_ep
    else:
        touched = 0.0
    kv_read = active * (c.P + c.L / 2) * kvb
    mem = (dense_bytes + expert_bytes * touched + kv_read) / (hw.hbm_bytes_s * c.f.decode_bandwidth.value)
    flops = active * groups * 2 * _matmul_params(dims) / role.world
    comp = flops / (hw.bf16_flops * c.mfu(engine))
    # every layer's collectives, in sequence (over the pipeline stages too): 2 TP all-reduces per
    # layer, EP dispatch + combine per MoE layer; a collective over g devices takes log2(g) steps
    lat = hw.collective_latency_s * (2 * dims.num_layers * math.log2(role.tp)
                                      + (2 * dims.num_moe_layers() * math.log2(role.ep) if dims.is_moe else 0))
    eager = not capabilities(engine).decode_graphs or inf.enforce_eager or not inf.graph_mode
    host = _eager(c, "decode", dims.num_layers, 1, engine) if eager else 0.0
    at_layout = _eager_at_layout(c, "decode", role, engine, dims.num_layers, 1, rollout=True) if eager else None
    if at_layout is not None:
        host, lat = at_layout, 0.0  # measured at this layout: its collectives are in the iteration
    per_iter = max(mem, comp, host) + lat
    prefill_tok = rows * c.P * groups
    images = rows * c.image_flops * role.world  # each device runs the tower for its group's rows
    prefill = (_forward_flops(c, prefill_tok, c.P) + images) / role.world / (hw.bf16_flops * c.mfu(engine))
    waves = math.ceil(rows / conc)  # the prefill's forward at the layout (the train engine's, measured) or alone
    fwd = _eager_at_layout(c, "forward", role, engine, dims.num_layers, waves, rollout=True)
    prefill = max(prefill, fwd if fwd is not None else _eager(c, "forward", dims.num_layers, waves))
    seconds = prefill + iterations * per_iter
    bound = {mem: "memory", comp: "compute", host: "host"}[max(mem, comp, host)]
    if lat > max(mem, comp, host):
        bound = "latency"
    detail = (f"{iterations:.0f} decode iterations x {1000 * per_iter:.2f} ms ({active:.1f} rows of {rows:g} per "
              f"group at a time, {groups} groups; weights {weights_per_device / 2**30:.2f} GiB/device"
              + (f", experts touched {touched:.0%}" if dims.is_moe else "") + f", KV {kv_read / 2**30:.3f} GiB; "
              f"collectives {1000 * lat:.2f} ms) + prefill {prefill:.3g} s"
              + (f"; eager: host {1000 * host:.1f} ms per iteration" if host else ""))
    return StagePrediction("rollout", seconds, bound, detail)


def predict(recipe: Recipe, plan, factors: Optional[Factors] = None) -> StepPrediction:
    """The step of ``recipe`` as ``plan`` lays it out, on the recipe's hardware row. A card is the
    row's (``devices_per_card``): where ``resources.dies_per_card`` or ``device_memory_gb`` say
    otherwise, the prediction follows the row and says so."""
    f = factors or load_factors()
    hw = get_hardware(recipe.resources.hardware_name())
    dims = recipe.model.dims()
    r = recipe
    P = float(r.data.expected_prompt_tokens or PROMPT_FRACTION * r.data.max_prompt_length)
    Lmax = r.rollout.sampling.max_new_tokens
    L = float(min(Lmax, r.rollout.expected_response_tokens or RESPONSE_FRACTION * Lmax))
    assumptions = []
    if not r.data.expected_prompt_tokens:
        assumptions.append(f"mean prompt {P:g} tokens: {PROMPT_FRACTION:g} x data.max_prompt_length (set "
                           "data.expected_prompt_tokens)")
    if not r.rollout.expected_response_tokens:
        assumptions.append(f"mean response {L:g} tokens: {RESPONSE_FRACTION:g} x max_new_tokens (set "
                           "rollout.expected_response_tokens)")
    if r.algorithm.dynamic_sampling.enabled:
        assumptions.append("dynamic sampling: one generation round per step (extra rounds add rollout time)")
    if r.rollout.multi_turn.enabled:
        assumptions.append("multi-turn: tool calls and their observations take no time (the agent loop's tool "
                           "seconds are not modelled); every turn's tokens decode as one response")
    if r.rollout.pooled:
        assumptions.append("pooled rollout (partial / over-sampling): priced as a plain rollout of the step's "
                           "groups; the pool's carry-over is not modelled")
    if r.resources.dies_per_card != hw.devices_per_card:
        assumptions.append(f"a card of {hw.name} is {hw.devices_per_card} device(s) (the hardware table); the recipe's "
                           f"resources.dies_per_card={r.resources.dies_per_card} is not used for TPS/card")
    if hw.device != "cpu" and abs(r.resources.device_memory_gb - hw.hbm_gb) > 0.5:  # a smoke run's budget is its own
        assumptions.append(f"resources.device_memory_gb={r.resources.device_memory_gb:g} (the memory plan's) while "
                           f"{hw.name} has {hw.hbm_gb:g} GB per device")
    samples = plan.global_batch * plan.n_samples
    from .vision import image_tokens, vision_flops_per_image

    # an image is prompt tokens: at most the processor's cap, and no more than the mean prompt holds
    per_image = min(image_tokens(dims, r), P) if dims.has_vision else 0
    c = _Ctx(r, hw, f, dims, P, L, Lmax, samples, vision_flops_per_image(dims, r, per_image))
    if dims.has_vision:
        assumptions.append(f"images: one per sample of {per_image:g} image tokens (the processor's cap, "
                           f"{image_tokens(dims, r)}, or the mean prompt where that is less: it counts them); "
                           f"{c.image_flops / 1e9:.3g} GFLOP through the vision tower per image, in the rollout's "
                           "prefill and every train pass")
    roles = roles_of(r, strict=False)
    actor = plan.roles["actor"]
    rollout = plan.roles["rollout"]
    epochs = r.algorithm.ppo_epochs
    stages: list[StagePrediction] = [_rollout(c, rollout, plan.engines["rollout"],
                                              plan.rollout_memory.weights, plan.rollout_memory.kv_cache)]
    train_engine = plan.engines["actor"]
    if roles.ref:
        stages.append(_train_pass(c, "ref", plan.roles.get("ref", actor), train_engine, 1, "forward"))
    if roles.old_pass:
        stages.append(_train_pass(c, "old", actor, train_engine, 1, "forward"))
    if roles.critic:
        stages.append(_train_pass(c, "values", plan.roles.get("critic", actor), train_engine, 1, "forward"))
    # forward 1, backward 2 (activation and weight gradients); LoRA's frozen base skips its weight
    # gradients (the adapters' are negligible); recompute runs the forward again
    units = (2 if r.actor.lora.enabled else 3) + (1 if r.actor.recompute else 0)
    comm_units = 2 + (1 if r.actor.recompute else 0)
    flushes = roles.mini_batches
    vision_units = 1 if r.actor.freeze_vision_tower else 3 + (1 if r.actor.recompute else 0)
    upd = _train_pass(c, "update", actor, train_engine, units, "train", epochs, comm_units, flushes, vision_units)
    sync = _grad_sync(c, actor, train_engine, roles.mini_batches * epochs)
    upd.seconds += sync
    upd.detail += f", DP gradient sync {sync:.3g} s" if sync else ""
    stages.append(upd)
    if roles.critic:
        crit = _train_pass(c, "critic_update", plan.roles.get("critic", actor), train_engine, units, "train", epochs,
                           comm_units, flushes, vision_units)
        stages.append(crit)
    # reshard: the bytes the resharder's plan moves, over the link the two layouts span
    span = max(actor.model_parallel * max(1, actor.ep if dims.is_moe else 1), rollout.world // max(1, rollout.dp or 1))
    link = c.link(plan.world if plan.disaggregated else span)
    reshard = plan.reshard_bytes_per_device / link
    swap = 0.0
    if not plan.disaggregated and r.resharding.swap_optimizer and not r.actor.offload_optimizer:
        swap = 2 * plan.train_memory.optimizer / hw.host_bytes_s  # out before the rollout, back for the update
    stages.append(StagePrediction("reshard", reshard + swap, "link",
                                  f"{plan.reshard_bytes_per_device / 2**30:.2f} GiB per device ({plan.reshard_method}) at "
                                  f"{link / 1e9:.0f} GB/s" + (f"; optimizer swap to host and back {swap:.3g} s" if swap else "")))
    # dock hand-offs: a round trip per stage and the columns (token ids, a float per token per
    # log-prob column) each worker puts and takes
    columns = 8 + 4 * (1 + roles.ref + roles.old_pass + roles.critic)
    dock_bytes = samples * (P + L) * columns / plan.world
    trips = len(stages) + 2
    dock = trips * c.f.dock_round_trip_s.value + dock_bytes / (hw.inter_node_bytes_s * f.comm_bandwidth.value)
    stages.append(StagePrediction("dock", dock, "dock", f"{trips} hand-offs, {dock_bytes / 1e6:.2f} MB per worker"))
    overlap = plan.disaggregated and r.algorithm.max_staleness >= 1
    train = sum(s.seconds for s in stages if s.name != "rollout")
    step = max(stages[0].seconds, train) if overlap else stages[0].seconds + train
    tokens = samples * (P + L)
    cards = plan.world / hw.devices_per_card
    return StepPrediction(hw.name, stages, step, tokens, cards, tokens / step / cards, P, L, overlap, assumptions, f)


__all__ = ["RECORDED", "RESULTS", "Factor", "Factors", "StagePrediction", "StepPrediction", "load_factors",
           "measured_from_results", "predict"]
