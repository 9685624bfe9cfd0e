"""``build_plan(recipe, nodes)``: the plan of a recipe on N nodes, every rule checked at once.

It derives the DP size of every role from the world size, checks every layout rule
(:mod:`.checks`), estimates per-device memory (:mod:`.memory`: weights, gradients, optimizer
state, activations, rollout weights and KV cache) and the weight bytes each device receives when
the trained weights are resharded into the rollout layout (:mod:`.reshard`). Nothing here starts a
process, so an impossible layout fails in ``rlrecipes plan`` before anything is launched.
:func:`resolve` writes the plan's batch and node count back into the recipe that runs.

Scaling policy: the recipe pins a layout at ``resources.nodes``. On another node count the
TP/PP/EP sizes stay and DP scales; the global batch scales with the actor DP size so every DP
rank keeps its per-step batch (weak scaling), unless ``keep_batch=True`` (strong scaling).

Placement: ``colocated`` (default) puts every role on all ``world`` devices. ``disaggregated``
(``resources.placement``) gives the rollout the last ``resources.rollout_devices`` ranks and the
train roles (actor, ref, critic) the first ``world - rollout_devices``; each group's DP comes from
its own device count, and the rollout count stays fixed when the node count changes.
:func:`~.placement.placement_groups` gives the workflow the two groups' ranks and layouts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from ..engines.registry import BACKENDS, capabilities, engines_that
from ..core.parallel import ParallelLayout
from ..recipe import Recipe
from .checks import (NODE_INDEPENDENT_RULES, PlanError, Violation, capability_checks, engine_checks,
                     engine_layout_violations, layout_violations, model_checks, ranks_text, role_layouts,
                     rollout_devices_that_fit, rollout_inference, sequence_checks, where)
from .long_context import kv_check, sequence_summary
from .memory import DTYPE_BYTES, GiB, Memory, node_independent_bytes, ref_memory, rollout_memory, train_memory
from .agent import agent_checks
from .long_tail import pool_checks, smoke_fit
from .reshard import full_reshard, lora_reshard, lora_specs, reshard_bytes
from .steptime import StepPrediction, predict
from ..models.lora_shapes import lora_problems


MEMORY_RULE = "training memory fits the device"


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


@dataclass
class Plan:
    recipe: str
    nodes: int
    devices_per_node: int
    world: int
    device: str
    device_memory_gb: float
    roles: dict[str, ParallelLayout]
    global_batch: int
    mini_batch: int
    n_samples: int
    train_memory: Memory = field(default_factory=Memory)
    rollout_memory: Memory = field(default_factory=Memory)
    reshard_bytes_per_device: float = 0.0
    reshard_full_bytes: float = 0.0
    reshard_method: str = "estimate"
    inference: Optional[dict] = None
    agent: Optional[dict] = None
    """Multi-turn rollouts: tools, tool format, limits, and the python tool's sandbox here."""
    changes: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    nearest_valid_nodes: list[int] = field(default_factory=list)
    model_params: int = 0
    engines: dict[str, str] = field(default_factory=dict)
    """role -> engine name (actor, ref, critic: ``actor.engine``; rollout: ``rollout.engine``)."""
    missing_here: list[str] = field(default_factory=list)
    """Engines the plan is valid for but that are not installed on this machine (``run`` refuses)."""
    placement: str = "colocated"
    """``colocated`` or ``disaggregated`` (``resources.placement``)."""
    train_devices: int = 0
    """Devices of the train group (actor, ref, critic): global ranks ``[0, train_devices)``."""
    rollout_devices: int = 0
    """Devices of the rollout group: the last ``rollout_devices`` ranks (= world when colocated)."""
    reshard_send_bytes_per_device: float = 0.0
    """disaggregated: the most bytes a train device sends per step (sources spread over replicas)."""
    ref_memory: Memory = field(default_factory=Memory)
    """The reference model's weights on a train device (none without a ref role, none with LoRA)."""
    lora: Optional[dict] = None
    """``actor.lora``: the adapters (rank, targets, tensors, parameters) and the per-step sync of the
    adapters beside a full-weight sync (``reshard``: :class:`~.reshard.ReshardVolume` fields each)."""
    sequence: Optional[dict] = None
    """Long sequences (set when a train role has ``sp > 1``): the longest sample, and per train role
    its SP and the tokens of a row one rank holds (:func:`~.long_context.sequence_summary`)."""
    vision: Optional[dict] = None
    """A vision-language model: image tokens and patches per image at the processor's cap, the vision
    tower's activations per micro-batch, one image's KV cache (:func:`~.vision.vision_summary`)."""
    notes: list[str] = field(default_factory=list)
    """What the plan passes but the run should know (e.g. the rollout KV cache holds fewer longest
    sequences than a rollout rank runs at once)."""
    suggestions: list[str] = field(default_factory=list)
    """Fixes the plan found for its violations (the smallest ``actor.layout.sp`` whose memory fits)."""
    predicted: Optional["StepPrediction"] = None
    """The step-time model's seconds per stage, step time and TPS/card on ``resources.hardware``
    (:mod:`.steptime`); None while a role has no DP size (its layout does not fit the devices)."""
    node_independent: set = field(default_factory=set, repr=False)
    """Rules this plan breaks on any node count beyond :data:`~.checks.NODE_INDEPENDENT_RULES` (a train
    memory whose unshardable part exceeds the device): the nearest-node search skips them."""

    @property
    def ref_policy(self) -> str:
        """``"model"`` (a reference engine), ``"adapters off"`` (LoRA: the actor's base) or ``""`` (none)."""
        if "ref" not in self.roles:
            return ""
        return "adapters off" if self.lora is not None else "model"

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def cards(self) -> int:
        return self.world

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"

    def placement_lines(self) -> list[str]:
        """Human-readable lines on the device groups (empty when colocated: the output is unchanged)."""
        if not self.disaggregated:
            return []
        train_roles = [r for r in self.roles if r != "rollout"]
        T, R = self.train_devices, self.rollout_devices
        lines = [f"placement: disaggregated -- train group: {T} devices (ranks {ranks_text(0, T)}; "
                 f"{', '.join(train_roles)}) · rollout group: {R} devices (ranks {ranks_text(T, T + R)})",
                 "memory: the train group holds no rollout weights or KV cache, the rollout group no gradients or "
                 "optimizer state; nothing is swapped out",
                 f"reshard across groups per step: {self.reshard_bytes_per_device / GiB:.2f} GiB received by each "
                 f"rollout device at most, {self.reshard_send_bytes_per_device / GiB:.2f} GiB sent by a train "
                 f"device at most ({self.reshard_method})"]
        return lines

    def lora_lines(self) -> list[str]:
        """Human-readable lines on LoRA (empty without it: the output is unchanged)."""
        if self.lora is None:
            return []
        lo = self.lora
        lines = [f"LoRA r={lo['rank']} on {', '.join(lo['target_modules'])}: "
                 + (f"{lo['tensors']} adapter tensors, {lo['params'] / 1e6:.2f}M trainable parameters "
                    f"({100 * lo['params'] / max(1, self.model_params):.2f} % of the model); " if "params" in lo else "")
                 + "the base is frozen (kept in the engine's fp32 master dtype), gradients and optimizer state "
                   "are the adapters' only"]
        lines += lo.get("notes", [])
        if self.ref_policy:
            lines.append("reference policy: the actor's base with the adapters off (no reference weights)")
        sync = lo.get("reshard")
        if sync:
            a, f = sync["adapters"], sync["full_weights"]
            pct = f" (LoRA moves {100 * a['loaded'] / f['loaded']:.2f} % of it)" if f["loaded"] else ""
            lines.append(f"reshard per step, adapters only: {_size(a['received'])} received by a device at most, "
                         f"{_size(a['loaded'])} loaded into each rollout device ({a['method']}); a full-weight sync "
                         f"would receive {_size(f['received'])} and load {_size(f['loaded'])}{pct}")
        return lines

    def sequence_lines(self) -> list[str]:
        """Human-readable lines on long sequences and the notes (empty without them)."""
        lines = []
        if self.sequence:
            same: dict[tuple, list[str]] = {}  # roles on the same split: one entry
            for name, r in self.sequence["roles"].items():
                if r["sp"] > 1:
                    same.setdefault((r["sp"], r["tokens_per_rank"], r["row_tokens"]), []).append(name)
            parts = [f"{', '.join(names)} SP{sp}: {per} tokens of a {row}-token row per rank"
                     for (sp, per, row), names in same.items()]
            lines.append(f"long sequences: {self.sequence['longest_sample']} tokens per sample at most; "
                         + "; ".join(parts))
        return lines + self.notes

    def lora_json(self) -> dict:
        out = {k: v for k, v in self.lora.items() if k != "reshard"}
        sync = self.lora.get("reshard")
        if sync:
            out["reshard"] = {side: {k: (v if k == "method" else int(round(v))) for k, v in sync[side].items()}
                              for side in ("adapters", "full_weights")}
            out["reshard"]["unit"] = "bytes"
            full = sync["full_weights"]["loaded"]
            out["reshard"]["loaded_fraction_of_full"] = round(sync["adapters"]["loaded"] / full, 6) if full else None
        return out

    def to_json(self) -> dict:
        out = {
            "recipe": self.recipe, "ok": self.ok, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
            "world": self.world, "device": self.device, "model_params": self.model_params,
            "roles": {k: v.to_json() for k, v in self.roles.items()},
            "global_batch": self.global_batch, "mini_batch": self.mini_batch, "n_samples": self.n_samples,
            "memory_gib": {"train": self.train_memory.gib(), "rollout": self.rollout_memory.gib(),
                           "device": self.device_memory_gb},
            "reshard_gib_per_device": round(self.reshard_bytes_per_device / GiB, 3),
            "reshard_full_model_gib": round(self.reshard_full_bytes / GiB, 3),
            "reshard_method": self.reshard_method,
            **({"ref_policy": self.ref_policy, "ref_memory_gib": self.ref_memory.gib()} if self.ref_policy else {}),
            **({"lora": self.lora_json()} if self.lora is not None else {}),
            "inference": self.inference,
            **({"agent": self.agent} if self.agent else {}),
            "changes": self.changes, "violations": [asdict(v) for v in self.violations],
            "nearest_valid_nodes": self.nearest_valid_nodes,
            "engines": self.engines, "missing_here": self.missing_here,
            **({"sequence": self.sequence} if self.sequence else {}),
            **({"vision": self.vision} if self.vision else {}),
            **({"notes": self.notes} if self.notes else {}),
            **({"suggestions": self.suggestions} if self.suggestions else {}),
            **({"predicted": self.predicted.to_json()} if self.predicted is not None else {}),
        }
        if self.disaggregated:  # colocated JSON is unchanged
            T, R = self.train_devices, self.rollout_devices
            out["placement"] = self.placement
            out["groups"] = {
                "train": {"devices": T, "ranks": [0, T], "roles": [r for r in self.roles if r != "rollout"],
                          "memory_gib": self.train_memory.gib()},
                "rollout": {"devices": R, "ranks": [T, T + R], "roles": ["rollout"],
                            "memory_gib": self.rollout_memory.gib()},
            }
            out["reshard_send_gib_per_train_device"] = round(self.reshard_send_bytes_per_device / GiB, 3)
        return out


