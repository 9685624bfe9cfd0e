"""The driver: start the workers once, then only watch progress and collect metrics.

It writes the run folder (``config.yaml`` = the resolved recipe that runs, ``plan.json``,
``metrics.jsonl``, checkpoints), connects to Ray (embedded for ``--smoke``) and checks the
cluster's resources once, places one worker per device in a placement group, starts the
TransferDock (controller + per-node warehouses), and reports progress as events
(``workflow/events.py``) that the CLI renders. Sample data never passes through here.

Failure behaviour: a dead worker stops the run within seconds with a message naming the worker
and its stage (the last checkpoint is untouched: ``latest`` only moves after a complete save);
Ctrl-C stops the workers and Ray cleanly.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import time
from pathlib import Path
from typing import Optional

import yaml

from ..metrics import MetricsWriter
from ..plan import Plan, refuse_missing_engines, resolve
from ..recipe import Recipe, resolve_path
from . import checkpoint
from .events import EventSink, Interrupted, Progress, RunError, RunFinished, RunStarted
from .worker import Worker


class _Progress:
    """Tiny actor: rank 0 reports its stage and each step's metrics row; the driver polls."""

    def __init__(self) -> None:
        self.step, self.stage_name, self.rows, self.t = -1, "setup", [], time.time()

    def stage(self, step: int, name: str) -> None:
        self.step, self.stage_name, self.t = step, name, time.time()

    def metrics(self, row: dict) -> None:
        self.rows.append(row)

    def poll(self, since: int) -> tuple[int, str, list]:
        return self.step, self.stage_name, self.rows[since:]


def _run_dir(recipe: Recipe, out: Optional[Path], resume: Optional[Path], smoke: bool) -> Path:
    if resume is not None:
        return resume
    if out is not None:
        return out
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(recipe.trainer.out_dir)
    return base / f"{recipe.name}{'-smoke' if smoke else ''}-{stamp}"


def _absolute_data(recipe: Recipe) -> Recipe:
    files = [str(resolve_path(recipe, f).resolve()) for f in recipe.data.train_files]
    for f in files:
        if not Path(f).is_file():
            raise RunError(f"data.train_files: {f} does not exist; fix the path in the recipe or pass "
                           f"data.train_files=[...] (relative paths are relative to the recipe folder)")
    r = recipe.model_copy(deep=True)
    r.data.train_files = files
    return r


def run_recipe(recipe: Recipe, plan: Plan, on_event: EventSink, out: Optional[Path] = None,
               resume: Optional[Path] = None, embedded: bool = True, address: Optional[str] = None) -> Path:
    """Run ``recipe`` as ``plan`` resolved it: on an embedded local Ray (smoke), or on the existing
    cluster at ``address`` (None: RAY_ADDRESS or auto)."""
    import ray

    from .. import device as dev
    from ..cluster import ClusterError, check_resources, cluster_resources, connect, placement_group, start_hint
    from ..core.dock import TransferDock

    smoke = recipe.model.smoke is not None
    refuse_missing_engines(plan)  # before anything is written or placed
    recipe = _absolute_data(resolve(recipe, plan))
    run_dir = _run_dir(recipe, out, resume, smoke)
    ckpt = None
    if resume is not None:
        ckpt = checkpoint.latest(run_dir)
        if ckpt is None:
            raise RunError(f"--resume {run_dir}: no complete checkpoint (checkpoints/{checkpoint.CKPT_LATEST} "
                           "missing); set trainer.checkpoint_interval and run again")
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        recipe = Recipe.model_validate({**saved, "trainer": {**saved["trainer"], "steps": recipe.trainer.steps}})
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise RunError(f"--out {run_dir} already holds a run; pick a new folder or continue it with --resume {run_dir}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    (run_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=2))
    if recipe.folder is not None:
        (run_dir / "recipe_dir.txt").write_text(str(recipe.folder))
    if smoke and not (run_dir / "tokenizer").is_dir():
        from ..data import build_smoke_tokenizer

        build_smoke_tokenizer(run_dir / "tokenizer")

    world = plan.world
    device_type = dev.resolve(recipe.resources.device)
    resource = dev.ray_resource(device_type)
    cpw = recipe.resources.cpus_per_worker
    started_here = embedded and not ray.is_initialized()
    try:
        connect(address, embedded=embedded, num_cpus=max(os.cpu_count() or 1, 1) if embedded else None)
    except ClusterError as e:
        raise ClusterError(f"{e}\n{start_hint(plan.nodes, recipe.folder)}") from None
    on_cpu = resource == "CPU"
    check_resources(cluster_resources(resource), plan.nodes if not on_cpu else 1,
                    plan.devices_per_node if not on_cpu else 0, recipe.folder, cpus_needed=world * cpw)

    writer = None
    workers: list = []
    dock = None
    rows: list = []
    t0 = time.time()
    try:
        pg = placement_group(world, resource, cpw)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        dock = TransferDock.ray(name=f"dock-{os.getpid()}")
        progress = ray.remote(_Progress).options(num_cpus=0).remote()
        RayWorker = ray.remote(Worker)
        env = {"env_vars": {"RLRECIPES_DEVICE": device_type, "OMP_NUM_THREADS": str(max(1, int(cpw))),
                            "TOKENIZERS_PARALLELISM": "false"}}
        for rank in range(world):
            opts = dict(num_cpus=cpw, max_restarts=0, runtime_env=env,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank))
            if not on_cpu:
                opts["resources"] = {resource: 1}
            workers.append(RayWorker.options(**opts).remote(rank, world, recipe.model_dump(mode="json"),
                                                            str(run_dir.resolve()), dock, progress))
        pids = ray.get([w.pid.remote() for w in workers])
        (run_dir / "workers.json").write_text(json.dumps({"pids": pids}))
        addr = ray.get(workers[0].node_ip.remote())
        port = ray.get(workers[0].open_store.remote())
        info = _wait([w.setup.remote(addr, port, str(ckpt) if ckpt else None) for w in workers], progress, "setup")
        start = info[0]["start_step"]
        total = recipe.trainer.steps
        if start >= total:
            raise RunError(f"{run_dir} is already at step {start} of {total}; pass --steps N with N > {start}")
        writer = MetricsWriter(run_dir / "metrics.jsonl", truncate_after_step=start - 1 if resume else None)
        on_event(RunStarted(recipe.name, recipe.algorithm.name, run_dir, world, plan.roles["actor"].describe(),
                            plan.roles["rollout"].describe(), info[0]["stages"], info[0]["data"], start, total))
        futures = [w.run.remote(start, total) for w in workers]
        _watch(futures, progress, writer, rows, on_event)
    except KeyboardInterrupt:
        on_event(Interrupted(run_dir))
        raise
    finally:
        if writer is not None:
            writer.close()
        for w in workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        if dock is not None:
            try:
                dock.shutdown()
            except Exception:
                pass
        if started_here:
            ray.shutdown()
    on_event(RunFinished(recipe.name, run_dir, rows, time.time() - t0))
    return run_dir


