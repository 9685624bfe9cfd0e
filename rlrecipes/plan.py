"""Parallel layouts for N nodes: validation, per-device memory and reshard-volume estimates.

``build_plan(recipe, nodes)`` derives the DP size of every role from the world size, checks
every layout rule at once, and estimates per-device memory (weights, gradients, optimizer state,
activations, rollout weights and KV cache) and the weight bytes each device receives when the
trained weights are resharded into the rollout layout. Nothing here starts a process, so an
impossible layout fails in ``rlrecipes plan`` before anything is launched. The per-engine memory
models are in :mod:`rlrecipes.plan_memory`.

Scaling policy: the recipe pins a layout at ``resources.nodes``. On another node count the
TP/PP/EP sizes stay and DP scales; the global batch scales with the actor DP size so every DP
rank keeps its per-step batch (weak scaling), unless ``keep_batch=True`` (strong scaling).

Placement: ``colocated`` (default) puts every role on all ``world`` devices. ``disaggregated``
(``resources.placement``) gives the rollout the last ``resources.rollout_devices`` ranks and the
train roles (actor, ref, critic) the first ``world - rollout_devices``; each group's DP comes from
its own device count, and the rollout count stays fixed when the node count changes.
:func:`placement_groups` gives the workflow the two groups' ranks and layouts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from .engines.base import Capabilities
from .engines.registry import BACKENDS, capabilities, problems
from .models import ModelDims
from .plan_memory import DTYPE_BYTES, GiB, Memory, _kv_needed, _rollout_memory, _train_memory
from .recipe import Recipe

# disaggregated placement: a layout that cannot fill its device group whatever the node count (the
# rollout group's size is fixed; the train group's is n x devices_per_node - rollout_devices)
ROLLOUT_SPLIT_RULE = "rollout TP*PP divides resources.rollout_devices"
TRAIN_SPLIT_RULE = "train TP*PP divides world - resources.rollout_devices at some node count"
# Rules no node count can fix: the nearest-valid-node search is skipped when only these fail.
NODE_INDEPENDENT_RULES = {"inference settings supported by vllm-ascend", "rollout PP = 1",
                          "engine keeps ref/critic on the actor layout", "engine serves the role here",
                          "engine has pipeline parallelism", "engine has expert parallelism",
                          "engine keeps EP inside the TP group", "GRPO needs a group per prompt",
                          "engine runs this model here", "routing replay has what it needs",
                          "reshard strategy fits the placement", ROLLOUT_SPLIT_RULE, TRAIN_SPLIT_RULE}


@dataclass
class RoleLayout:
    role: str
    tp: int
    pp: int
    ep: int
    dp: Optional[int]
    world: int
    pp_layers: Optional[list[int]] = None

    def describe(self) -> str:
        dp = "?" if self.dp is None else self.dp
        s = f"TP{self.tp} PP{self.pp} EP{self.ep} DP{dp}"
        if self.pp_layers and self.pp > 1:
            s += f" layers {','.join(map(str, self.pp_layers))}"
        return s


@dataclass
class Violation:
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.detail}"


@dataclass
class Plan:
    recipe: str
    nodes: int
    devices_per_node: int
    world: int
    device: str
    device_memory_gb: float
    roles: dict[str, RoleLayout]
    global_batch: int
    mini_batch: int
    n_samples: int
    train_memory: Memory = field(default_factory=Memory)
    rollout_memory: Memory = field(default_factory=Memory)
    reshard_bytes_per_device: float = 0.0
    reshard_full_bytes: float = 0.0
    reshard_method: str = "estimate"
    inference: Optional[dict] = None
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
        lines = [f"placement: disaggregated -- train group: {T} devices (ranks {_ranks(0, T)}; "
                 f"{', '.join(train_roles)}) · rollout group: {R} devices (ranks {_ranks(T, T + R)})",
                 "memory: the train group holds no rollout weights or KV cache, the rollout group no gradients or "
                 "optimizer state; nothing is swapped out",
                 f"reshard across groups per step: {self.reshard_bytes_per_device / GiB:.2f} GiB received by each "
                 f"rollout device at most, {self.reshard_send_bytes_per_device / GiB:.2f} GiB sent by a train "
                 f"device at most ({self.reshard_method})"]
        return lines

    def to_json(self) -> dict:
        out = {
            "recipe": self.recipe, "ok": self.ok, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
            "world": self.world, "device": self.device, "model_params": self.model_params,
            "roles": {k: asdict(v) for k, v in self.roles.items()},
            "global_batch": self.global_batch, "mini_batch": self.mini_batch, "n_samples": self.n_samples,
            "memory_gib": {"train": self.train_memory.gib(), "rollout": self.rollout_memory.gib(),
                           "device": self.device_memory_gb},
            "reshard_gib_per_device": round(self.reshard_bytes_per_device / GiB, 3),
            "reshard_full_model_gib": round(self.reshard_full_bytes / GiB, 3),
            "reshard_method": self.reshard_method,
            "inference": self.inference,
            "changes": self.changes, "violations": [asdict(v) for v in self.violations],
            "nearest_valid_nodes": self.nearest_valid_nodes,
            "engines": self.engines, "missing_here": self.missing_here,
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


def _ranks(a: int, b: int) -> str:
    return f"{a}-{b - 1}" if b - a > 1 else str(a)


# ---------------------------------------------------------------------------------------------
def _layout_violations(role: RoleLayout, dims: ModelDims, world: int, caps: Capabilities,
                       where: Optional[tuple[str, str]] = None) -> list[Violation]:
    """``where`` = (rule, the role's device set and the fix) under disaggregated placement; the
    default names the whole world."""
    v: list[Violation] = []
    name = role.role
    if world % (role.tp * role.pp):
        v.append(Violation(where[0] if where else "TP*PP divides the world",
                           f"{name}: TP{role.tp} x PP{role.pp} = {role.tp * role.pp} does not divide "
                           f"{where[1] if where else f'{world} devices'}"))
    dp = world // (role.tp * role.pp) if world % (role.tp * role.pp) == 0 else None
    if dp is not None and (dp * role.tp) % role.ep:
        v.append(Violation("EP divides DP*TP", f"{name}: EP{role.ep} does not divide DP{dp} x TP{role.tp} = {dp * role.tp}"))
    if dims.num_heads % role.tp:
        v.append(Violation("attention heads divide by TP", f"{name}: {dims.num_heads} heads, TP{role.tp}"))
    if not dims.is_mla and dims.num_kv_heads % role.tp:
        v.append(Violation("KV heads divide by TP", f"{name}: {dims.num_kv_heads} KV heads, TP{role.tp}"))
    if dims.is_moe and dims.num_experts % role.ep:
        v.append(Violation("experts divide by EP", f"{name}: {dims.num_experts} experts, EP{role.ep}"))
    if not dims.is_moe and role.ep != 1:
        v.append(Violation("EP needs an MoE model", f"{name}: EP{role.ep} on dense family {dims.family}; set ep: 1"))
    if role.pp_layers is not None:
        if len(role.pp_layers) != role.pp:
            v.append(Violation("layer split has one entry per PP stage",
                               f"{name}: pp_layers has {len(role.pp_layers)} entries for PP{role.pp}"))
        if sum(role.pp_layers) != dims.num_layers:
            v.append(Violation("layer split sums to the layer count",
                               f"{name}: pp_layers {role.pp_layers} sums to {sum(role.pp_layers)}, model has {dims.num_layers} layers"))
    elif role.pp > dims.num_layers:
        v.append(Violation("PP at most the layer count", f"{name}: PP{role.pp} > {dims.num_layers} layers"))
    if not caps.pipeline_parallel and name != "rollout" and role.pp != 1:
        v.append(Violation("engine has pipeline parallelism",
                           f"{name}: PP{role.pp} with engine {caps.name}, which has none; use pp: 1 or an engine "
                           "with pipeline parallelism (actor.engine: megatron)"))
    if not caps.expert_parallel and role.ep != 1:
        v.append(Violation("engine has expert parallelism", f"{name}: EP{role.ep} with engine {caps.name}; use ep: 1"))
    if caps.expert_tensor_parallel and name != "rollout" and role.ep > 1 and dp is not None and dp % role.ep:
        v.append(Violation("engine places EP groups across DP",
                           f"{name}: EP{role.ep} does not divide DP{dp} (engine {caps.name} splits experts over "
                           f"TP as well, so the EP groups span data-parallel ranks); use an ep that divides {dp}"))
    if caps.ep_within_tp and role.ep > 1 and role.tp % role.ep:
        v.append(Violation("engine keeps EP inside the TP group",
                           f"{name}: EP{role.ep} does not divide TP{role.tp} (engine {caps.name}); "
                           "use ep <= tp with tp % ep == 0"))
    return v


def _reshard_bytes(dims: ModelDims, train: RoleLayout, rollout: RoleLayout, placement: str = "colocated") -> float:
    """Bytes one device receives per step: its rollout shard minus what its train shard already holds
    (disaggregated: the whole rollout shard, the rollout device holds no train shard).

    Assumes nested, aligned shards (TP/EP sizes divide each other), the layout the resharder plans.
    """
    total, experts = dims.total_params(), dims.expert_params()
    dense = total - experts
    need = dense / rollout.tp + experts / rollout.ep
    if placement == "disaggregated":
        return need * DTYPE_BYTES
    held = dense / train.pp / max(train.tp, rollout.tp) + experts / train.pp / max(train.ep, rollout.ep)
    return max(0.0, need - held) * DTYPE_BYTES


def _exact_reshard_bytes(dims: ModelDims, train: RoleLayout, rollout: RoleLayout,
                         placement: str = "colocated") -> tuple[float, str, float]:
    """Max bytes any device receives, from the resharder's own plan (aggregated by parameter class),
    the method, and (disaggregated) the most bytes a train device sends."""
    from .core.resharder import Layout, ReshardError
    from .models.sharding import reshard_bytes_summary

    try:
        s = reshard_bytes_summary(
            Layout(train.tp, train.pp, train.ep, train.dp, tuple(train.pp_layers) if train.pp_layers else None),
            Layout(rollout.tp, 1, rollout.ep, rollout.dp), dims, train.pp_layers, dtype_bytes=DTYPE_BYTES,
            placement=placement)
    except ReshardError:
        recv = _reshard_bytes(dims, train, rollout, placement)
        return recv, "estimate", recv * rollout.world / train.world if placement == "disaggregated" else 0.0
    return float(s["max_min_recv_bytes"]), "resharder plan", float(s.get("max_send_bytes", 0.0))


def _render_inference(recipe: Recipe, dims: ModelDims, violations: list) -> Optional[dict]:
    """vllm-ascend settings for the pinned (or installed) version; an impossible combination is a violation."""
    from .engines.vllm.settings import InferenceConfigError, installed_vllm_ascend_version, render

    version = recipe.rollout.inference.vllm_ascend_version or installed_vllm_ascend_version()
    if version is None:
        return None
    try:
        r = render(recipe.rollout.inference, version, is_mla=dims.is_mla)
    except InferenceConfigError as e:
        violations.append(Violation("inference settings supported by vllm-ascend", str(e)))
        return None
    return {"vllm_ascend": version, "additional_config": r.additional_config, "engine_kwargs": r.engine_kwargs}


def _model_checks(recipe: Recipe, dims: ModelDims) -> list[Violation]:
    """Model features an engine's kernels cannot take on this device (e.g. vLLM CPU head sizes)."""
    out: list[Violation] = []
    device = recipe.resources.device
    for key, name in (("actor.engine", recipe.actor.engine), ("rollout.engine", recipe.rollout.engine)):
        if name not in BACKENDS:
            continue
        caps = capabilities(name)
        if dims.is_mla:
            latent = dims.kv_lora_rank + dims.qk_rope_head_dim
            for dev, sizes in caps.mla_latent_sizes_by_device:
                if dev == device and latent not in sizes:
                    out.append(Violation("engine runs this model here",
                                         f"{key}={name} on {device}: its MLA kernels take a latent (kv_lora_rank + "
                                         f"qk_rope_head_dim) of {'/'.join(map(str, sizes))} only, this model's is "
                                         f"{latent}; use {key.split('.')[0]}.engine=native on {device}"))
            continue
        for dev, low in caps.min_head_dim_by_device:
            if dev == device and dims.head_dim < low:
                out.append(Violation("engine runs this model here",
                                     f"{key}={name} on {device}: attention head size {dims.head_dim} < {low}, the "
                                     f"smallest its kernels take; use head_dim >= {low} (model.smoke.head_dim={low}) "
                                     f"or another engine"))
    return out


def _engine_checks(recipe: Recipe, engines: dict[str, str]) -> tuple[list[Violation], list[str]]:
    """Engines that cannot serve a role are violations; engines not installed here are listed apart."""
    violations, missing = [], []
    device = recipe.resources.device
    for key, name, kind in (("actor.engine", recipe.actor.engine, "train"),
                            ("rollout.engine", recipe.rollout.engine, "rollout")):
        if name not in BACKENDS:
            violations += [Violation("engine serves the role here", f"{key}={name}: {p}")
                           for p in problems(name, kind, device, installed=False)]
            continue
        caps = capabilities(name)
        if kind not in caps.roles or (device != "auto" and device not in caps.devices):
            violations += [Violation("engine serves the role here", f"{key}={name}: {p}")
                           for p in problems(name, kind, device, installed=False) if "not written" not in p]
        else:  # a layout this engine can run: whether it is written and installed here is run's concern
            missing += [f"{key}={name}: {p}" for p in problems(name, kind, device)]
    if recipe.algorithm.name in ("grpo", "dapo") and recipe.trainer.n_samples_per_prompt < 2:
        violations.append(Violation("GRPO needs a group per prompt",
                                    f"trainer.n_samples_per_prompt={recipe.trainer.n_samples_per_prompt}: a group of "
                                    "one has zero advantage on every step; use 2 or more (8 is usual)"))
    return violations, missing


def _split_devices(recipe: Recipe, world: int) -> tuple[int, int, list[Violation]]:
    """(train devices, rollout devices, violations) of the placement on ``world`` devices."""
    res = recipe.resources
    if res.placement != "disaggregated":
        return world, world, []
    R = res.rollout_devices
    if R is None:  # the schema refuses this; kept for recipes built by hand
        return world, world, [Violation("rollout devices leave room for training",
                                        "resources.placement=disaggregated needs resources.rollout_devices; set it "
                                        "(e.g. resources.rollout_devices=8)")]
    if R >= world:
        return 0, R, [Violation("rollout devices leave room for training",
                                f"resources.rollout_devices={R} leaves no training device on {world} devices; set "
                                f"resources.rollout_devices below {world} (e.g. {max(1, world // 2)}), or add nodes")]
    return world - R, R, []


def _role_layouts(recipe: Recipe, world: int) -> tuple[dict[str, RoleLayout], int, int, list[Violation]]:
    """Every role's layout with the device count it spans (DP not yet set), the two device counts,
    and the placement's own violations."""
    T, R, violations = _split_devices(recipe, world)
    a = recipe.actor.layout
    roles = {"actor": RoleLayout("actor", a.tp, a.pp, a.ep, None, T, a.pp_layers)}
    if recipe.ref.enabled:
        r = recipe.ref.layout or a
        roles["ref"] = RoleLayout("ref", r.tp, r.pp, r.ep, None, T, r.pp_layers)
    if recipe.algorithm.name == "ppo":
        c = recipe.critic.layout or a
        roles["critic"] = RoleLayout("critic", c.tp, c.pp, c.ep, None, T, c.pp_layers)
    ro = recipe.rollout.layout
    roles["rollout"] = RoleLayout("rollout", ro.tp, ro.pp, ro.ep, None, R)
    return roles, T, R, violations


def _rollout_devices_that_fit(world: int, roles: dict[str, RoleLayout]) -> list[int]:
    """Values of resources.rollout_devices in [1, world) with which every role's TP x PP divides its group."""
    train = [r.tp * r.pp for r in roles.values() if r.role != "rollout"]
    roll = roles["rollout"].tp * roles["rollout"].pp
    return [R for R in range(1, world) if R % roll == 0 and all((world - R) % k == 0 for k in train)]


def _where(role: RoleLayout, world: int, fits: list[int], devices_per_node: int) -> tuple[str, str]:
    """(rule, the device set of a disaggregated role and the fix) for the TP*PP rule. The rule is
    node-independent when no node count can fix it (the nearest-node search is then skipped)."""
    import math

    k = role.tp * role.pp
    T, R = (role.world, world - role.world) if role.role != "rollout" else (world - role.world, role.world)
    near = sorted(fits, key=lambda x: (abs(x - R), x))[:2]
    fix = (f"set resources.rollout_devices={' or '.join(map(str, sorted(near)))}" if near else
           "no resources.rollout_devices fits; change the TP/PP sizes")
    if role.role == "rollout":
        return ROLLOUT_SPLIT_RULE, f"resources.rollout_devices={R}; {fix}, or a rollout.layout.tp that divides {R}"
    # n * devices_per_node - R = 0 (mod k) has a solution n iff gcd(devices_per_node, k) divides R
    rule = "TP*PP divides the world" if R % math.gcd(devices_per_node, k) == 0 else TRAIN_SPLIT_RULE
    return rule, (f"the {T} training devices (world {world} - resources.rollout_devices={R}); {fix}, "
                  f"or a {role.role}.layout whose TP x PP divides {T}")


def build_plan(recipe: Recipe, nodes: Optional[int] = None, devices_per_node: Optional[int] = None,
               keep_batch: bool = False, _search: bool = True) -> Plan:
    res = recipe.resources
    nodes = nodes or res.nodes
    dpn = devices_per_node or res.devices_per_node
    world = nodes * dpn
    dims = recipe.model.dims()

    a = recipe.actor.layout
    ro = recipe.rollout.layout
    disagg = res.placement == "disaggregated"
    roles, train_world, rollout_world, split_violations = _role_layouts(recipe, world)

    engines = {role: (recipe.rollout.engine if role == "rollout" else recipe.actor.engine) for role in roles}
    violations, missing_here = _engine_checks(recipe, engines)
    violations += split_violations
    if disagg and recipe.resharding.strategy != "auto":
        violations.append(Violation("reshard strategy fits the placement",
                                    f"resharding.strategy={recipe.resharding.strategy} reshards on one set of devices; "
                                    "with resources.placement=disaggregated the weights cross from the train group "
                                    "to the rollout group: set resharding.strategy=auto (cross_alltoallv)"))
    violations += _model_checks(recipe, dims)
    if recipe.algorithm.routing_replay:
        why = []
        if not dims.is_moe:
            why.append(f"the model ({dims.family}) has no experts to route")
        for key, name in (("actor.engine", recipe.actor.engine), ("rollout.engine", recipe.rollout.engine)):
            if name != "native":
                why.append(f"{key}={name} does not record/replay routing in this release (the native engines do)")
        violations += [Violation("routing replay has what it needs", f"algorithm.routing_replay: {w}") for w in why]
    caps = {role: capabilities(name) for role, name in engines.items() if name in BACKENDS}
    train_caps = caps.get("actor")
    if train_caps is not None and "critic" in roles and not train_caps.critic:
        violations.append(Violation("engine trains a critic",
                                    f"algorithm.name={recipe.algorithm.name} trains a critic, which engine "
                                    f"{train_caps.name} does not (actor.engine); use actor.engine: native for PPO, "
                                    f"or a critic-free algorithm (grpo, dapo)"))
    if train_caps is not None and not train_caps.separate_ref_layout:
        for role in ("ref", "critic"):
            lay = getattr(recipe, role).layout
            if role in roles and lay is not None and (lay.tp, lay.pp, lay.ep) != (a.tp, a.pp, a.ep):
                violations.append(Violation("engine keeps ref/critic on the actor layout",
                                            f"{role}.layout TP{lay.tp} PP{lay.pp} EP{lay.ep} differs from the actor's "
                                            f"TP{a.tp} PP{a.pp} EP{a.ep} (engine {train_caps.name}); "
                                            f"set {role}.layout: null"))
    if ro.pp != 1:
        violations.append(Violation("rollout PP = 1", f"rollout.layout.pp is {ro.pp}; the rollout runs without pipeline stages"))
    fits = _rollout_devices_that_fit(world, roles) if disagg else []
    for role in roles.values():
        if role.world < 1:  # no training device left (reported above)
            continue
        if role.role in caps:
            violations.extend(_layout_violations(role, dims, role.world, caps[role.role],
                                                 _where(role, world, fits, dpn) if disagg else None))
        if role.world % (role.tp * role.pp) == 0:
            role.dp = role.world // (role.tp * role.pp)

    # batch scaling
    gb, mb = recipe.trainer.global_batch, recipe.trainer.mini_batch
    n = recipe.trainer.n_samples_per_prompt
    changes: list[str] = []
    actor = roles["actor"]
    pinned_world = res.nodes * res.devices_per_node
    pinned_train = pinned_world - (rollout_world if disagg else 0)  # the rollout group keeps its size
    if world != pinned_world:
        if pinned_train > 0 and pinned_train % (a.tp * a.pp) == 0 and actor.dp is not None:
            pinned_dp = pinned_train // (a.tp * a.pp)
            changes.append(f"{res.nodes} x {res.devices_per_node} -> {nodes} x {dpn} devices: world "
                           f"{pinned_world} -> {world}" + (f" (train group {pinned_train} -> {train_world}, rollout "
                                                          f"group {rollout_world})" if disagg else ""))
            for role in roles.values():
                old = (rollout_world if role.role == "rollout" else pinned_train) // (role.tp * role.pp) \
                    if disagg else pinned_world // (role.tp * role.pp)
                if role.dp is not None and role.dp != old:
                    changes.append(f"{role.role} DP {old} -> {role.dp} (TP/PP/EP unchanged)")
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
    if actor.dp is not None and train_caps is not None:
        plan.train_memory = _train_memory(dims, actor, recipe, actor.dp)
        if plan.train_memory.total > device_bytes:
            violations.append(Violation("training memory fits the device",
                                        f"actor needs {plan.train_memory.total / GiB:.1f} GiB per device "
                                        f"> {res.device_memory_gb:g} GiB (raise TP/PP/EP, or set actor.offload_optimizer)"))
    rollout = roles["rollout"]
    if rollout.dp is not None:
        plan.rollout_memory = _rollout_memory(dims, rollout, recipe, device_bytes)
        budget = device_bytes * recipe.rollout.inference.gpu_memory_utilization
        instances = max(1, rollout.world // (rollout.tp * max(1, rollout.ep // rollout.tp)))
        need_kv = _kv_needed(dims, rollout, recipe, gb * n / instances)
        if plan.rollout_memory.weights > budget:
            violations.append(Violation("rollout weights fit the device",
                                        f"rollout weights {plan.rollout_memory.weights / GiB:.1f} GiB > "
                                        f"{budget / GiB:.1f} GiB budget (gpu_memory_utilization "
                                        f"{recipe.rollout.inference.gpu_memory_utilization}); raise rollout TP/EP"))
        elif plan.rollout_memory.kv_cache < min(need_kv, 0.05 * device_bytes):
            violations.append(Violation("KV cache fits the device",
                                        f"only {plan.rollout_memory.kv_cache / GiB:.1f} GiB left for the KV cache"))
        if actor.dp is not None:
            plan.reshard_bytes_per_device = _reshard_bytes(dims, actor, rollout, res.placement)
            if disagg:  # the rollout group's bytes spread over the train devices
                plan.reshard_send_bytes_per_device = plan.reshard_bytes_per_device * rollout.world / actor.world
            plan.reshard_full_bytes = dims.total_params() * DTYPE_BYTES
    if recipe.rollout.engine == "vllm":
        plan.inference = _render_inference(recipe, dims, violations)
    plan.violations = violations
    if _search and not violations:
        plan.reshard_bytes_per_device, plan.reshard_method, plan.reshard_send_bytes_per_device = \
            _exact_reshard_bytes(dims, actor, rollout, res.placement)
    if _search and any(v.rule not in NODE_INDEPENDENT_RULES for v in violations):
        plan.nearest_valid_nodes = nearest_valid_nodes(recipe, nodes, dpn, keep_batch)
    return plan


@dataclass(frozen=True)
class PlacementGroups:
    """Which global ranks run what, and the layouts they run (from :func:`placement_groups`).

    Attributes:
        placement: ``"colocated"`` or ``"disaggregated"``.
        world: devices (global ranks) of the run.
        train_ranks: global ranks of the train group (actor, ref, critic); ``range(0, T)``.
        rollout_ranks: global ranks of the rollout; ``range(T, world)`` when disaggregated,
            the same ``range(0, world)`` as ``train_ranks`` when colocated.
        roles: ``actor``, [``ref``], [``critic``], ``rollout`` -> :class:`RoleLayout` with ``dp``
            and ``world`` (the size of the role's group) filled in. A train role's rank ``i``
            in its layout is global rank ``i``; the rollout's layout rank ``j`` is global rank
            ``rollout_ranks[j]``.
    """

    placement: str
    world: int
    train_ranks: range
    rollout_ranks: range
    roles: dict

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"

    def group_of(self, rank: int) -> str:
        """``"train"``, ``"rollout"`` or (colocated) ``"both"`` for a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the {self.world} devices of the run")
        if not self.disaggregated:
            return "both"
        return "train" if rank in self.train_ranks else "rollout"

    def reshard_layouts(self):
        """The resharder's (train, rollout) :class:`~rlrecipes.core.resharder.Layout` pair (actor -> rollout)."""
        from .core.resharder import Layout

        a, r = self.roles["actor"], self.roles["rollout"]
        return (Layout(a.tp, a.pp, a.ep, a.dp, tuple(a.pp_layers) if a.pp_layers else None),
                Layout(r.tp, 1, r.ep, r.dp))

    def reshard_plan(self, specs, dtype_bytes: int = 2):
        """The resharder's plan for these groups (``placement`` passed through): hand it to
        ``Resharder(plan, "auto", bucket_mb=..., group=<a group over all world ranks>)`` and call
        ``reshard`` on every rank (train ranks with their shards, rollout ranks with ``{}``)."""
        from .core.resharder import plan_reshard

        train, rollout = self.reshard_layouts()
        return plan_reshard(train, rollout, specs, dtype_bytes, placement=self.placement)


def placement_groups(recipe: Recipe, world: Optional[int] = None) -> PlacementGroups:
    """The device groups of ``recipe`` on ``world`` devices (default: resources.nodes x devices_per_node).

    Colocated: one group, every role on ``range(world)``. Disaggregated: train roles on
    ``range(world - rollout_devices)``, the rollout on the last ``rollout_devices`` ranks; each
    role's DP from its own group. Raises :class:`PlanError` (naming the key and the fix) when the
    split or a layout's TP x PP x EP does not fit its group; the engine, memory and batch rules are
    ``build_plan``'s.
    """
    res = recipe.resources
    world = world if world is not None else res.nodes * res.devices_per_node
    roles, T, R, violations = _role_layouts(recipe, world)
    disagg = res.placement == "disaggregated"
    fits = _rollout_devices_that_fit(world, roles) if disagg else []
    for role in roles.values():
        if role.world < 1:
            continue
        k = role.tp * role.pp
        if role.world % k:
            rule, where = _where(role, world, fits, res.devices_per_node) if disagg else \
                ("TP*PP divides the world", f"{role.world} devices")
            violations.append(Violation(rule, f"{role.role}: TP{role.tp} x PP{role.pp} = {k} does not divide {where}"))
            continue
        role.dp = role.world // k
        if (role.dp * role.tp) % role.ep:
            violations.append(Violation("EP divides DP*TP", f"{role.role}: EP{role.ep} does not divide DP{role.dp} x "
                                                            f"TP{role.tp} = {role.dp * role.tp}"))
    if violations:
        raise PlanError(f"{recipe.name} on {world} devices ({res.placement}): "
                        + "; ".join(str(v) for v in violations))
    train_ranks = range(T)
    rollout_ranks = range(T, world) if disagg else range(world)
    return PlacementGroups(res.placement, world, train_ranks, rollout_ranks, roles)


def nearest_valid_nodes(recipe: Recipe, nodes: int, devices_per_node: int, keep_batch: bool = False,
                        limit: int = 4096) -> list[int]:
    """The closest node counts below and above ``nodes`` whose plan has no violation."""
    below = next((n for n in range(nodes - 1, 0, -1)
                  if build_plan(recipe, n, devices_per_node, keep_batch, _search=False).ok), None)
    above = next((n for n in range(nodes + 1, max(limit, 4 * nodes))
                  if build_plan(recipe, n, devices_per_node, keep_batch, _search=False).ok), None)
    return [n for n in (below, above) if n is not None]


class PlanError(RuntimeError):
    """Raised by `run` when the plan has violations (the message lists all of them). Exit code 1, as
    `plan` itself exits on violations; bad input (a recipe or override error) exits 2 in both."""

    code = 1


def format_violations(plan: Plan) -> str:
    lines = [f"{plan.recipe} on {plan.nodes} node(s) x {plan.devices_per_node} devices = {plan.world}: "
             f"{len(plan.violations)} rule(s) violated"]
    lines += [f"  - {v}" for v in plan.violations]
    if plan.nearest_valid_nodes:
        lines.append(f"  nearest valid node counts: {', '.join(map(str, plan.nearest_valid_nodes))}")
    elif all(v.rule in NODE_INDEPENDENT_RULES for v in plan.violations):
        lines.append("  no node count fixes these; change the recipe as each line says")
    else:
        lines.append("  no node count up to the search limit satisfies every rule; change the layout in the recipe")
    return "\n".join(lines)


def resolve(recipe: Recipe, plan: Plan) -> Recipe:
    """The recipe that runs: the plan's batch and node count written back (one source of truth).

    The driver writes this to ``config.yaml`` and hands it to every worker, so the batch a run
    trains on is the batch ``plan`` printed. Planning the resolved recipe again changes nothing.
    """
    if not plan.ok:
        raise PlanError(format_violations(plan))
    r = recipe.model_copy(deep=True)
    r.trainer.global_batch, r.trainer.mini_batch = plan.global_batch, plan.mini_batch
    r.resources.nodes, r.resources.devices_per_node = plan.nodes, plan.devices_per_node
    return r


def refuse_missing_engines(plan: Plan) -> None:
    """``run``'s check, before anything is placed: every engine the plan names must run here."""
    if plan.missing_here:
        err = PlanError("cannot run here:\n" + "\n".join(f"  - {m}" for m in plan.missing_here))
        err.code = 2  # this machine lacks an engine (install it); the layout itself is valid
        raise err