def build_plan(recipe: Recipe, nodes: Optional[int] = None, devices_per_node: Optional[int] = None,
               keep_batch: bool = False, _search: bool = True) -> Plan:
    """The plan of ``recipe`` on ``nodes`` x ``devices_per_node`` devices (default: the recipe's).

    ``keep_batch``: hold the global batch instead of scaling it with the actor DP. ``_search``
    (internal): the exact reshard bytes and the nearest valid node counts; the search itself plans
    without them."""
    if devices_per_node is None:
        recipe = smoke_fit(recipe)
    res = recipe.resources
    nodes = nodes or res.nodes
    dpn = devices_per_node or res.devices_per_node
    world = nodes * dpn
    dims = recipe.model.dims()

    disagg = res.placement == "disaggregated"
    roles, train_world, rollout_world, split_violations = role_layouts(recipe, world)

    engines = {role: (recipe.rollout.engine if role == "rollout" else recipe.actor.engine) for role in roles}
    violations, missing_here = engine_checks(recipe, engines)
    violations += split_violations
    if disagg and recipe.resharding.strategy != "auto":
        violations.append(Violation("reshard strategy fits the placement",
                                    f"resharding.strategy={recipe.resharding.strategy} reshards on one set of devices; "
                                    "with resources.placement=disaggregated the weights cross from the train group "
                                    "to the rollout group: set resharding.strategy=auto (cross_alltoallv)"))
    violations += model_checks(recipe, dims)
    caps = {role: capabilities(name) for role, name in engines.items() if name in BACKENDS}
    train_caps = caps.get("actor")
    violations += capability_checks(recipe, dims, roles, caps)
    violations += sequence_checks(recipe, dims, roles, caps)
    fits = rollout_devices_that_fit(world, roles) if disagg else []
    for role in roles.values():
        if role.world < 1:  # no training device left (reported above)
            continue
        if role.role in caps:
            violations.extend(layout_violations(role, dims, caps[role.role],
                                                where(role, world, fits, dpn) if disagg else None))
            violations.extend(engine_layout_violations(role, dims, caps[role.role], recipe))

    # batch scaling
    gb, mb = recipe.trainer.global_batch, recipe.trainer.mini_batch
    n = recipe.trainer.n_samples_per_prompt
    changes: list[str] = []
    actor = roles["actor"]
    pinned_world = res.nodes * res.devices_per_node
    pinned_train = pinned_world - (rollout_world if disagg else 0)  # the rollout group keeps its size
    if world != pinned_world:
        if pinned_train > 0 and pinned_train % actor.model_parallel == 0 and actor.dp is not None:
            pinned_dp = pinned_train // actor.model_parallel
            changes.append(f"{res.nodes} x {res.devices_per_node} -> {nodes} x {dpn} devices: world "
                           f"{pinned_world} -> {world}" + (f" (train group {pinned_train} -> {train_world}, rollout "
                                                          f"group {rollout_world})" if disagg else ""))
            for role in roles.values():
                old = (rollout_world if role.role == "rollout" else pinned_train) // role.model_parallel \
                    if disagg else pinned_world // role.model_parallel
                if role.dp is not None and role.dp != old:
                    changes.append(f"{role.role} DP {old} -> {role.dp} (TP/PP/EP{'/SP' if role.sp > 1 else ''} "
                                   "unchanged)")
            if not keep_batch and actor.dp != pinned_dp and gb % pinned_dp == 0 and mb % pinned_dp == 0:
                new_gb, new_mb = gb // pinned_dp * actor.dp, mb // pinned_dp * actor.dp
                if new_gb != gb:
                    changes.append(f"global batch {gb} -> {new_gb} prompts, mini-batch {mb} -> {new_mb} "
                                   f"({gb // pinned_dp} prompts per actor DP rank kept; --keep-batch holds {gb})")
                gb, mb = new_gb, new_mb
    for role in roles.values():
        if role.role == "rollout" or role.dp is None:
            continue
        if gb % role.dp:
            violations.append(Violation("global batch divides by DP",
                                        f"{role.role}: {gb} prompts per step over DP{role.dp}"))
        elif mb % role.dp:
            violations.append(Violation("mini-batch divides by DP",
                                        f"{role.role}: {mb} prompts per optimizer step over DP{role.dp}"))

    device_bytes = res.device_memory_gb * GiB
    plan = Plan(recipe=recipe.name, nodes=nodes, devices_per_node=dpn, world=world, device=res.device,
                device_memory_gb=res.device_memory_gb, roles=roles, global_batch=gb, mini_batch=mb, n_samples=n,
                changes=changes, model_params=dims.total_params(), engines=engines, missing_here=missing_here,
                placement=res.placement, train_devices=train_world, rollout_devices=rollout_world)
    if dims.has_vision:  # images: their tokens, the tower's activations, their KV cache
        from .long_context import kv_token_bytes
        from .vision import vision_summary

        plan.vision = v = vision_summary(dims, recipe, kv_token_bytes(dims, roles["rollout"].tp))
        plan.notes.append(f"images: up to {v['image_tokens_per_image']} image tokens per image (data.max_pixels "
                          f"{recipe.data.max_pixels}; {v['patches_per_image']} patches through the {v['tower']} vision "
                          f"tower), its activations {v['vision_activations_gib']} GiB per micro-batch of "
                          f"{v['images_per_micro_batch']} images, {v['image_kv_cache_mib_per_image']} MiB of KV cache "
                          "per image per rollout device (counted in the prompt)")
        rollout_caps = capabilities(recipe.rollout.engine)
        from ..device import is_accelerator

        if rollout_caps.image_prompts and not rollout_caps.image_activations_profiled and is_accelerator(res.device):
            from .vision import vision_activation_bytes

            per_image = max(1, int(v["image_tokens_per_image"]))
            budget = recipe.rollout.inference.max_num_batched_tokens or recipe.data.max_prompt_length
            n = max(1, int(budget) // per_image)  # the images one encoder pass runs (vLLM's encoder budget)
            gib = vision_activation_bytes(dims, recipe, n, inference=True) / GiB
            plan.notes.append(f"rollout.engine={recipe.rollout.engine} does not measure the vision tower's "
                              "activations when it sizes its KV cache (no dummy images); leave about "
                              f"{gib:.2f} GiB per rollout device (one encoder pass of {n} image(s)) outside "
                              "rollout.inference.gpu_memory_utilization")
        if not rollout_caps.image_prompts:  # an engine that refuses image prompts
            plan.notes.append(f"rollout.engine={recipe.rollout.engine}: image prompts do not reach its "
                              "multi_modal_data in this release, so a run stops at its first rollout; "
                              f"set rollout.engine to one that takes images: "
                              f"{', '.join(engines_that(lambda c: c.image_prompts and 'rollout' in c.roles))}")
    lora = recipe.actor.lora if recipe.actor.lora.enabled else None
    if lora is not None:
        plan.lora = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}
        try:  # the tensors PEFT creates, and the resharder's rule for each
            specs = lora_specs(dims, lora)
            plan.lora.update(tensors=len(specs), params=sum(s.numel for s in specs))
            problems, plan.lora["notes"] = lora_problems(dims, lora)  # what PEFT would let pass silently
            violations += [Violation("LoRA has what it needs", p) for p in problems]
        except ValueError as e:
            violations.append(Violation("LoRA has what it needs", f"actor.lora.target_modules on {dims.family}: {e}"))
            lora = None
    if actor.dp is not None and train_caps is not None:
        plan.train_memory = train_memory(dims, actor, recipe, actor.dp, train_caps)
        if "ref" in roles and roles["ref"].dp is not None:
            plan.ref_memory = ref_memory(dims, roles["ref"], recipe, roles["ref"].dp, train_caps)
        need = plan.train_memory.total + plan.ref_memory.total
        if need > device_bytes:
            ref = f" ({plan.ref_memory.total / GiB:.1f} GiB of it reference weights)" if plan.ref_memory.total else ""
            sp = " or actor.layout.sp (splits each sequence)" if train_caps.sequence_parallel else ""
            floor = node_independent_bytes(plan.train_memory, plan.ref_memory, train_caps)
            more = f"; {floor / GiB:.1f} GiB of it no node count shrinks" if floor > device_bytes else ""
            if more:
                plan.node_independent.add(MEMORY_RULE)  # the nearest-node search cannot help
            violations.append(Violation(MEMORY_RULE,
                                        f"actor needs {need / GiB:.1f} GiB per device{ref} "
                                        f"> {res.device_memory_gb:g} GiB{more} (raise TP/PP/EP{sp}, or set "
                                        f"actor.offload_optimizer)"))
    if any(r.sp > 1 for r in roles.values()):
        plan.sequence = sequence_summary(recipe, roles, train_caps.memory_model if train_caps else "")
    rollout = roles["rollout"]
    if rollout.dp is not None:
        rollout_caps = caps.get("rollout")
        plan.rollout_memory = rollout_memory(dims, rollout, recipe, device_bytes,
                                             expert_tp=bool(rollout_caps and rollout_caps.expert_tensor_parallel))
        budget = device_bytes * recipe.rollout.inference.gpu_memory_utilization
        if plan.rollout_memory.weights > budget:
            violations.append(Violation("rollout weights fit the device",
                                        f"rollout weights {plan.rollout_memory.weights / GiB:.1f} GiB > "
                                        f"{budget / GiB:.1f} GiB budget (gpu_memory_utilization "
                                        f"{recipe.rollout.inference.gpu_memory_utilization}); raise rollout TP/EP"))
        else:  # per rollout rank, at the longest sample
            _, found, note = kv_check(dims, rollout, recipe, gb * n, plan.rollout_memory.kv_cache, device_bytes)
            violations += found
            plan.notes += [note] if note else []
        if actor.dp is not None:
            plan.reshard_bytes_per_device = reshard_bytes(dims, actor, rollout, res.placement)
            if disagg:  # the rollout group's bytes spread over the train devices
                plan.reshard_send_bytes_per_device = plan.reshard_bytes_per_device * rollout.world / actor.world
            plan.reshard_full_bytes = dims.total_params() * DTYPE_BYTES
    plan.inference, found = rollout_inference(recipe, dims)
    violations += found
    found, plan.agent = agent_checks(recipe)
    violations += found + pool_checks(recipe)
    plan.violations = violations
    full = None
    if _search and not violations:
        full = full_reshard(dims, actor, rollout, res.placement)
        plan.reshard_bytes_per_device, plan.reshard_method, plan.reshard_send_bytes_per_device = \
            full.received, full.method, full.sent
    if _search and lora is not None and actor.dp is not None and rollout.dp is not None:
        # only the adapters move; a full-weight sync of the same layouts beside it, for the ratio
        full = full or full_reshard(dims, actor, rollout, res.placement)
        moved = lora_reshard(dims, lora, actor, rollout, res.placement)
        plan.lora["reshard"] = {"adapters": asdict(moved), "full_weights": asdict(full)}
        plan.reshard_bytes_per_device, plan.reshard_method, plan.reshard_send_bytes_per_device = \
            moved.received, moved.method, moved.sent
    if _search and any(v.rule not in NODE_INDEPENDENT_RULES | plan.node_independent for v in violations):
        plan.nearest_valid_nodes = nearest_valid_nodes(recipe, nodes, dpn, keep_batch)
    if _search and any(v.rule == MEMORY_RULE for v in violations):
        plan.suggestions += sp_suggestion(recipe, plan, keep_batch)
    if _search and all(role.dp is not None for role in roles.values()):
        try:
            plan.predicted = predict(recipe, plan)
        except Exception as e:  # noqa: BLE001 - a prediction is advice: it never stops plan or run
            plan.notes.append(f"no step-time prediction: {type(e).__name__}: {e}")
    return plan


