"""What one worker holds for a run, built once and typed: data, reward, engines, resharder,
TensorCache, the dock ring and the stage DAG (:func:`build_context`), plus the little that changes
per step.

Engines come from ``engines/registry.py`` by the names the recipe gives (``actor.engine``,
``rollout.engine``) and are used only through ``engines/base.py``; nothing here knows a backend.
Which models exist (reference, critic, the old-log-prob pass) is ``recipe.roles.roles_of``, the
rule ``plan`` uses too.

Colocated ("integrated") workers (:attr:`Role.BOTH`): each holds the actor and reference model
(train layout), the critic for PPO, and the rollout engine (rollout layout) on its device, in one
torch.distributed world. Trained weights reach the rollout layout through the Resharder every step.

Disaggregated placement (``resources.placement``): :attr:`Role.TRAIN` workers hold the train
roles and :attr:`Role.ROLLOUT` workers only the rollout engine, each set in its own
torch.distributed world (``rank`` / ``world`` are within it), joined by the bridge group over which
the Resharder's ``cross_alltoallv`` moves each new policy version.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from .. import device as dev
from ..algos import make_kl_controller
from ..algos.kl import KLController
from ..algos.spec import Stage, get_algorithm, pooled_rollout
from ..core.dock import TransferDock
from ..core.parallel import ParallelLayout
from ..core.resharder import Resharder, ReshardPlan, plan_reshard
from ..core.tensor_cache import TensorCache
from ..engines.base import EngineSpec, RolloutEngine, TrainEngine
from ..engines.registry import build_rollout_engine, build_train_engine
from ..metrics import StageTimer
from ..recipe import Recipe
from ..recipe.roles import Roles, role_layout, roles_of

if TYPE_CHECKING:
    import torch.distributed as dist
    from ray.actor import ActorHandle
    from transformers import PreTrainedTokenizerBase

    from ..agent import ToolRegistry
    from ..agent.loop import AgentLoop
    from ..data import PromptDataset, PromptSampler


class Role(str, enum.Enum):
    """What a worker does: everything (colocated), or one side of a disaggregated placement."""

    BOTH = "both"
    TRAIN = "train"
    ROLLOUT = "rollout"


@dataclass(frozen=True)
class WorkerData:
    """The prompts, their tokenizer and the reward: identical on every rank."""

    tokenizer: "PreTrainedTokenizerBase"
    dataset: "PromptDataset"
    sampler: "PromptSampler"
    reward_fn: Callable
    eos_id: Optional[int]
    pad_id: int
    skipped_malformed: int
    tools: Optional["ToolRegistry"] = None
    """Multi-turn rollouts: the tools (their schemas are in the prompts' chat template)."""

    def images(self, prompt_index) -> Optional[list]:
        """The images of prompts by dataset index (one shared object per prompt), or None when the
        dataset has none: how every stage turns the dock's ``prompt_index`` into pixels."""
        if not any("vision" in it for it in self.dataset.items):
            return None
        idx = prompt_index.tolist() if hasattr(prompt_index, "tolist") else list(prompt_index)
        return [self.dataset[int(i)].get("vision") for i in idx]


@dataclass(frozen=True)
class WorkerEngines:
    """The engines of a worker's role (None where the role has none) and which models exist."""

    roles: Roles
    rollout: Optional[RolloutEngine] = None
    actor: Optional[TrainEngine] = None
    ref: Optional[TrainEngine] = None
    critic: Optional[TrainEngine] = None


@dataclass
class Context:
    """A worker's setup (built once by :func:`build_context`) and its per-step position."""

    # -- who and where
    rank: int
    world: int
    role: Role
    recipe: Recipe
    run_dir: Path
    device: torch.device
    # -- built once
    data: WorkerData
    engines: WorkerEngines
    stages: tuple[Stage, ...]
    kl_ctl: KLController
    reshard_plan: ReshardPlan
    resharder: Resharder
    cache: TensorCache
    docks: tuple[TransferDock, ...]
    """The dock ring: step s uses ``docks[s % len(docks)]`` (max_staleness + 1 docks)."""
    progress: Optional["ActorHandle"]
    """The driver's progress actor (the leader reports stages and metrics rows to it)."""
    # -- per step
    dock: TransferDock = field(init=False)
    step: int = -1
    stage: str = "setup"
    version: int = 0
    """The policy version of the rollout weights (= the step whose update produced them)."""
    end_step: int = 0
    #: set by the step's all-gathered facts, the same on every train worker: end the loop after this step
    stop_after_step: bool = False
    timer: StageTimer = field(default_factory=StageTimer)
    synced_bytes: int = 0
    """Weight bytes this worker's rollout engine received since the step began (``reshard/bytes``)."""
    full_sync_bytes: int = 0
    """LoRA: what a full-weight sync would hand this worker's rollout engine (``reshard/full_bytes``)."""
    agent: Optional["AgentLoop"] = None
    """Multi-turn rollouts, on workers that generate: the agent loop (``rollout.multi_turn``)."""
    signals: Optional["dist.Store"] = None
    """The run's rendezvous store (disaggregated placement): a trainer announces a policy version
    there before sending it, so a partial rollout can stop between chunks to receive it."""
    carried_groups: int = 0
    """A pooled rollout's rank 0: the groups it left in :attr:`carry_dock` at its last step."""

    def __post_init__(self) -> None:
        self.dock = self.docks[0]
        self._reporter: Optional[StageReporter] = None

    # the setup's parts by their usual names
    tokenizer = property(lambda self: self.data.tokenizer)
    dataset = property(lambda self: self.data.dataset)
    sampler = property(lambda self: self.data.sampler)
    reward_fn = property(lambda self: self.data.reward_fn)
    eos_id = property(lambda self: self.data.eos_id)
    pad_id = property(lambda self: self.data.pad_id)
    actor = property(lambda self: self.engines.actor)
    ref = property(lambda self: self.engines.ref)
    critic = property(lambda self: self.engines.critic)
    rollout = property(lambda self: self.engines.rollout)
    n_mini = property(lambda self: self.engines.roles.mini_batches)

    @property
    def leader(self) -> bool:
        """The worker that talks to the driver: rank 0 of the train (or colocated) world."""
        return self.rank == 0 and self.role != Role.ROLLOUT

    @property
    def carry_dock(self) -> Optional[TransferDock]:
        """A pooled rollout's carry-over dock (the last of ``docks``, outside the ring): the groups
        still generating between two steps, which only rollout workers read and write."""
        return self.docks[-1] if pooled_rollout(self.recipe) else None

    def use_dock(self, step: int) -> None:
        ring = len(self.docks) - (1 if pooled_rollout(self.recipe) else 0)
        self.dock = self.docks[step % ring]

    def report(self, stage: str) -> None:
        """The leader tells the driver which stage runs (the live view and failure messages use it)."""
        self.stage = stage
        if self.leader and self.progress is not None:
            if self._reporter is None:
                self._reporter = StageReporter(self.progress)
            self._reporter.set(self.step, stage)


class StageReporter:
    """Sends the leader's (step, stage) to the driver's progress actor from a daemon thread, when it
    changed and at most every ``period_s``. The driver polls every 0.5 s, so a Ray call per stage
    (about 0.2 ms of the step loop each, six a step) bought nothing; the loop now only stores two
    fields. A stage that lasts longer than ``period_s`` is always shown."""

    def __init__(self, progress, period_s: float = 0.1):
        import threading

        self.progress, self.period_s = progress, period_s
        self.now: tuple[int, str] | None = None
        self.sent: tuple[int, str] | None = None
        self.wake = threading.Event()
        threading.Thread(target=self._loop, name="rlrecipes-stage-reporter", daemon=True).start()

    def set(self, step: int, stage: str) -> None:
        self.now = (step, stage)
        if stage in ("checkpoint", "export", "done"):  # rare and user-visible: at once
            self.wake.set()

    def _loop(self) -> None:
        while True:
            self.wake.wait(self.period_s)
            self.wake.clear()
            now = self.now
            if now is not None and now != self.sent:
                self.sent = now
                try:
                    self.progress.stage.remote(*now)
                except Exception:  # the driver is gone: nothing left to tell
                    return


def build_context(rank: int, world: int, role: Role, recipe: Recipe, run_dir: Path, device: torch.device,
                  docks: list[TransferDock], progress: Optional["ActorHandle"], *, bridge_group=None,
                  groups=None) -> Context:
    """Everything a worker holds, built once after its process group is up."""
    data = load_data(recipe, run_dir)
    engines = build_engines(recipe, role, device, data.pad_id)
    reshard_plan, resharder = build_resharder(recipe, role, device, engines, bridge_group, groups, world=world)
    alg = recipe.algorithm
    stages = select_stages(recipe, role, use_ref=engines.roles.ref, skip_old=not engines.roles.old_pass)
    ctx = Context(rank, world, role, recipe, run_dir, device, data, engines, tuple(stages),
                  make_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target, alg.kl_horizon),
                  reshard_plan, resharder, TensorCache(device, rank=rank), tuple(docks), progress)
    if engines.rollout is not None and data.tools is not None:
        ctx.agent = build_agent(recipe, data.tokenizer, data.tools)
    if recipe.actor.lora.enabled and engines.rollout is not None:
        ctx.full_sync_bytes = full_sync_bytes(recipe, role, engines, groups, world)
    return ctx


