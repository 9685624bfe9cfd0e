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

from ..loggers import build as build_loggers
from ..metrics import MetricsError, MetricsWriter
from ..plan import Plan, refuse_missing_engines, resolve
from ..recipe import Recipe, resolve_path
from . import checkpoint
from .events import EventSink, Interrupted, Notice, Progress, RunError, RunFinished, RunStarted
from .worker import Worker


class _Progress:
    """Tiny actor: rank 0 reports its stage and each step's metrics row; the driver polls."""

    def __init__(self) -> None:
        self.step, self.stage_name, self.rows, self.t = -1, "setup", [], time.time()
        self.rollout_facts: dict[int, dict] = {}

    def stage(self, step: int, name: str) -> None:
        self.step, self.stage_name, self.t = step, name, time.time()

    def rollout(self, step: int, facts: dict) -> None:
        """Disaggregated placement: the rollout workers' figures of a step, merged into its row."""
        self.rollout_facts[step] = facts

    def metrics(self, row: dict) -> None:
        self.rows.append({**self.rollout_facts.pop(row.get("step"), {}), **row})

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
    r = recipe.model_copy(deep=True)
    r.data.train_files = [str(resolve_path(recipe, f).resolve()) for f in recipe.data.train_files]
    for key in ("path", "tokenizer"):  # model folders: as given on the command line, from the cwd
        if getattr(r.model, key):
            setattr(r.model, key, str(Path(os.path.expanduser(getattr(r.model, key))).resolve()))
    return r


#: what may change when a run continues (--resume): its length and its bookkeeping, not what it trains
RESUMABLE_KEYS = ("trainer.steps", "trainer.checkpoint_interval", "trainer.export_hf", "trainer.dock_timeout_s",
                  "trainer.loggers")