def sp_suggestion(recipe: Recipe, plan: Plan, keep_batch: bool = False, limit: int = 64) -> list[str]:
    """When the training memory does not fit: the smallest ``actor.layout.sp`` (Ulysses / context
    parallelism, ``Capabilities.sequence_parallel``) that fits on the plan's node count and brings
    no violation the plan did not have. Cheap: the SP sizes that divide the train devices' DP, one
    plan each (no search inside); empty when the engine cannot split sequences."""
    caps = capabilities(recipe.actor.engine) if recipe.actor.engine in BACKENDS else None
    actor = plan.roles["actor"]
    if caps is None or not caps.sequence_parallel:
        return []
    what = "Ulysses" if caps.sequence_parallel == "ulysses" else caps.sequence_parallel.replace("_", " ")
    others = {v.rule for v in plan.violations} - {MEMORY_RULE}
    replicas = actor.world // (actor.tp * actor.pp) if actor.world % (actor.tp * actor.pp) == 0 else 0
    tried, blocked = [], None
    for sp in range(actor.sp + 1, min(limit, replicas) + 1):
        if replicas % sp:
            continue
        r = recipe.model_copy(deep=True)
        r.actor.layout.sp = sp
        for role in ("ref", "critic"):  # a separate layout splits its sequences the same way
            if getattr(r, role).layout is not None:
                getattr(r, role).layout.sp = sp
        p = build_plan(r, plan.nodes, plan.devices_per_node, keep_batch, _search=False)
        need = (p.train_memory.total + p.ref_memory.total) / GiB
        tried.append(sp)
        new = [v for v in p.violations if v.rule not in others]
        if not new:
            return [f"training memory does not fit at sp={actor.sp}: actor.layout.sp={sp} fits ({need:.1f} GiB of "
                    f"{plan.device_memory_gb:g} GiB per device; {what}, actor DP {p.roles['actor'].dp})"]
        if blocked is None and all(v.rule != MEMORY_RULE for v in new):  # fits, but breaks another rule
            blocked = f"actor.layout.sp={sp} would fit ({need:.1f} GiB) but: {new[0]}"
    if not tried:
        return []
    return [f"training memory does not fit at sp={actor.sp}, and no actor.layout.sp up to {max(tried)} fits on "
            f"{plan.nodes} node(s) with every other rule kept ({what})" + (f"; {blocked}" if blocked else
                                                                          "; lower trainer.micro_batch")]


