"""What one worker holds for a run: data, reward, engines, resharder, TensorCache, the stage DAG.

Built once by :func:`build_context` after the process group is up. Engines come from
``engines/registry.py`` by the names the recipe gives (``actor.engine``, ``rollout.engine``) and
are used only through ``engines/base.py``; nothing here knows a backend.

Colocated ("integrated") workers (``role == "both"``): each holds the actor and reference model
(train layout), the critic for PPO, and the rollout engine (rollout layout) on its device, in one
torch.distributed world. Trained weights reach the rollout layout through the Resharder every step.

Disaggregated placement (``resources.placement``): ``role == "train"`` workers hold the train
roles and ``role == "rollout"`` workers only the rollout engine, each set in its own
torch.distributed world (``rank`` / ``world`` are within it), joined by the bridge group over which
the Resharder's ``cross_alltoallv`` moves each new policy version.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import device as dev
from ..algos import make_kl_controller
from ..algos.spec import Stage, get_algorithm
from ..core.resharder import Layout, Resharder, plan_reshard
from ..core.tensor_cache import TensorCache
from ..engines.base import EngineSpec, RolloutEngine, TrainEngine
from ..engines.registry import build_rollout_engine, build_train_engine
from ..metrics import StageTimer
from ..recipe import Recipe
from ..recipe.roles import roles_of


@dataclass
class Context:
    """Per-worker state shared by the stages (``workflow/stages.py``)."""

    rank: int
    world: int
    recipe: Recipe
    run_dir: Path
    device: torch.device
    dock: Any
    progress: Any
    tokenizer: Any = None
    dataset: Any = None
    sampler: Any = None
    reward_fn: Optional[Callable] = None
    eos_id: Optional[int] = None
    pad_id: int = 0
    data_skipped: int = 0
    actor: Optional[TrainEngine] = None
    ref: Optional[TrainEngine] = None
    critic: Optional[TrainEngine] = None
    rollout: Optional[RolloutEngine] = None
    use_ref: bool = False
    skip_old: bool = False
    n_mini: int = 1
    stages: list[Stage] = field(default_factory=list)
    kl_ctl: Any = None
    reshard_plan: Any = None
    resharder: Optional[Resharder] = None
    cache: Optional[TensorCache] = None
    timer: StageTimer = field(default_factory=StageTimer)
    step: int = -1
    stage: str = "init"
    role: str = "both"
    """both (colocated) | train | rollout (disaggregated placement)."""
    docks: list = field(default_factory=list)
    """The dock ring: step s uses ``docks[s % len(docks)]`` (max_staleness + 1 docks)."""
    version: int = 0
    """The policy version of the rollout weights (= the step whose update produced them)."""
    end_step: int = 0

    @property
    def leader(self) -> bool:
        """The worker that talks to the driver: rank 0 of the train (or colocated) world."""
        return self.rank == 0 and self.role != "rollout"

    def use_dock(self, step: int) -> None:
        self.dock = self.docks[step % len(self.docks)]

    _reporter: Optional["StageReporter"] = None

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


def load_data(ctx: Context) -> None:
    """Tokenizer, prompt rows, dataset, sampler and reward function (identical on every rank)."""
    from transformers import AutoTokenizer

    from ..data import PromptDataset, PromptSampler, load_prompt_rows, smoke_task_dataset
    from ..rewards import resolve_reward

    r = ctx.recipe
    tok_dir = r.model.tokenizer or (str(ctx.run_dir / "tokenizer") if r.model.smoke is not None else r.model.path)
    ctx.tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    if r.data.synthetic:
        rows = smoke_task_dataset(r.data.synthetic_size, seed=r.trainer.seed, task=r.data.synthetic,
                                  num_digits=r.data.synthetic_digits)
    else:
        rows = []
        for f in r.data.train_files:  # the driver made data paths absolute
            got, skipped = load_prompt_rows(f, prompt_key=r.data.prompt_key, answer_key=r.data.answer_key,
                                            on_malformed=r.data.on_malformed)
            rows += got
            ctx.data_skipped += skipped
    if not r.data.apply_chat_template:
        ctx.tokenizer.chat_template = None
    ctx.dataset = PromptDataset(rows, ctx.tokenizer, max_prompt_len=r.data.max_prompt_length)
    ctx.sampler = PromptSampler(len(ctx.dataset), seed=r.trainer.seed, shuffle=r.data.shuffle)
    ctx.reward_fn = resolve_reward(r.reward.fn)
    ctx.eos_id = ctx.tokenizer.eos_token_id
    ctx.pad_id = ctx.tokenizer.pad_token_id if ctx.tokenizer.pad_token_id is not None else ctx.eos_id


def _spec(ctx: Context, role: str, layout, **kw) -> EngineSpec:
    """The :class:`EngineSpec` of one role from the resolved recipe; ``kw`` sets the role's own fields."""
    r = ctx.recipe
    # a folder wins over smoke dimensions: `--smoke model.path=<folder>` runs the smoke task on those weights
    return EngineSpec(model=r.model.path or r.model.dims(), role=role,
                      tp=layout.tp, pp=layout.pp, ep=layout.ep, pp_layers=getattr(layout, "pp_layers", None),
                      device=ctx.device, dtype=r.model.dtype, seed=r.trainer.seed,
                      micro_batch_size=r.trainer.micro_batch,
                      max_tokens_per_micro_batch=r.trainer.max_tokens_per_micro_batch,
                      pad_token_id=ctx.pad_id, **kw)