def _wait(futures, progress, phase: str, tick=None, poll_s: float = 0.5) -> list:
    """Wait for every worker's call; ``tick()`` runs after each poll (and once more on a failure).

    The first failure stops the run with the root cause (see :func:`_root_cause`)."""
    import ray

    pending = list(futures)
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        for f in done:
            try:
                ray.get(f)
            except Exception as e:  # a worker raised or died: stop everything now
                if tick is not None:
                    tick()
                raise RunError(_root_cause(futures, f, e, progress, phase), code=1) from None
        if tick is not None:
            tick()
    return ray.get(futures)


def _root_cause(futures, f, e, progress, phase, grace_s: float = 3.0) -> str:
    """The first failure seen is often a survivor's broken collective; a dead worker is the cause.

    Waits up to ``grace_s`` for the other workers' outcomes and reports a dead worker first.
    """
    import ray

    failures = [(f, e)]
    others = [x for x in futures if x is not f]
    if others:
        done, _ = ray.wait(others, num_returns=len(others), timeout=grace_s)
        for d in done:
            try:
                ray.get(d)
            except Exception as e2:  # noqa: BLE001
                failures.append((d, e2))
    died = [(d, x) for d, x in failures if isinstance(x, (ray.exceptions.ActorDiedError, ray.exceptions.RayActorError))
            and not isinstance(x, ray.exceptions.RayTaskError)]
    f, e = died[0] if died else failures[0]
    msg = _worker_error(futures.index(f), e, progress, phase)
    if len(failures) > 1:
        msg += f" ({len(failures) - 1} other worker(s) stopped as a consequence)"
    return msg


def _worker_error(rank: int, e: Exception, progress, phase: str) -> str:
    import ray

    try:
        step, stage, _ = ray.get(progress.poll.remote(0), timeout=5)
    except Exception:
        step, stage = -1, phase
    text = str(e)
    found = re.findall(r"worker rank \d+ failed in stage '[^']*'.*", text)
    if found:
        return found[-1].strip()
    if isinstance(e, (ray.exceptions.ActorDiedError, ray.exceptions.RayActorError)):
        return (f"worker rank {rank} died (its process was killed or crashed) during stage {stage!r} of step "
                f"{step}; the last checkpoint is intact")
    return f"worker rank {rank} failed in {phase}, stage {stage!r} of step {step}: {text.splitlines()[-1] if text else e!r}"


def _watch(futures, progress, writer, rows: list, on_event: EventSink) -> None:
    """Collect rank 0's metrics rows into metrics.jsonl while the workers run; emit progress."""
    import ray

    def tick() -> None:
        step, stage, new = ray.get(progress.poll.remote(len(rows)))
        for row in new:
            writer.write(row)
            rows.append(row)
        on_event(Progress(step, stage, list(new)))

    _wait(futures, progress, "run", tick)
    tick()  # rows rank 0 sent just before returning
