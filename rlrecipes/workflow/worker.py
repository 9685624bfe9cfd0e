"""The Ray actor shell of one worker: process-group bring-up, then its own controller loop.

Every public method is called by the driver (``workflow/driver.py``). The work itself lives in
``context.py`` (what a worker holds), ``stages.py`` (what each stage does), ``loop.py`` (the
controller loop and metrics row) and ``checkpoint.py``. A failure anywhere is re-raised as a
:class:`StageFailure` naming the worker (rank), the stage and the step.

Rank conventions (docs/conventions.md): an engine's DP rank is ``rank // (tp * pp)``; within a
model-parallel group only the data leader reads from / writes to the dock.
"""
from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import device as dev
from ..disk import no_space, no_space_message
from ..agent.setup import sandbox_line
from ..recipe import Recipe
from . import checkpoint
from .context import Context, Role, build_context
from .loop import rollout_step, train_step
from .stages import receive_weights, reshard_weights, send_weights


class StageFailure(RuntimeError):
    """A stage failed on a worker; the message names the worker (rank) and the stage."""


class CheckpointRows:
    """The metrics rows the leader's next checkpoint covers (every row up to its step), in memory
    that does not grow with the run: only the rows since the last checkpoint are held; iterating
    streams the last checkpoint's own copy (``metrics.jsonl`` in its folder, the one ``--resume``
    reconciles from) and then those."""

    def __init__(self, prior: Path | None = None) -> None:
        self.prior, self.recent = prior, []

    def append(self, row: dict) -> None:
        self.recent.append(row)

    def saved(self, ckpt: Path | None) -> None:
        """``ckpt`` (the checkpoint just written) now holds every row: start over after it."""
        self.prior, self.recent = ckpt, []

    def __iter__(self):
        from ..metrics import read_rows

        prior = self.prior / "metrics.jsonl" if self.prior is not None else None
        if prior is not None and prior.is_file():
            yield from read_rows(prior)
        yield from self.recent

    def __bool__(self) -> bool:  # an iterable, not a list: never "empty" before it is read
        return True