def nearest_valid_nodes(recipe: Recipe, nodes: int, devices_per_node: int, keep_batch: bool = False,
                        limit: int = 64) -> list[int]:
    """The closest node counts below and above ``nodes`` whose plan has no violation, within
    ``max(limit, 4 x nodes)`` (each count is a whole plan, ~30 ms: the search stays within seconds)."""
    below = next((n for n in range(nodes - 1, 0, -1)
                  if build_plan(recipe, n, devices_per_node, keep_batch, _search=False).ok), None)
    above = next((n for n in range(nodes + 1, max(limit, 4 * nodes) + 1)
                  if build_plan(recipe, n, devices_per_node, keep_batch, _search=False).ok), None)
    return [n for n in (below, above) if n is not None]


def format_violations(plan: Plan) -> str:
    lines = [f"{plan.recipe} on {plan.nodes} node(s) x {plan.devices_per_node} devices = {plan.world}: "
             f"{len(plan.violations)} rule(s) violated"]
    lines += [f"  - {v}" for v in plan.violations]
    lines += [f"  {s}" for s in plan.suggestions]
    if plan.nearest_valid_nodes:
        lines.append(f"  nearest valid node counts: {', '.join(map(str, plan.nearest_valid_nodes))}")
    elif all(v.rule in NODE_INDEPENDENT_RULES | plan.node_independent for v in plan.violations):
        lines.append("  no node count fixes these; change the recipe as each line says")
    else:
        lines.append(f"  no node count from 1 to {max(64, 4 * plan.nodes)} satisfies every rule; change the layout in the recipe")
    return "\n".join(lines)


