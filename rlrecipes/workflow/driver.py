"""The driver: start the workers once, then only watch progress and collect metrics.

It writes the run folder (``config.yaml`` = the resolved recipe that runs, ``plan.json``,
``metrics.jsonl``, checkpoints), connects to Ray (embedded for ``--smoke``) and checks the
cluster's resources once, places one worker per device in a placement group, starts the
TransferDock (controller + per-node warehouses), and reports progress as events
(``workflow/events.py``) that the CLI renders. Sample data never passes through here.

Failure behaviour: a dead worker stops the run within seconds with a message naming the worker
and its stage (the last checkpoint is untouched: ``latest`` only moves after a complete save); a
lost node (Ray reports it dead, or its raylet refuses connections) is named with the worker ranks
it held, the last checkpoint and the ``--resume`` command; Ctrl-C stops the workers and Ray cleanly.
The driver keeps no metrics rows: they go to ``metrics.jsonl`` as they arrive, and the summary is
read back from it at the end.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import time
from pathlib import Path
from typing import Optional

import yaml

from .. import interrupts
from ..disk import no_space, no_space_message
from ..loggers import build as build_loggers
from ..metrics import MetricsError, MetricsWriter, RunSummary
from ..plan import Plan, refuse_missing_engines, resolve
from ..recipe import Recipe, resolve_path
from . import checkpoint
from .events import EventSink, Interrupted, Notice, RunError, RunFinished, RunStarted
from .progress import RowCollector, drain_rows, progress_actor
from .resume import interrupted_message, reconcile_rows, resumed_recipe
from .supervise import WorkerPlacement, resume_command, wait_for_workers, watch_run
from .worker import Worker


def _run_dir(recipe: Recipe, out: Optional[Path], resume: Optional[Path], smoke: bool) -> Path:
    if resume is not None:
        return resume
    if out is not None:
        return out
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(recipe.trainer.out_dir)
    return base / f"{recipe.name}{'-smoke' if smoke else ''}-{stamp}"


def _absolute_data(recipe: Recipe) -> Recipe:
    r = recipe.model_copy(deep=True)
    r.data.train_files = [str(resolve_path(recipe, f).resolve()) for f in recipe.data.train_files]
    for key in ("path", "tokenizer"):  # model folders: as given on the command line, from the cwd
        if getattr(r.model, key):
            setattr(r.model, key, str(Path(os.path.expanduser(getattr(r.model, key))).resolve()))
    return r


def run_recipe(recipe: Recipe, plan: Plan, on_event: EventSink, out: Optional[Path] = None,
               resume: Optional[Path] = None, embedded: bool = True, address: Optional[str] = None,
               overrides: Optional[list[str]] = None) -> Path:
    """Run ``recipe`` as ``plan`` resolved it: on an embedded local Ray (smoke), or on the existing
    cluster at ``address`` (None: RAY_ADDRESS or auto). With ``resume``, the run folder's own
    config.yaml is what runs, changed only by the resumable ``overrides``.

    Every input (files, folders, the run folder, a resume's config and checkpoint) is checked in one
    pass before anything is written, connected or placed."""
    import ray

    from .. import device as dev
    from ..cluster import (ClusterError, check_device_runtime, check_resources, cluster_resources, connect,
                           dead_ray_processes, ray_died, start_hint)
    from ..algos.spec import pooled_rollout
    from ..core.dock import TransferDock
    from ..inputs import run_inputs

    smoke = recipe.model.smoke is not None
    refuse_missing_engines(plan)  # before anything is written or placed
    recipe = resolve(recipe, plan)
    run_dir = _run_dir(recipe, out, resume, smoke)
    ckpt = None
    if resume is not None:
        recipe = resumed_recipe(run_dir, list(overrides or []))
        why = checkpoint.resume_problem(run_dir, notice=lambda text: on_event(Notice(text)))
        if why:
            raise RunError(why)
        ckpt = checkpoint.latest(run_dir)
    problems = run_inputs(recipe, run_dir=run_dir, resume=resume)
    if problems:
        raise RunError("nothing was started; fix these first:\n  - " + "\n  - ".join(problems))
    recipe = _absolute_data(recipe)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume is None:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
            (run_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=2))
            if recipe.folder is not None:
                (run_dir / "recipe_dir.txt").write_text(str(recipe.folder))
        if smoke and not (run_dir / "tokenizer").is_dir():
            from ..data import build_smoke_tokenizer

            build_smoke_tokenizer(run_dir / "tokenizer", vision=recipe.model.dims().has_vision)
    except OSError as e:
        if no_space(e):
            raise RunError(no_space_message(e.filename or run_dir, "the run folder")) from None
        raise RunError(f"{e.filename or run_dir}: cannot write the run folder ({e.strerror})") from None

    world = plan.world
    device_type = dev.resolve(recipe.resources.device)
    resource = dev.ray_resource(device_type)
    cpw = recipe.resources.cpus_per_worker
    started_here = embedded and not ray.is_initialized()
    try:
        connect(address, embedded=embedded, num_cpus=max(os.cpu_count() or 1, 1) if embedded else None)
    except ClusterError as e:
        if embedded:  # the embedded Ray did not start: no cluster to start
            raise
        raise ClusterError(f"{e}\n{start_hint(plan.nodes, recipe.folder)}") from None
    on_cpu = resource == "CPU"
    check_resources(cluster_resources(resource), plan.nodes if not on_cpu else 1,
                    plan.devices_per_node if not on_cpu else 0, recipe.folder, cpus_needed=world * cpw)
    check_device_runtime(device_type)

    writer = None
    workers: list = []
    docks: list = []
    pg = None
    progress = None
    rows: Optional[RowCollector] = None
    start = 0
    t0 = time.time()
    interrupted = False
    try:
        # one dock per step in flight: rollout may run max_staleness steps ahead of training.
        # One worker: the dock lives in its process (TransferDock.in_worker), as the controller and
        # the node warehouse would be its only peers; else Ray actors, reached over the dock's
        # channels (a blocked get holds its own channel's thread in the warehouse).
        n_docks = 1 + (recipe.algorithm.max_staleness if recipe.resources.placement == "disaggregated" else 0) \
            + (1 if pooled_rollout(recipe) else 0)  # a pooled rollout's carry-over dock
        docks = ([TransferDock.in_worker()] if world == 1 else
                 [TransferDock.ray(name=f"dock-{os.getpid()}-{i}", concurrency=max(64, 4 * world + 16),
                                   encryption=recipe.resources.dock_encryption)
                  for i in range(n_docks)])
        progress = progress_actor()
        pg, workers = place_workers(recipe, world, device_type, run_dir, docks, progress)
        pids = ray.get([w.pid.remote() for w in workers])
        nodes = ray.get([w.node_id.remote() for w in workers])
        in_worker = not hasattr(docks[0], "warehouse_nodes")
        (run_dir / "workers.json").write_text(json.dumps({
            "pids": pids, "nodes": nodes, "dock_backend": "in_worker" if in_worker else "ray",
            "dock_transport": "in_process" if in_worker else docks[0].transport,
            "dock_warehouse_nodes": nodes[:1] if in_worker else docks[0].warehouse_nodes}))
        where = WorkerPlacement(run_dir, nodes, resume_command(recipe, run_dir, embedded, address))
        addr = ray.get(workers[0].node_ip.remote())
        port = ray.get(workers[0].open_store.remote())
        info = wait_for_workers([w.setup.remote(addr, port, str(ckpt) if ckpt else None) for w in workers], progress, "setup",
                     where=where)
        start = info[0]["start_step"]
        total = recipe.trainer.steps
        if start >= total:
            raise RunError(f"{run_dir} is already at step {start} of {total}; pass --steps N with N > {start}")
        prior = None
        if resume is not None:
            prior, notes = reconcile_rows(run_dir, ckpt, start)
            for n in notes:
                on_event(Notice(f"metrics.jsonl: {n}"))
            (run_dir / "config.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
        writer = MetricsWriter(run_dir / "metrics.jsonl", rows=prior)
        writer.loggers = build_loggers(recipe.trainer.loggers, run_dir, project=recipe.name,
                                       config=recipe.model_dump(mode="json"), resume=resume is not None)
        on_event(RunStarted(recipe.name, recipe.algorithm.name, run_dir, world, plan.roles["actor"].describe(),
                            plan.roles["rollout"].describe(), info[0]["stages"], info[0]["data"], start, total))
        rows = RowCollector(progress, writer, recipe.reward.max_failure_rate)
        futures = [w.run.remote(start, total) for w in workers]
        watch_run(futures, rows, on_event, where)
    except KeyboardInterrupt:
        interrupted = True
        with interrupts.deferred():  # a second Ctrl-C does not cut the clean-up short
            on_event(Interrupted(run_dir))
            drain_rows(rows)  # every row the workers finished reaches metrics.jsonl
    except MetricsError as e:
        raise RunError(str(e), code=1) from None
    except Exception as e:  # Ray's own processes dying (an ActorDiedError, or a worker's death) are said as such
        dead = dead_ray_processes() if started_here else []
        if dead:
            raise ray_died(dead, e) from None
        raise
    finally:
        with interrupts.deferred():  # Ctrl-C now is recorded: the workers and Ray are stopped first
            _stop(writer, workers, docks, pg, started_here)
    if interrupted or interrupts.pending():
        raise interrupts.RunInterrupted(interrupted_message(run_dir, resume_command(recipe, run_dir, embedded, address)))
    with interrupts.deferred():
        summary = RunSummary.from_file(run_dir / "metrics.jsonl", first_step=start)  # this session's rows
        on_event(RunFinished(recipe.name, run_dir, summary, time.time() - t0))
    if interrupts.pending():
        raise interrupts.RunInterrupted(interrupted_message(run_dir, resume_command(recipe, run_dir, embedded, address)))
    bad = _bad_run(recipe, summary)
    if bad:
        raise RunError(bad, code=1)
    return run_dir


def _stop(writer, workers: list, docks: list, pg, started_here: bool) -> None:
    """Close metrics.jsonl, stop the workers, the docks and the placement group, and an embedded Ray."""
    import ray

    try:
        if writer is not None:
            writer.close()
    finally:  # a writer that fails to close still lets the workers and Ray stop
        for w in workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        for d in docks:
            try:
                d.shutdown()
            except Exception:
                pass
        if pg is not None:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:
                pass
        if started_here:
            ray.shutdown()


def place_workers(recipe: Recipe, world: int, device_type: str, run_dir: Path, docks: list, progress) -> tuple:
    """One :class:`Worker` actor per device, in a placement group (one bundle per worker, packed onto
    as few nodes as possible). Each actor reserves its device through ``device.ray_actor_options``,
    so Ray narrows the actor's visible devices to that one and the worker binds index 0
    (``Worker.binding``). Returns the placement group and the actors."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .. import device as dev
    from ..cluster import placement_group

    cpw = recipe.resources.cpus_per_worker
    pg = placement_group(world, dev.ray_resource(device_type), cpw)
    env = {"env_vars": {"RLRECIPES_DEVICE": device_type, "OMP_NUM_THREADS": str(max(1, int(cpw))),
                        "TOKENIZERS_PARALLELISM": "false"}}
    remote = ray.remote(Worker)
    config = recipe.model_dump(mode="json")
    return pg, [remote.options(num_cpus=cpw, max_restarts=0, runtime_env=env, **dev.ray_actor_options(device_type),
                           scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank))
                .remote(rank, world, config, str(run_dir.resolve()), docks, progress)
                for rank in range(world)]


def _bad_run(recipe: Recipe, summary: RunSummary) -> Optional[str]:
    """Why a finished run did not really train (trainer.fail_when_bad_share), or None."""
    if not summary.steps:
        return None
    limit = recipe.trainer.fail_when_bad_share
    skipped = summary.skipped / summary.steps
    if skipped >= limit:
        return (f"{skipped:.0%} of the steps skipped their update (non-finite loss or gradient; "
                f"trainer.fail_when_bad_share={limit}); lower trainer.lr or check the data. Metrics are in the run folder")
    errors, scored = summary.sums.get("reward/errors", 0), summary.sums.get("reward/samples", 0)
    if scored and errors / scored >= limit:
        return (f"the reward function raised on {errors / scored:.0%} of the samples (trainer.fail_when_bad_share="
                f"{limit}), so nothing was learned; first error: {summary.first_error}. Fix reward.fn")
    return None