class Worker:
    """Runs inside a Ray actor (see ``driver.py``)."""

    def __init__(self, rank: int, world: int, recipe_json: dict, run_dir: str, docks: list, progress) -> None:
        self.rank, self.world = rank, world
        self.recipe = Recipe.model_validate(recipe_json)
        self.run_dir = Path(run_dir)
        # a placeholder from TransferDock.in_worker() becomes the dock in this process
        self.docks = [d.build() if hasattr(d, "build") else d for d in docks]
        self.progress = progress
        self.ctx: Context | None = None
        self._store = None

    # ------------------------------------------------------------------ bring-up
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def open_store(self) -> int:
        """Rank 0 hosts the rendezvous store on a port the OS picks atomically (no bind race)."""
        self._store = dist.TCPStore("0.0.0.0", 0, self.world, is_master=True, wait_for_workers=False,
                                    timeout=self._timeout())
        return self._store.port

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def binding(self) -> dict:
        """The device this worker drives: Ray reserved one for it (``device.ray_actor_options``) and
        narrowed the visible devices to it, so its index in this process is 0 (``LOCAL_RANK``, which
        vLLM's external launcher and vllm-ascend bind as ``{device}:{LOCAL_RANK}``), whatever its
        rank on the node."""
        import ray

        device_type = dev.resolve(self.recipe.resources.device)
        assigned: list = []
        if ray.is_initialized() and device_type != "cpu":
            assigned = list(ray.get_runtime_context().get_accelerator_ids().get(dev.ray_resource(device_type), []))
        env = dev.VISIBLE_DEVICES_ENV[device_type]
        return {"rank": self.rank, "device_type": device_type, "assigned": assigned,
                "visible": os.environ.get(env) if env else None,
                "local_rank": dev.bound_device_index(device_type, assigned)}

    def _timeout(self) -> timedelta:
        return timedelta(seconds=max(60.0, self.recipe.trainer.dock_timeout_s))

    def _fail(self, e: Exception, where: str) -> StageFailure:
        return StageFailure(f"worker rank {self.rank} failed in {where}: {type(e).__name__}: {e}")

    def setup(self, master_addr: str, master_port: int, resume_from: str | None = None) -> dict:
        try:
            return self._setup(master_addr, master_port, resume_from)
        except Exception as e:
            stage = self.ctx.stage if self.ctx is not None else "setup"
            raise self._fail(e, f"stage {'setup' if stage == 'init' else stage!r}") from e

    def _setup(self, master_addr: str, master_port: int, resume_from: str | None) -> dict:
        # torch's DeviceMesh deprecation notice for flattened dims is not actionable for users
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        r = self.recipe
        binding = self.binding()
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world), LOCAL_RANK=str(binding["local_rank"]))
        device_type = binding["device_type"]
        torch.set_num_threads(max(1, int(r.resources.cpus_per_worker)))
        device = dev.torch_device(device_type, binding["local_rank"])
        dev.set_device(device)
        store = self._store or dist.TCPStore(master_addr, master_port, self.world, is_master=False,
                                             timeout=self._timeout())
        role, rank, world, bridge, groups, signals = Role.BOTH, self.rank, self.world, None, None, None
        if r.resources.placement == "disaggregated":
            # two worlds (train ranks first, then rollout ranks) joined by the bridge group
            from ..core.resharder.bridge import bridge_group
            from ..plan import placement_groups

            groups = placement_groups(r, self.world)
            role = Role(groups.group_of(self.rank))
            mine = groups.train_ranks if role == Role.TRAIN else groups.rollout_ranks
            rank, world = mine.index(self.rank), len(mine)
            bridge = bridge_group(store, self.rank, self.world, self._timeout())
            signals = dist.PrefixStore("signals/", store)  # both worlds see it (Context.signals)
            store = dist.PrefixStore(f"{role.value}/", store)
        dist.init_process_group(dev.comm_backend(device_type), store=store, rank=rank, world_size=world,
                                timeout=self._timeout())
        dev.manual_seed_all(r.trainer.seed)
        ctx = self.ctx = build_context(rank, world, role, r, self.run_dir, device, self.docks, self.progress,
                                       bridge_group=bridge, groups=groups)
        if signals is not None:
            ctx.signals = signals
        if role == Role.ROLLOUT:
            start_step = self._rollout_start(resume_from)
        else:
            start_step = checkpoint.load(ctx, Path(resume_from)) if resume_from else 0
        self.rows = CheckpointRows(Path(resume_from) if resume_from else None)  # leader: its checkpoints' rows
        ctx.version = start_step
        if role == Role.BOTH:
            reshard_weights(ctx)  # rollout weights = actor weights before the first rollout
        elif role == Role.TRAIN:
            send_weights(ctx)  # the first version crosses the bridge
        else:
            receive_weights(ctx)
        ctx.synced_bytes = 0  # reshard/bytes: each step's own sync (this first one is setup)
        if role == Role.ROLLOUT:
            return {"rank": self.rank, "role": role.value, "device": str(device), "start_step": start_step}
        return {"rank": self.rank, "device": str(device), "start_step": start_step,
                "data": {"prompts": len(ctx.dataset), "dropped_too_long": ctx.dataset.n_dropped_too_long,
                         "chat_joined": ctx.dataset.n_chat_joined,
                         "skipped_malformed": ctx.data.skipped_malformed,
                         "sandbox": sandbox_line(ctx.data.tools)},
                "skip_old_log_prob": not ctx.engines.roles.old_pass, "stages": [s.name for s in ctx.stages],
                "timed": [s.reports_as for s in ctx.stages],  # each stage's name in timing_s/*
                "role": role.value, "reshard_min_bytes": ctx.reshard_plan.min_bytes(self.rank)}

    def _rollout_start(self, resume_from: str | None) -> int:
        """A rollout worker resumes where the checkpoint's trainer state says (its sampler too)."""
        if not resume_from:
            return 0
        state = checkpoint.trainer_state(Path(resume_from))
        self.ctx.sampler.load_state_dict(state["sampler"])
        return int(state["next_step"])

    # ------------------------------------------------------------------ the controller loop
    def run(self, start_step: int, end_step: int) -> dict:
        ctx = self.ctx
        ctx.end_step = end_step
        if ctx.role == Role.ROLLOUT:
            try:
                for step in range(start_step, end_step):
                    ctx.step = step
                    rollout_step(ctx, step)
            except Exception as e:
                raise self._fail(e, f"stage {ctx.stage!r} of step {ctx.step}") from e
            return {"rank": self.rank, "last": {}}
        last: dict = {}
        for step in range(start_step, end_step):
            ctx.step = step
            try:
                last = train_step(ctx, step)
                if ctx.stop_after_step:  # reward.max_failure_rate: every train worker stops here, unsaved
                    ctx.report("done")
                    self._rows_delivered()
                    return {"rank": self.rank, "last": last}
                k = self.recipe.trainer.checkpoint_interval
                if ctx.leader and k:
                    self.rows.append(last)
                if k and (step + 1) % k == 0:
                    ctx.report("checkpoint")
                    self._require_finite(step, "checkpointed")
                    checkpoint.save(ctx, step, self.rows)
                    if ctx.leader:
                        self.rows.saved(checkpoint.latest(self.run_dir))
            except Exception as e:
                raise self._fail(e, f"stage {ctx.stage!r} of step {step}") from e
        lora = self.recipe.actor.lora.enabled
        if (self.recipe.trainer.export_hf or lora) and end_step > start_step:
            ctx.report("export")
            try:
                self._require_finite(end_step - 1, "exported")
            except RuntimeError as e:
                raise self._fail(e, "export") from e
            folder = self.run_dir / "actor_adapter"
            try:
                if lora:  # the adapters (a PEFT folder), always; the merged model with trainer.export_hf
                    ctx.actor.export_adapter(folder)
                if self.recipe.trainer.export_hf:
                    folder = self.run_dir / "actor_hf"
                    self.export_hf(folder)
            except Exception as e:
                if not no_space(e):
                    raise
                raise self._fail(OSError(no_space_message(folder, "the trained model")), "export") from e
        ctx.report("done")
        self._rows_delivered()
        return {"rank": self.rank, "last": last}

    def _rows_delivered(self) -> None:
        """Rank 0's rows went to the progress board as one-way calls; one answered call after them
        (Ray runs one caller's calls to an actor in order) means the board holds them all before
        this worker returns, so the driver's last poll finds every row."""
        if self.ctx.leader and self.ctx.progress is not None:
            import ray

            ray.get(self.ctx.progress.where.remote())

    def _require_finite(self, step: int, what: str) -> None:
        ok = torch.tensor([1.0 if self.ctx.actor.weights_finite() else 0.0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 0:
            raise RuntimeError(f"the actor's weights hold nan/inf after step {step}, so they are not {what} (the "
                               "last checkpoint is kept); lower trainer.lr or set actor.grad_clip")

    def export_hf(self, folder: Path) -> None:
        """The trained actor as an HF folder (safetensors + config + tokenizer): collective."""
        self.ctx.actor.onload()
        self.ctx.actor.export_hf(folder)
        if self.rank == 0:
            self.ctx.tokenizer.save_pretrained(str(folder))
        dist.barrier()

    def shutdown(self) -> None:
        if self.ctx is not None and self.ctx.agent is not None:
            self.ctx.agent.executor.close(wait=False)  # a tool still running past its timeout is not waited for
        if dist.is_initialized():
            dist.destroy_process_group()