def resolve(recipe: Recipe, plan: Plan) -> Recipe:
    """The recipe that runs: the plan's batch and node count written back (one source of truth).

    The driver writes this to ``config.yaml`` and hands it to every worker, so the batch a run
    trains on is the batch ``plan`` printed. Planning the resolved recipe again changes nothing.
    """
    if not plan.ok:
        raise PlanError(format_violations(plan))
    fit = smoke_fit(recipe)
    r = fit.model_copy(deep=True) if fit.resources.devices_per_node == plan.devices_per_node else \
        recipe.model_copy(deep=True)
    r.trainer.global_batch, r.trainer.mini_batch = plan.global_batch, plan.mini_batch
    r.resources.nodes, r.resources.devices_per_node = plan.nodes, plan.devices_per_node
    return r


def refuse_missing_engines(plan: Plan) -> None:
    """``run``'s check, before anything is placed: every engine the plan names must run here."""
    if plan.missing_here:
        err = PlanError("cannot run here:\n" + "\n".join(f"  - {m}" for m in plan.missing_here))
        err.code = 2  # this machine lacks an engine (install it); the layout itself is valid
        raise err


__all__ = ["MEMORY_RULE", "Plan", "build_plan", "format_violations", "nearest_valid_nodes", "refuse_missing_engines",
           "resolve", "sp_suggestion"]