def full_sync_bytes(r: Recipe, role: Role, engines: WorkerEngines, groups, world: int) -> int:
    """The most bytes a full-weight sync would hand a rollout engine: the resharder's plan over
    the whole model's specs (with LoRA only the adapters move; this is what they are compared with)."""
    from ..models import param_specs

    specs = param_specs(r.model.dims(), pp_layers=_pp_layers(r))
    dtype_bytes = torch.finfo(engines.rollout.weight_dtype).bits // 8
    if role == Role.BOTH:
        plan = plan_reshard(*_colocated_layouts(r, world), specs, dtype_bytes=dtype_bytes)
    else:
        plan = groups.reshard_plan(specs, dtype_bytes=dtype_bytes)
    return max(int(plan.rollout_bytes(i)) for i in range(plan.world))  # the largest rollout shard


def _pp_layers(r: Recipe):
    """The actor's layer split (None: an even one), as its layout holds it."""
    return role_layout(r, "actor", 0).pp_layers or None


def _colocated_layouts(r: Recipe, world: int) -> tuple[ParallelLayout, ParallelLayout]:
    """The resharder's train and rollout layouts on the ``world`` shared devices: the actor's and
    the rollout's layouts, as ``plan`` checked them."""
    return role_layout(r, "actor", world), role_layout(r, "rollout", world)