def resumed_recipe(run_dir: Path, overrides: list[str]) -> Recipe:
    """The run's own config.yaml plus the overrides a resume may change; anything else is refused."""
    from ..recipe import RecipeError, apply_overrides, parse_override, recipe_from_dict

    if not (run_dir / "config.yaml").is_file():
        raise RunError(f"--resume {run_dir}: not a run folder (no config.yaml); pass the folder a previous "
                       "`rlrecipes run` printed")
    refused = []
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if key not in RESUMABLE_KEYS:
            refused.append(text)
    if refused:
        raise RunError(f"--resume continues the run as its config.yaml says; it cannot change "
                       f"{', '.join(f'`{t}`' for t in refused)}. It takes only {', '.join(RESUMABLE_KEYS)}; "
                       "start a new run (with --out) to change anything else")
    cfg = run_dir / "config.yaml"
    try:
        saved = yaml.safe_load(cfg.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        raise RunError(f"{cfg}{f':{mark.line + 1}' if mark else ''}: damaged, not valid YAML "
                       f"({getattr(e, 'problem', e)}); restore it from a copy, or start a new run") from None
    if not isinstance(saved, dict):
        raise RunError(f"{cfg}: damaged (top level is not a mapping); restore it, or start a new run")
    origins: dict[str, str] = {}
    try:
        return recipe_from_dict(apply_overrides(saved, overrides, origins), str(cfg), origins)
    except RecipeError as e:
        raise RunError(f"--resume {run_dir}: its config.yaml does not validate:\n{e}") from None


def _reconcile(run_dir: Path, ckpt: Path, start: int) -> tuple[list[dict], list[str]]:
    """metrics.jsonl as the checkpoint says it should be: rows before ``start`` (from the file, or
    re-emitted from the checkpoint's own copy), nothing from ``start`` on. Returns the rows and notes."""
    from ..baseline import BaselineError, read_metrics

    f = run_dir / "metrics.jsonl"
    notes: list[str] = []
    have: list[dict] = []
    if f.is_file():
        try:
            have = read_metrics(run_dir, allow_partial_last=True)
        except BaselineError as e:
            raise RunError(f"{e}; fix or remove that line, then --resume again") from None
        text = f.read_bytes()
        if text and not text.endswith(b"\n"):
            notes.append("dropped a half-written last line (the run was stopped mid-write)")
    covered = {r["step"]: r for r in checkpoint.covered_rows(ckpt)}
    kept = {r["step"]: r for r in have if r["step"] < start}
    missing = sorted(s for s in covered if s not in kept and s < start)
    extra = sorted(r["step"] for r in have if r["step"] >= start)
    for s in missing:
        kept[s] = covered[s]
    if missing:
        notes.append(f"re-emitted rows of steps {_span(missing)} from checkpoint {ckpt.name}")
    if extra:
        notes.append(f"dropped rows of steps {_span(extra)}, which come after checkpoint {ckpt.name} and run again")
    return [kept[s] for s in sorted(kept)], notes


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


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
                           start_hint)
    from ..core.dock import TransferDock
    from ..inputs import run_inputs

    smoke = recipe.model.smoke is not None
    refuse_missing_engines(plan)  # before anything is written or placed
    recipe = resolve(recipe, plan)
    run_dir = _run_dir(recipe, out, resume, smoke)
    ckpt = None
    if resume is not None:
        recipe = resumed_recipe(run_dir, list(overrides or []))
        why = checkpoint.resume_problem(run_dir)
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

            build_smoke_tokenizer(run_dir / "tokenizer")
    except OSError as e:
        raise RunError(f"{e.filename or run_dir}: cannot write the run folder ({e.strerror})") from None

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
    check_device_runtime(device_type)

    writer = None
    workers: list = []
    docks: list = []
    pg = None
    progress = None
    rows: list = []
    t0 = time.time()
    try:
        # one dock per step in flight: rollout may run max_staleness steps ahead of training.
        # One worker: the dock lives in its process (TransferDock.in_worker), as the controller and
        # the node warehouse would be its only peers; else Ray actors, where a blocked get holds a
        # warehouse thread (room for every worker's get and writes at once).
        n_docks = 1 + (recipe.algorithm.max_staleness if recipe.resources.placement == "disaggregated" else 0)
        docks = ([TransferDock.in_worker()] if world == 1 else
                 [TransferDock.ray(name=f"dock-{os.getpid()}-{i}", concurrency=max(64, 4 * world + 16),
                                   transport=recipe.resources.dock_transport)
                  for i in range(n_docks)])
        progress = ray.remote(_Progress).options(num_cpus=0).remote()
        pg, workers = place_workers(recipe, world, device_type, run_dir, docks, progress)
        pids = ray.get([w.pid.remote() for w in workers])
        nodes = ray.get([w.node_id.remote() for w in workers])
        in_worker = not hasattr(docks[0], "warehouse_nodes")
        (run_dir / "workers.json").write_text(json.dumps({
            "pids": pids, "nodes": nodes, "dock_backend": "in_worker" if in_worker else "ray",
            "dock_transport": "in_process" if in_worker else docks[0].transport,
            "dock_warehouse_nodes": nodes[:1] if in_worker else docks[0].warehouse_nodes}))
        addr = ray.get(workers[0].node_ip.remote())
        port = ray.get(workers[0].open_store.remote())
        info = _wait([w.setup.remote(addr, port, str(ckpt) if ckpt else None) for w in workers], progress, "setup")
        start = info[0]["start_step"]
        total = recipe.trainer.steps
        if start >= total:
            raise RunError(f"{run_dir} is already at step {start} of {total}; pass --steps N with N > {start}")
        prior = None
        if resume is not None:
            prior, notes = _reconcile(run_dir, ckpt, start)
            for n in notes:
                on_event(Notice(f"metrics.jsonl: {n}"))
            (run_dir / "config.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
        writer = MetricsWriter(run_dir / "metrics.jsonl", rows=prior)
        writer.loggers = build_loggers(recipe.trainer.loggers, run_dir, project=recipe.name,
                                       config=recipe.model_dump(mode="json"), resume=resume is not None)
        on_event(RunStarted(recipe.name, recipe.algorithm.name, run_dir, world, plan.roles["actor"].describe(),
                            plan.roles["rollout"].describe(), info[0]["stages"], info[0]["data"], start, total))
        futures = [w.run.remote(start, total) for w in workers]
        _watch(futures, progress, writer, rows, on_event)
    except KeyboardInterrupt:
        _drain(progress, writer, rows)  # every row the workers finished reaches metrics.jsonl
        on_event(Interrupted(run_dir))
        raise
    except MetricsError as e:
        raise RunError(str(e), code=1) from None
    finally:
        if writer is not None:
            writer.close()
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
    on_event(RunFinished(recipe.name, run_dir, rows, time.time() - t0))
    bad = _bad_run(recipe, rows)
    if bad:
        raise RunError(bad, code=1)
    return run_dir


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


def _bad_run(recipe: Recipe, rows: list[dict]) -> Optional[str]:
    """Why a finished run did not really train (trainer.fail_when_bad_share), or None."""
    if not rows:
        return None
    limit = recipe.trainer.fail_when_bad_share
    skipped = sum(1 for r in rows if r.get("actor/skipped_step")) / len(rows)
    if skipped >= limit:
        return (f"{skipped:.0%} of the steps skipped their update (non-finite loss or gradient; "
                f"trainer.fail_when_bad_share={limit}); lower trainer.lr or check the data. Metrics are in the run folder")
    errors = sum(r.get("reward/errors") or 0 for r in rows)
    scored = sum(r.get("reward/samples") or 0 for r in rows)
    if scored and errors / scored >= limit:
        first = next((r["reward/first_error"] for r in rows if r.get("reward/first_error")), "")
        return (f"the reward function raised on {errors / scored:.0%} of the samples (trainer.fail_when_bad_share="
                f"{limit}), so nothing was learned; first error: {first}. Fix reward.fn")
    return None


def _drain(progress, writer, rows: list) -> None:
    """After Ctrl-C: write the rows rank 0 already sent (best effort; the workers may be gone)."""
    import ray

    if progress is None or writer is None:
        return
    try:
        _, _, new = ray.get(progress.poll.remote(len(rows)), timeout=5)
    except Exception:  # noqa: BLE001 - interrupted anyway
        return
    for row in new:
        writer.write(row)
        rows.append(row)


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