def select_stages(recipe: Recipe, role: str, *, use_ref: bool, skip_old: bool) -> list[Stage]:
    """The algorithm's stages this worker runs: all of them colocated; under disaggregated placement
    the rollout workers' and the train workers' (``Stage.runs_on``)."""
    alg = recipe.algorithm
    return [s for s in get_algorithm(alg.name).stages(alg, use_ref=use_ref, skip_old=skip_old) if s.runs_for(role)]


def build_engines(ctx: Context) -> None:
    r, alg = ctx.recipe, ctx.recipe.algorithm
    spec = get_algorithm(alg.name)
    a = r.actor.layout
    if ctx.role != "train":
        ctx.rollout = build_rollout_engine(r.rollout.engine, _spec(
            ctx, "rollout", r.rollout.layout, inference=r.rollout.inference, routing_replay=alg.routing_replay))
    if ctx.role == "rollout":
        ctx.stages = select_stages(r, ctx.role, use_ref=False, skip_old=True)
        return
    ctx.actor = build_train_engine(r.actor.engine, _spec(
        ctx, "actor", a, lr=r.trainer.lr, weight_decay=r.actor.weight_decay, grad_clip=r.actor.grad_clip,
        recompute=r.actor.recompute, offload_optimizer=r.actor.offload_optimizer, routing_replay=alg.routing_replay))
    built = roles_of(r)  # the rule plan uses too
    ctx.use_ref = built.ref
    if ctx.use_ref:
        ctx.ref = build_train_engine(r.actor.engine, _spec(ctx, "ref", r.ref.layout or a))
    if built.critic:
        ctx.critic = build_train_engine(r.actor.engine, _spec(ctx, "critic", r.critic.layout or a, lr=r.critic.lr,
                                                               grad_clip=r.actor.grad_clip))
    ctx.n_mini = built.mini_batches
    ctx.skip_old = not built.old_pass
    ctx.stages = select_stages(r, ctx.role, use_ref=ctx.use_ref, skip_old=ctx.skip_old)
    ctx.kl_ctl = make_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target, alg.kl_horizon)


def build_resharder(ctx: Context, bridge_group=None, groups=None) -> None:
    """Plan the train -> rollout weight flow from the train engine's own ParamSpecs (colocated), or
    across the bridge between the two worlds (disaggregated, ``groups`` = ``plan.placement_groups``:
    both sides plan from the model's specs)."""
    r = ctx.recipe
    a, ro = r.actor.layout, r.rollout.layout
    pp_layers = tuple(a.pp_layers) if a.pp_layers else None
    ctx.cache = TensorCache(ctx.device, rank=ctx.rank)
    if ctx.role == "both":
        actor, roll = ctx.actor, ctx.rollout
        ctx.reshard_plan = plan_reshard(Layout(a.tp, a.pp, a.ep, actor.dp_size, pp_layers),
                                        Layout(ro.tp, 1, ro.ep, roll.dp_size), actor.param_specs(),
                                        dtype_bytes=torch.finfo(roll.weight_dtype).bits // 8)
        ctx.resharder = Resharder(ctx.reshard_plan, r.resharding.strategy, bucket_mb=r.resharding.bucket_mb,
                                  group=actor.reshard_group())
        return
    from ..models import param_specs

    dtype = dev.train_dtype(ctx.device, r.model.dtype)
    specs = param_specs(r.model.dims(), pp_layers=pp_layers)  # both sides plan from the same list
    ctx.reshard_plan = groups.reshard_plan(specs, dtype_bytes=torch.finfo(dtype).bits // 8)
    ctx.resharder = Resharder(ctx.reshard_plan, r.resharding.strategy, bucket_mb=r.resharding.bucket_mb,
                              group=bridge_group, dtype=dtype, device=ctx.device)