def build_agent(r: Recipe, tokenizer, tools: "ToolRegistry") -> "AgentLoop":
    """The agent loop of a rollout worker: the tool format, a tool pool, the limits."""
    from ..agent import ToolExecutor, get_format
    from ..agent.loop import AgentLimits, AgentLoop
    from ..agent.setup import tool_format_name

    mt = r.rollout.multi_turn
    fmt = get_format(tool_format_name(r))
    fmt.check(tokenizer, tools.schemas())
    limits = AgentLimits(max_turns=mt.max_turns, max_tool_calls=mt.max_tool_calls,
                         max_response_tokens=mt.max_response_tokens, max_new_tokens=r.rollout.sampling.max_new_tokens,
                         max_observation_tokens=mt.max_observation_tokens)
    return AgentLoop(fmt, ToolExecutor(tools, max_workers=mt.tool_workers, timeout_s=mt.tool_timeout_s), tokenizer,
                     limits, eos_ids=[tokenizer.eos_token_id])


def vision_settings(r: Recipe):
    """A vision-language recipe's processor settings (``data.min_pixels`` / ``data.max_pixels``), which the
    dataset and every engine share; None for a text model."""
    dims = r.model.dims()
    if not dims.has_vision:
        return None
    from ..models.vision import settings_of

    return settings_of(dims, min_pixels=r.data.min_pixels, max_pixels=r.data.max_pixels)


def load_data(r: Recipe, run_dir: Path) -> WorkerData:
    """Tokenizer, prompt rows, dataset, sampler and reward function (identical on every rank)."""
    from transformers import AutoTokenizer

    from ..data import PromptDataset, PromptSampler, load_prompt_rows, smoke_task_dataset
    from ..models.files import FIX_TOKENIZER, reading
    from ..rewards import resolve_reward

    tok_dir = r.model.tokenizer or (str(run_dir / "tokenizer") if r.model.smoke is not None else r.model.path)
    with reading(tok_dir, "tokenizer folder", FIX_TOKENIZER):  # a damaged file is named, with the fix
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    skipped = 0
    vision = vision_settings(r)  # the processor every stage shares: patches, grids, image tokens
    if r.data.synthetic:
        rows = smoke_task_dataset(r.data.synthetic_size, seed=r.trainer.seed, task=r.data.synthetic,
                                  num_digits=r.data.synthetic_digits)
    else:
        rows = []
        for f in r.data.train_files:  # the driver made data paths absolute
            got, n_bad = load_prompt_rows(f, prompt_key=r.data.prompt_key, answer_key=r.data.answer_key,
                                          on_malformed=r.data.on_malformed, image_key=r.data.image_key)
            rows += got
            skipped += n_bad
    if not r.data.apply_chat_template:
        tokenizer.chat_template = None
    from ..agent.setup import build_tools

    tools = build_tools(r) if r.rollout.multi_turn.enabled else None
    dataset = PromptDataset(rows, tokenizer, max_prompt_len=r.data.max_prompt_length,
                            tools=tools.schemas() if tools is not None else None, vision=vision,
                            blank_images=r.data.blank_images)
    eos = tokenizer.eos_token_id
    return WorkerData(tokenizer, dataset, PromptSampler(len(dataset), seed=r.trainer.seed, shuffle=r.data.shuffle),
                      resolve_reward(r.reward.fn), eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                      else eos, skipped, tools)


