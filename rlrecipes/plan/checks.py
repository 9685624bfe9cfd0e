"""The rules ``rlrecipes plan`` checks before any process starts, and the types they speak in.

Each role's layout against the model, its device group and its engine's declared
:class:`~rlrecipes.engines.base.Capabilities`; the model, engine and algorithm checks; how the
devices split between the train and rollout groups. Nothing here names an engine: what an engine
can do comes from its capabilities and hooks, read through ``engines.registry``. Which roles exist
comes from :func:`rlrecipes.recipe.roles.roles_of`, the rule the workers build by.

:mod:`.build` assembles the plan from these rules and :mod:`.memory`'s models;
:mod:`.placement` gives the workflow the device groups, checked by the same
:func:`divisibility_violations` as the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..core.parallel import EP_ACROSS_DP_RULE, EP_WITHIN_TP_RULE, LayoutProblem, ParallelLayout
from ..engines.base import Capabilities
from ..engines.registry import BACKENDS, capabilities, engines_that, inference_settings, layout_problems, problems
from ..models import ModelDims
from ..recipe import Recipe
from ..recipe.roles import role_layout, roles_of

# disaggregated placement: a layout that cannot fill its device group whatever the node count (the
# rollout group's size is fixed; the train group's is n x devices_per_node - rollout_devices)
ROLLOUT_SPLIT_RULE = "rollout TP*PP divides resources.rollout_devices"
TRAIN_SPLIT_RULE = "train TP*PP divides world - resources.rollout_devices at some node count"
INFERENCE_RULE = "inference settings supported by the rollout engine"
# long sequences (layout.sp; rules in .long_context)
SP_ENGINE_RULE = "engine splits sequences (layout.sp)"
SP_LAYOUT_RULE = "engine runs sequence parallelism with this layout"
SP_HEADS_RULE = "attention heads divide by TP*SP"
CONTEXT_RULE = "the longest sample fits the model's context"
KV_LONGEST_RULE = "KV cache holds the longest sample"
# Rules no node count can fix: the nearest-valid-node search is skipped when only these fail.
NODE_INDEPENDENT_RULES = {INFERENCE_RULE, "rollout PP = 1",
                          "engine keeps ref/critic on the actor layout", "engine serves the role here",
                          "engine has pipeline parallelism", "engine has expert parallelism",
                          "engine keeps EP inside the TP group", "GRPO needs a group per prompt",
                          "engine runs this model here", "routing replay has what it needs",
                          "reshard strategy fits the placement", ROLLOUT_SPLIT_RULE, TRAIN_SPLIT_RULE,
                          "multi-turn rollout has what it needs", "LoRA has what it needs",
                          SP_ENGINE_RULE, SP_LAYOUT_RULE, SP_HEADS_RULE, CONTEXT_RULE, KV_LONGEST_RULE}


@dataclass
class Violation:
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.detail}"


class PlanError(RuntimeError):
    """Raised by `run` when the plan has violations (the message lists all of them). Exit code 1, as
    `plan` itself exits on violations; bad input (a recipe or override error) exits 2 in both."""

    code = 1


def ranks_text(a: int, b: int) -> str:
    """Global ranks ``[a, b)`` as text: ``"a-(b-1)"``, or ``"a"`` for one rank."""
    return f"{a}-{b - 1}" if b - a > 1 else str(a)


def _engine_list(names: list[str], key: str, sep: str = ": ") -> str:
    """``"actor.engine: a or b"`` (the registered engines that would do), or ``"another engine"``."""
    return f"{key}{sep}{' or '.join(names)}" if names else "another engine"


# ---------------------------------------------------------------------------------------------
# one role's layout
# ---------------------------------------------------------------------------------------------
def _violations(found: list[LayoutProblem]) -> list[Violation]:
    return [Violation(p.rule, p.detail) for p in found]


def divisibility_violations(role: ParallelLayout, where: Optional[tuple[str, str]] = None) -> list[Violation]:
    """TP x PP (x SP) divides the role's devices, and EP divides DP x SP x TP (the experts are carved
    out of every rank of a pipeline stage, SP ranks included): :meth:`ParallelLayout.problems`.
    ``where`` = (rule, the role's device set and the fix) under disaggregated placement
    (:func:`where`); the default names the role's device count. Shared by :func:`layout_violations`
    and ``placement_groups``."""
    return _violations(role.problems(where=where))


def layout_violations(role: ParallelLayout, dims: ModelDims, caps: Capabilities,
                      where: Optional[tuple[str, str]] = None) -> list[Violation]:
    """Every generic rule for one role: the divisions and the EP rule as the engine places its EP
    groups (``Capabilities.ep_groups``; megatron's expert-TP is TP), the model's heads / experts /
    layers, and what the engine's capabilities allow (PP, EP)."""
    name = role.role
    ep_groups = caps.ep_groups if caps.ep_groups != "across_dp" or name != "rollout" else "stage"
    found = role.problems(ep_groups, etp=role.tp if ep_groups == "across_dp" else 1, where=where, engine=caps.name)
    engine_ep = [p for p in found if p.rule in (EP_ACROSS_DP_RULE, EP_WITHIN_TP_RULE)]
    v = _violations([p for p in found if p not in engine_ep] + role.model_problems(dims))
    if not caps.pipeline_parallel and name != "rollout" and role.pp != 1:
        with_pp = engines_that(lambda c: c.pipeline_parallel and "train" in c.roles)
        v.append(Violation("engine has pipeline parallelism",
                           f"{name}: PP{role.pp} with engine {caps.name}, which has none; use pp: 1 or an engine "
                           f"with pipeline parallelism ({_engine_list(with_pp, 'actor.engine')})"))
    if not caps.expert_parallel and role.ep != 1:
        v.append(Violation("engine has expert parallelism", f"{name}: EP{role.ep} with engine {caps.name}; use ep: 1"))
    return v + _violations(engine_ep)


def engine_layout_violations(role: ParallelLayout, dims: ModelDims, caps: Capabilities,
                             recipe: Recipe) -> list[Violation]:
    """The engine's own layout rules (``Capabilities.layout_rules``), the same function the engine
    runs when it is built: a layout ``plan`` passes is one the engine accepts."""
    device = recipe.resources.device
    if role.dp is None or (device != "auto" and device not in caps.devices):
        return []  # reported by the generic rules / engine_checks (the engine does not run there)
    found = layout_problems(caps.name, layout=role, dims=dims, etp=None, device=device, installed=False,
                            recipe=recipe)
    return [Violation(f"engine {caps.name} accepts the {role.role} layout", p) for p in found]


# ---------------------------------------------------------------------------------------------
# engines, model, algorithm
# ---------------------------------------------------------------------------------------------
def model_checks(recipe: Recipe, dims: ModelDims) -> list[Violation]:
    """Model features an engine's kernels cannot take on this device (e.g. vLLM CPU head sizes)."""
    out: list[Violation] = []
    device = recipe.resources.device
    for key, name, kind in (("actor.engine", recipe.actor.engine, "train"),
                            ("rollout.engine", recipe.rollout.engine, "rollout")):
        if name not in BACKENDS:
            continue
        caps = capabilities(name)
        if dims.is_mla:
            latent = dims.kv_lora_rank + dims.qk_rope_head_dim
            for dev, sizes in caps.mla_latent_sizes_by_device:
                if dev == device and latent not in sizes:
                    others = engines_that(lambda c: kind in c.roles and device in c.devices
                                      and latent in dict(c.mla_latent_sizes_by_device).get(device, (latent,)))
                    out.append(Violation("engine runs this model here",
                                         f"{key}={name} on {device}: its MLA kernels take a latent (kv_lora_rank + "
                                         f"qk_rope_head_dim) of {'/'.join(map(str, sizes))} only, this model's is "
                                         f"{latent}; use {_engine_list(others, key, '=')} on {device}"))
            continue
        for dev, low in caps.min_head_dim_by_device:
            if dev == device and dims.head_dim < low:
                out.append(Violation("engine runs this model here",
                                     f"{key}={name} on {device}: attention head size {dims.head_dim} < {low}, the "
                                     f"smallest its kernels take; use head_dim >= {low} (model.smoke.head_dim={low}) "
                                     f"or another engine"))
    return out


def engine_checks(recipe: Recipe, engines: dict[str, str]) -> tuple[list[Violation], list[str]]:
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


def capability_checks(recipe: Recipe, dims: ModelDims, roles: dict[str, ParallelLayout],
                      caps: dict[str, Capabilities]) -> list[Violation]:
    """What the recipe asks of its engines beyond layouts: routing replay, a critic, a reference
    or critic layout other than the actor's, a rollout without pipeline stages."""
    v: list[Violation] = []
    if recipe.algorithm.routing_replay:
        why = []
        if not dims.is_moe:
            why.append(f"the model ({dims.family}) has no experts to route")
        able = engines_that(lambda c: c.routing_replay)
        for key, name in (("actor.engine", recipe.actor.engine), ("rollout.engine", recipe.rollout.engine)):
            if name in BACKENDS and not capabilities(name).routing_replay:
                why.append(f"{key}={name} does not record/replay routing in this release"
                           + (f" (the {' and '.join(able)} engines do)" if able else ""))
        v += [Violation("routing replay has what it needs", f"algorithm.routing_replay: {w}") for w in why]
    train = caps.get("actor")
    if train is not None and "critic" in roles and not train.critic:
        critics = engines_that(lambda c: c.critic and "train" in c.roles)
        v.append(Violation("engine trains a critic",
                           f"algorithm.name={recipe.algorithm.name} trains a critic, which engine {train.name} does "
                           f"not (actor.engine); use {_engine_list(critics, 'actor.engine')} for PPO, or a "
                           f"critic-free algorithm (grpo, dapo)"))
    a = recipe.actor.layout
    if train is not None and not train.separate_ref_layout:
        for role in ("ref", "critic"):
            lay = getattr(recipe, role).layout
            if role in roles and lay is not None and (lay.tp, lay.pp, lay.ep, lay.sp) != (a.tp, a.pp, a.ep, a.sp):
                sp, asp = (f" SP{lay.sp}", f" SP{a.sp}") if (lay.sp, a.sp) != (1, 1) else ("", "")
                v.append(Violation("engine keeps ref/critic on the actor layout",
                                   f"{role}.layout TP{lay.tp} PP{lay.pp} EP{lay.ep}{sp} differs from the actor's "
                                   f"TP{a.tp} PP{a.pp} EP{a.ep}{asp} (engine {train.name}); set {role}.layout: null"))
    if recipe.actor.lora.enabled:
        import importlib.util

        rule = "LoRA has what it needs"
        for key, name in (("actor.engine", recipe.actor.engine), ("rollout.engine", recipe.rollout.engine)):
            role = "rollout" if key == "rollout.engine" else "train"
            able = engines_that(lambda c: c.lora and role in c.roles)
            if name in BACKENDS and not capabilities(name).lora:
                v.append(Violation(rule, f"actor.lora.rank={recipe.actor.lora.rank}: {key}={name} does not train or "
                                         f"apply LoRA adapters in this release; use {_engine_list(able, key)}, or "
                                         "actor.lora.rank=0"))
        for key, lay in (("actor.layout", recipe.actor.layout), ("rollout.layout", recipe.rollout.layout)):
            if lay.tp > 1 or lay.ep > 1:
                v.append(Violation(rule, f"actor.lora with {key} TP{lay.tp} EP{lay.ep}: adapters are trained and "
                                         f"applied on unsharded layers (FSDP / data parallelism only); set {key} "
                                         "tp: 1, ep: 1"))
        if importlib.util.find_spec("peft") is None:
            v.append(Violation(rule, "actor.lora needs PEFT, which is not installed: pip install -e '.[lora]'"))
    ro = recipe.rollout.layout
    if ro.pp != 1:
        v.append(Violation("rollout PP = 1", f"rollout.layout.pp is {ro.pp}; the rollout runs without pipeline stages"))
    return v


def longest_sample(recipe: Recipe) -> int:
    """Prompt + response tokens of the longest sample (``data.max_prompt_length`` + the longest response)."""
    return recipe.data.max_prompt_length + recipe.rollout.max_response_len


def response_key(recipe: Recipe) -> str:
    """The key that sets the longest response: one turn's limit, or a multi-turn trajectory's."""
    return "rollout.multi_turn.max_response_tokens" if recipe.rollout.multi_turn.enabled else \
        "rollout.sampling.max_new_tokens"


def sequence_checks(recipe: Recipe, dims: ModelDims, roles: dict[str, ParallelLayout],
                    caps: dict[str, Capabilities]) -> list[Violation]:
    """Long sequences: the longest sample against the model's context, and what ``layout.sp`` asks
    of the train engine (``Capabilities.sequence_parallel``). ``"ulysses"`` gives every SP rank whole
    attention heads (``heads % (tp * sp) == 0``; KV heads fewer than ``sp`` are repeated) and, in this
    release, runs at TP1 EP1 without routing replay. ``"context_parallel"``'s own needs (fused
    attention, megatron's chunking of rows) are the engine's layout rules."""
    v: list[Violation] = []
    longest = longest_sample(recipe)
    if longest > dims.max_position_embeddings:
        key = response_key(recipe)
        room = dims.max_position_embeddings - recipe.data.max_prompt_length
        fix = (f"lower {key} to {room} or less" if room > 0 else
               f"lower data.max_prompt_length below {dims.max_position_embeddings} (it alone fills the context)")
        v.append(Violation(CONTEXT_RULE, f"data.max_prompt_length + {key} = {recipe.data.max_prompt_length} + "
                                         f"{recipe.rollout.max_response_len} = {longest} tokens > the "
                                         f"{dims.max_position_embeddings} positions of the model "
                                         f"(max_position_embeddings); the rollout serves no longer sequences: {fix}"))
    train = caps.get("actor")
    if train is None:
        return v
    done: set[str] = set()
    for name, role in roles.items():
        if name == "rollout" or role.sp == 1:
            continue
        key = f"{name}.layout" if name == "actor" or getattr(recipe, name).layout is not None else "actor.layout"
        if key in done:  # a role on the actor's layout: reported once, under the actor's key
            continue
        done.add(key)
        kind = train.sequence_parallel
        if not kind:
            able = engines_that(lambda c: bool(c.sequence_parallel) and "train" in c.roles)
            v.append(Violation(SP_ENGINE_RULE, f"{key}.sp={role.sp}: engine {train.name} cannot split a sequence "
                                               f"over devices; set {key}.sp=1, or use "
                                               f"{_engine_list(able, 'actor.engine')}"))
            continue
        if kind != "ulysses":
            continue
        if role.tp > 1 or role.ep > 1:
            v.append(Violation(SP_LAYOUT_RULE, f"{key}.sp={role.sp} with TP{role.tp} EP{role.ep}: engine {train.name} "
                                               f"runs Ulysses sequence parallelism at TP1 EP1 in this release; set "
                                               f"{key}.tp=1 and {key}.ep=1 (SP takes their place for long "
                                               f"sequences), or {key}.sp=1"))
        if recipe.algorithm.routing_replay:
            v.append(Violation(SP_LAYOUT_RULE, f"{key}.sp={role.sp} with algorithm.routing_replay: engine "
                                               f"{train.name} does not split the recorded experts along the sequence "
                                               f"in this release; set algorithm.routing_replay=false or {key}.sp=1"))
        if dims.num_heads % (role.tp * role.sp):
            per = dims.num_heads // role.tp if dims.num_heads % role.tp == 0 else 0
            fits = [k for k in range(2, per + 1) if per % k == 0][:6]
            fix = f"use {key}.sp in {', '.join(map(str, fits))}" if fits else f"set {key}.sp=1"
            v.append(Violation(SP_HEADS_RULE, f"{key}.sp={role.sp}: the {dims.num_heads} attention heads do not "
                                              f"split over TP{role.tp} x SP{role.sp} = {role.tp * role.sp} ranks "
                                              f"(Ulysses gives every SP rank whole heads); {fix}"))
    return v


def rollout_inference(recipe: Recipe, dims: ModelDims) -> tuple[Optional[dict], list[Violation]]:
    """The rollout engine's rendering of ``rollout.inference`` (``Capabilities.inference_settings``:
    for vLLM, the vllm-ascend settings of the pinned or installed release), and the settings it
    cannot serve as violations. ``(None, [])`` when the engine renders nothing."""
    name = recipe.rollout.engine
    if name not in BACKENDS or not capabilities(name).inference_settings:
        return None, []
    rendered, found = inference_settings(name, inference=recipe.rollout.inference, dims=dims)
    return rendered, [Violation(INFERENCE_RULE, p) for p in found]


# ---------------------------------------------------------------------------------------------
# devices and roles
# ---------------------------------------------------------------------------------------------
def split_devices(recipe: Recipe, world: int) -> tuple[int, int, list[Violation]]:
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


def role_layouts(recipe: Recipe, world: int) -> tuple[dict[str, ParallelLayout], int, int, list[Violation]]:
    """Every role's layout over the devices of its group (:func:`~rlrecipes.recipe.roles.role_layout`),
    the two device counts, and the placement's own violations. The roles are
    :func:`~rlrecipes.recipe.roles.roles_of`'s."""
    T, R, violations = split_devices(recipe, world)
    built = roles_of(recipe, strict=False)  # the workers build exactly these
    names = ["actor"] + (["ref"] if built.ref else []) + (["critic"] if built.critic else [])
    roles = {name: role_layout(recipe, name, T) for name in names}
    roles["rollout"] = role_layout(recipe, "rollout", R)
    return roles, T, R, violations


def rollout_devices_that_fit(world: int, roles: dict[str, ParallelLayout]) -> list[int]:
    """Values of resources.rollout_devices in [1, world) with which every role's TP x PP (x SP) divides its group."""
    train = [r.model_parallel for r in roles.values() if r.role != "rollout"]
    roll = roles["rollout"].tp * roles["rollout"].pp
    return [R for R in range(1, world) if R % roll == 0 and all((world - R) % k == 0 for k in train)]


def where(role: ParallelLayout, world: int, fits: list[int], devices_per_node: int) -> tuple[str, str]:
    """(rule, the device set of a disaggregated role and the fix) for the TP*PP rule. The rule is
    node-independent when no node count can fix it (the nearest-node search is then skipped)."""
    k = role.model_parallel
    T, R = (role.world, world - role.world) if role.role != "rollout" else (world - role.world, role.world)
    near = sorted(fits, key=lambda x: (abs(x - R), x))[:2]
    fix = (f"set resources.rollout_devices={' or '.join(map(str, sorted(near)))}" if near else
           "no resources.rollout_devices fits; change the TP/PP sizes")
    if role.role == "rollout":
        return ROLLOUT_SPLIT_RULE, f"resources.rollout_devices={R}; {fix}, or a rollout.layout.tp that divides {R}"
    # n * devices_per_node - R = 0 (mod k) has a solution n iff gcd(devices_per_node, k) divides R
    rule = "TP*PP divides the world" if R % math.gcd(devices_per_node, k) == 0 else TRAIN_SPLIT_RULE
    sp = " x SP" if role.sp > 1 else ""
    return rule, (f"the {T} training devices (world {world} - resources.rollout_devices={R}); {fix}, "
                  f"or a {role.role}.layout whose TP x PP{sp} divides {T}")


def one_rank_sessions(r: Recipe, what: str) -> Optional[str]:
    """Why ``what`` (which continues samples through the rollout engine's turn sessions) cannot run on
    this rollout layout: the engine serves sessions on one rank per instance, the layout spans more."""
    lay = r.rollout.layout
    if (lay.tp == 1 and lay.ep == 1) or r.rollout.engine not in BACKENDS \
            or capabilities(r.rollout.engine).multi_turn_multi_rank:
        return None
    able = engines_that(lambda c: c.multi_turn_multi_rank and "rollout" in c.roles)
    return (f"rollout.engine={r.rollout.engine} runs {what} on one rank per instance in this release, and "
            f"rollout.layout is TP{lay.tp} EP{lay.ep}; set rollout.layout.tp=1 rollout.layout.ep=1"
            + (f", or rollout.engine={' or '.join(able)}" if able else ""))


__all__ = ["CONTEXT_RULE", "INFERENCE_RULE", "KV_LONGEST_RULE", "NODE_INDEPENDENT_RULES", "PlanError",
           "ROLLOUT_SPLIT_RULE", "SP_ENGINE_RULE", "SP_HEADS_RULE", "SP_LAYOUT_RULE", "TRAIN_SPLIT_RULE",
           "Violation", "capability_checks", "divisibility_violations", "engine_checks",
           "engine_layout_violations", "layout_violations", "model_checks", "one_rank_sessions", "ranks_text", "role_layouts",
           "rollout_devices_that_fit", "rollout_inference", "sequence_checks", "split_devices", "where"]
