"""The rules ``rlrecipes plan`` checks before any process starts: each role's layout against the
model, the world and its engine's capabilities; the model and engine checks; how devices split
between train and rollout; the reshard traffic estimates. ``plan.py`` assembles the plan from
these and ``plan_memory.py``'s memory models."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .engines.base import Capabilities
from .engines.registry import BACKENDS, capabilities, layout_problems, problems
from .models import ModelDims
from .plan_memory import DTYPE_BYTES
from .recipe import Recipe
from .recipe.roles import roles_of

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


def _engine_layout_violations(role: RoleLayout, dims: ModelDims, caps: Capabilities, recipe: Recipe) -> list[Violation]:
    """The engine's own layout rules (``Capabilities.layout_rules``), the same function the engine
    runs when it is built: a layout ``plan`` passes is one the engine accepts."""
    if role.world % (role.tp * role.pp):
        return []  # reported by the generic rules
    found = layout_problems(caps.name, role=role.role, dims=dims, tp=role.tp, pp=role.pp, ep=role.ep, etp=None,
                            world=role.world, device=recipe.resources.device, installed=False, recipe=recipe)
    return [Violation(f"engine {caps.name} accepts the {role.role} layout", p) for p in found]


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
    from .models import get_family

    version = recipe.rollout.inference.vllm_ascend_version or installed_vllm_ascend_version()
    if version is None:
        return None
    try:
        r = render(recipe.rollout.inference, version, is_mla=dims.is_mla, model_type=get_family(dims.family).model_type)
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
    built = roles_of(recipe, strict=False)  # the workers build exactly these
    if built.ref:
        r = recipe.ref.layout or a
        roles["ref"] = RoleLayout("ref", r.tp, r.pp, r.ep, None, T, r.pp_layers)
    if built.critic:
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