def _spec(r: Recipe, device: torch.device, pad_id: int, role: str, **kw) -> EngineSpec:
    """The :class:`EngineSpec` of one role from the resolved recipe; ``kw`` sets the role's own fields.
    The layout's world (0 here) is the engine's process group, set by the engine (``ParallelLayout.on``)."""
    # a folder wins over smoke dimensions: `--smoke model.path=<folder>` runs the smoke task on those weights
    return EngineSpec(model=r.model.path or r.model.dims(), role=role, layout=role_layout(r, role, 0),
                      device=device, dtype=r.model.dtype, seed=r.trainer.seed,
                      micro_batch_size=r.trainer.micro_batch,
                      max_tokens_per_micro_batch=r.trainer.max_tokens_per_micro_batch,
                      pad_token_id=pad_id, freeze_vision_tower=r.actor.freeze_vision_tower,
                      vision=vision_settings(r), **kw)


def select_stages(recipe: Recipe, role: str, *, use_ref: bool, skip_old: bool) -> list[Stage]:
    """The algorithm's stages this worker runs: all of them colocated; under disaggregated placement
    the rollout workers' and the train workers' (``Stage.runs_on``)."""
    alg = recipe.algorithm
    return [s for s in get_algorithm(alg.name).stages(alg, use_ref=use_ref, skip_old=skip_old,
                                                      masked=recipe.rollout.multi_turn.enabled,
                                                      pooled=pooled_rollout(recipe),
                                                      vision=recipe.model.dims().has_vision) if s.runs_for(role)]


def build_engines(r: Recipe, role: Role, device: torch.device, pad_id: int) -> WorkerEngines:
    """The engines of ``role``: the rollout engine unless a train worker, the train roles unless a
    rollout worker (which models exist: ``roles_of``, the rule plan uses)."""
    alg = r.algorithm
    built = roles_of(r)

    lora = r.actor.lora if r.actor.lora.enabled else None

    def spec(name: str, **kw) -> EngineSpec:
        return _spec(r, device, pad_id, name, lora=lora if name in ("actor", "rollout") else None, **kw)

    rollout = None
    if role != Role.TRAIN:
        rollout = build_rollout_engine(r.rollout.engine, spec(
            "rollout", inference=r.rollout.inference, routing_replay=alg.routing_replay,
            max_model_len=r.data.max_prompt_length + r.rollout.max_response_len))
    if role == Role.ROLLOUT:
        return WorkerEngines(Roles(ref=False, critic=False, old_pass=False, mini_batches=built.mini_batches), rollout)
    actor = build_train_engine(r.actor.engine, spec(
        "actor", lr=r.trainer.lr, weight_decay=r.actor.weight_decay, grad_clip=r.actor.grad_clip,
        recompute=r.actor.recompute, offload_optimizer=r.actor.offload_optimizer, routing_replay=alg.routing_replay))
    if built.ref and lora is not None:  # LoRA: the reference policy is the actor's base, adapters off
        from ..engines.base import AdaptersOff

        ref = AdaptersOff(actor)
    else:
        ref = build_train_engine(r.actor.engine, spec("ref")) if built.ref else None
    critic = build_train_engine(r.actor.engine, spec("critic", lr=r.critic.lr,
                                                     grad_clip=r.actor.grad_clip)) if built.critic else None
    return WorkerEngines(built, rollout, actor, ref, critic)


def build_resharder(r: Recipe, role: Role, device: torch.device, engines: WorkerEngines, bridge_group=None,
                    groups=None, *, world: int) -> tuple[ReshardPlan, Resharder]:
    """Plan the train -> rollout weight flow from the train engine's own ParamSpecs (colocated), or
    across the bridge between the two worlds (disaggregated, ``groups`` = ``plan.placement_groups``:
    both sides plan from the model's specs)."""
    if role == Role.BOTH:
        actor, roll = engines.actor, engines.rollout
        plan = plan_reshard(*_colocated_layouts(r, world), actor.param_specs(),
                            dtype_bytes=torch.finfo(roll.weight_dtype).bits // 8)
        return plan, Resharder(plan, r.resharding.strategy, bucket_mb=r.resharding.bucket_mb,
                               group=actor.reshard_group())
    from ..models import param_specs

    dtype = dev.train_dtype(device, r.model.dtype)
    if r.actor.lora.enabled:  # only the adapters cross the bridge; both sides name them from the dims
        from ..models.lora_shapes import lora_shapes

        specs = param_specs(dict(lora_shapes(r.model.dims(), r.actor.lora)))
    else:
        specs = param_specs(r.model.dims(), pp_layers=_pp_layers(r))  # both sides plan from the same list
    plan = groups.reshard_plan(specs, dtype_bytes=torch.finfo(dtype).bits // 8)
    return plan, Resharder(plan, r.resharding.strategy, bucket_mb=r.resharding.bucket_mb, group=bridge_group,
                           dtype=dtype, device=device)
