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
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from .. import interrupts
from ..disk import no_space, no_space_message
from ..loggers import build as build_loggers
from ..metrics import MetricsError, MetricsWriter, RunSummary, reward_failure
from ..plan import Plan, refuse_missing_engines, resolve
from ..recipe import Recipe, resolve_path
from . import checkpoint
from .events import EventSink, Interrupted, Notice, Progress, RunError, RunFinished, RunStarted
from .worker import Worker


class _Progress:
    """Tiny actor: rank 0 reports its stage and each step's metrics row; the driver polls.

    A row stays here only until the driver has it: each poll says how many rows the driver holds
    so far (``taken``), those are dropped, and the rest are returned. An answer that never reached
    the driver (a poll cut short by Ctrl-C) is therefore sent again, and memory stays flat however
    long the run."""

    def __init__(self) -> None:
        self.step, self.stage_name, self.t = -1, "setup", time.time()
        self.pending: list[dict] = []
        self.taken = 0  # rows the driver confirmed, dropped here
        self.rollout_facts: dict[int, dict] = {}

    def stage(self, step: int, name: str) -> None:
        self.step, self.stage_name, self.t = step, name, time.time()

    def rollout(self, step: int, facts: dict) -> None:
        """Disaggregated placement: the rollout workers' figures of a step, merged into its row."""
        self.rollout_facts[step] = facts

    def metrics(self, row: dict) -> None:
        self.pending.append({**self.rollout_facts.pop(row.get("step"), {}), **row})

    def poll(self, taken: int) -> tuple[int, str, list]:
        """(step, stage, the rows after the first ``taken``); the first ``taken`` are dropped."""
        if taken > self.taken:
            del self.pending[:taken - self.taken]
            self.taken = taken
        return self.step, self.stage_name, list(self.pending)

    def where(self) -> tuple[int, str]:
        return self.step, self.stage_name


def _progress_actor():
    """The :class:`_Progress` actor, on the driver's node. Its calls (a row per step, a stage every
    0.1 s, a poll every 0.5 s) record no Ray task events, which nobody reads."""
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    quiet = ray.method(enable_task_events=False)
    for name in ("stage", "rollout", "metrics", "poll", "where"):
        quiet(getattr(_Progress, name))
    # on the driver's node (not soft: Ray 2.60 placed a soft-affine zero-CPU actor on another node):
    # a lost worker node must not take the run's progress and rows with it
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(_Progress).options(num_cpus=0, scheduling_strategy=here).remote()


class _Collector:
    """The driver's side of :class:`_Progress`: each row goes to metrics.jsonl as it arrives and
    only the count is kept (the end-of-run summary is read back from the file). A row whose reward
    calls failed above ``max_failure_rate`` stops the run once the rows are written."""

    def __init__(self, progress, writer: MetricsWriter, max_failure_rate: float = 1.0) -> None:
        self.progress, self.writer, self.taken = progress, writer, 0
        self.max_failure_rate = max_failure_rate

    def take(self, timeout: Optional[float] = None) -> tuple[int, str, list]:
        import ray

        step, stage, new = ray.get(self.progress.poll.remote(self.taken), timeout=timeout)
        for row in new:
            self.writer.write(row)
            self.taken += 1
        for row in new:
            why = reward_failure(row, self.max_failure_rate, self.writer.path)
            if why:
                raise RunError(why, code=1)
        return step, stage, new


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

            build_smoke_tokenizer(run_dir / "tokenizer")
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
    rows: Optional[_Collector] = None
    start = 0
    t0 = time.time()
    interrupted = False
    try:
        # one dock per step in flight: rollout may run max_staleness steps ahead of training.
        # One worker: the dock lives in its process (TransferDock.in_worker), as the controller and
        # the node warehouse would be its only peers; else Ray actors, where a blocked get holds a
        # warehouse thread (room for every worker's get and writes at once).
        n_docks = 1 + (recipe.algorithm.max_staleness if recipe.resources.placement == "disaggregated" else 0) \
            + (1 if pooled_rollout(recipe) else 0)  # a pooled rollout's carry-over dock
        docks = ([TransferDock.in_worker()] if world == 1 else
                 [TransferDock.ray(name=f"dock-{os.getpid()}-{i}", concurrency=max(64, 4 * world + 16),
                                   transport=recipe.resources.dock_transport,
                                   encryption=recipe.resources.dock_encryption)
                  for i in range(n_docks)])
        progress = _progress_actor()
        pg, workers = place_workers(recipe, world, device_type, run_dir, docks, progress)
        pids = ray.get([w.pid.remote() for w in workers])
        nodes = ray.get([w.node_id.remote() for w in workers])
        in_worker = not hasattr(docks[0], "warehouse_nodes")
        (run_dir / "workers.json").write_text(json.dumps({
            "pids": pids, "nodes": nodes, "dock_backend": "in_worker" if in_worker else "ray",
            "dock_transport": "in_process" if in_worker else docks[0].transport,
            "dock_warehouse_nodes": nodes[:1] if in_worker else docks[0].warehouse_nodes}))
        where = WorkerPlacement(run_dir, nodes, _resume_command(recipe, run_dir, embedded, address))
        addr = ray.get(workers[0].node_ip.remote())
        port = ray.get(workers[0].open_store.remote())
        info = _wait([w.setup.remote(addr, port, str(ckpt) if ckpt else None) for w in workers], progress, "setup",
                     where=where)
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
        rows = _Collector(progress, writer, recipe.reward.max_failure_rate)
        futures = [w.run.remote(start, total) for w in workers]
        _watch(futures, rows, on_event, where)
    except KeyboardInterrupt:
        interrupted = True
        with interrupts.deferred():  # a second Ctrl-C does not cut the clean-up short
            on_event(Interrupted(run_dir))
            _drain(rows)  # every row the workers finished reaches metrics.jsonl
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
        raise interrupts.RunInterrupted(_interrupted_message(run_dir, _resume_command(recipe, run_dir, embedded, address)))
    with interrupts.deferred():
        summary = RunSummary.from_file(run_dir / "metrics.jsonl", first_step=start)  # this session's rows
        on_event(RunFinished(recipe.name, run_dir, summary, time.time() - t0))
    if interrupts.pending():
        raise interrupts.RunInterrupted(_interrupted_message(run_dir, _resume_command(recipe, run_dir, embedded, address)))
    bad = _bad_run(recipe, summary)
    if bad:
        raise RunError(bad, code=1)
    return run_dir


def _interrupted_message(run_dir: Path, resume: str) -> str:
    """The one line Ctrl-C ends a run with: where to continue from, when a checkpoint exists."""
    last = checkpoint.latest(run_dir)
    if last is None:
        return f"interrupted; {run_dir} has no checkpoint to continue from (trainer.checkpoint_interval)"
    return f"interrupted; continue from its last checkpoint ({last.name}) with: {resume}"


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


def _drain(rows: Optional[_Collector]) -> None:
    """After Ctrl-C: write the rows rank 0 already sent (best effort; the workers may be gone)."""
    if rows is None:
        return
    try:
        rows.take(timeout=5)
    except MetricsError:
        raise
    except Exception:  # noqa: BLE001 - interrupted anyway
        return


#: seconds between two looks at the cluster's node table while the workers run
NODE_CHECK_S = 2.0
#: how long a worker's death that Ray attributes to its node waits for the GCS to mark the node dead
NODE_GRACE_S = 5.0


@dataclass
class WorkerPlacement:
    """Where the workers run, so that a lost node can be named with the ranks it took."""

    run_dir: Path
    nodes: list[str]
    """The Ray node id of each worker rank (``workers.json``'s ``nodes``)."""
    resume: str
    """The command that continues the run from its last checkpoint."""


def _resume_command(recipe: Recipe, run_dir: Path, embedded: bool, address: Optional[str]) -> str:
    cmd = f"rlrecipes run {recipe.name} --resume {shlex.quote(str(run_dir))}"
    if embedded:
        cmd += " --smoke"
    if address:
        cmd += f" --address {shlex.quote(address)}"
    return cmd


def _wait(futures, progress, phase: str, tick=None, poll_s: float = 0.5,
          where: Optional[WorkerPlacement] = None) -> list:
    """Wait for every worker's call; ``tick()`` runs after each poll (and once more on a failure).

    The first failure stops the run with the root cause (see :func:`_failure`). With ``where``, the
    cluster's node table is read every :data:`NODE_CHECK_S` seconds too: a node of the run that
    Ray reports dead stops the run at once, naming it and the worker ranks it held, even while the
    workers' calls have not failed yet."""
    import ray

    from ..cluster import lost_nodes

    pending = list(futures)
    next_check = time.monotonic() + NODE_CHECK_S
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        for f in done:
            try:
                ray.get(f)
            except Exception as e:  # a worker raised or died: stop everything now
                _last_tick(tick)
                raise RunError(_failure(futures, f, e, progress, phase, where), code=1) from None
        if where is not None and time.monotonic() >= next_check:
            next_check = time.monotonic() + NODE_CHECK_S
            lost = lost_nodes(where.nodes)
            if lost:
                _last_tick(tick)
                _settle(futures)
                raise RunError(_node_loss(where, lost, progress), code=1)
        if tick is not None:
            tick()
    return ray.get(futures)


def _last_tick(tick) -> None:
    """The rows that arrived before a failure still reach metrics.jsonl (best effort)."""
    if tick is None:
        return
    try:
        tick()
    except MetricsError:
        raise
    except Exception:  # noqa: BLE001 - the failure being reported matters more
        pass


def _failure(futures, f, e, progress, phase: str, where: Optional[WorkerPlacement]) -> str:
    """The message for a failed worker call: a lost node when Ray reports one of the run's nodes
    dead (waiting up to :data:`NODE_GRACE_S` when the actor's death names its node), else the root
    cause among the workers' failures."""
    from ..cluster import lost_nodes, unanswering_nodes, wait_for_lost_nodes

    lost = wait_for_lost_nodes(where.nodes, NODE_GRACE_S if _node_died(e) else 0.0) if where is not None else []
    failures = _settle(futures, (f, e))
    if where is not None and not lost:
        lost = lost_nodes(where.nodes)  # the grace may have let the GCS catch up
        if not lost:  # a raylet killed outright: the GCS learns it only from its health checks
            lost = unanswering_nodes([where.nodes[futures.index(d)] for d, x in failures if _died(x)])
    if lost:
        return _node_loss(where, lost, progress)
    msg = _root_cause(futures, failures, progress, phase)
    last = checkpoint.latest(where.run_dir) if where is not None else None
    if last is not None:  # the way on: the command that continues from the last checkpoint
        msg += f". Continue from its last checkpoint ({last.name}) with: {where.resume}"
    return msg


def _died(e: Exception) -> bool:
    """The actor itself is gone (its process or node), not a Python error raised in it."""
    import ray

    return isinstance(e, ray.exceptions.RayActorError) and not isinstance(e, ray.exceptions.RayTaskError)


def _node_died(e: Exception) -> bool:
    """Ray says the actor died with its node (rather than its process alone)."""
    if not _died(e):
        return False
    return bool(re.search(r"node (has )?died|node .*(dead|died|removed|terminated)", str(e), re.IGNORECASE))


def _node_loss(where: WorkerPlacement, lost: list, progress) -> str:
    import ray

    try:
        position = ray.get(progress.where.remote(), timeout=2)
    except Exception:  # noqa: BLE001 - the message stands without it
        position = None
    return node_loss_message(where, lost, position)


def node_loss_message(where: WorkerPlacement, lost: list, position: Optional[tuple[int, str]] = None) -> str:
    """Which nodes went (``cluster.LostNode``), with which worker ranks, where the run stood
    (``(step, stage)``), the last checkpoint and the command that continues from it."""
    at = f" during stage {position[1]!r} of step {position[0]}" if position else ""
    parts = []
    for node in lost:
        ranks = [r for r, n in enumerate(where.nodes) if n == node.node_id]
        held = (f"which held worker rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks
                else "which held none of the workers")
        parts.append(f"{node.describe()}, {held}")
    last = checkpoint.latest(where.run_dir)
    if last is not None:
        after = (f"The last checkpoint, {last}, is intact (checkpoints/{checkpoint.CKPT_LATEST} only moves after a "
                 f"complete save). Once the cluster has its nodes again, continue from it with: {where.resume}")
    else:
        after = ("No checkpoint had been written yet (trainer.checkpoint_interval), so the run starts again "
                 "once the cluster has its nodes again.")
    return (f"lost {'a node' if len(lost) == 1 else f'{len(lost)} nodes'} of the Ray cluster{at}: "
            f"{'; '.join(parts)}. The other workers were stopped. {after}")


def _settle(futures, first: Optional[tuple] = None, grace_s: float = 3.0) -> list[tuple]:
    """``first`` (a failed call and its error) and the other calls' failures that come within
    ``grace_s``. Each error is retrieved here, so Ray does not print it as unhandled at exit."""
    import ray

    failures = [first] if first is not None else []
    others = [x for x in futures if first is None or x is not first[0]]
    if others:
        done, _ = ray.wait(others, num_returns=len(others), timeout=grace_s)
        for d in done:
            try:
                ray.get(d)
            except Exception as e2:  # noqa: BLE001
                failures.append((d, e2))
    return failures


def _root_cause(futures, failures: list[tuple], progress, phase) -> str:
    """The first failure seen is often a survivor's broken collective; a dead worker is the cause.

    ``failures`` (:func:`_settle`): the first one, then the others that came within its grace; a
    dead worker is reported first.
    """
    died = [(d, x) for d, x in failures if _died(x)]
    f, e = died[0] if died else failures[0]
    msg = _worker_error(futures.index(f), e, progress, phase)
    if len(failures) > 1:
        msg += f" ({len(failures) - 1} other worker(s) stopped as a consequence)"
    return msg


def _worker_error(rank: int, e: Exception, progress, phase: str) -> str:
    import ray

    try:
        step, stage = ray.get(progress.where.remote(), timeout=5)
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


def _watch(futures, rows: _Collector, on_event: EventSink, where: Optional["WorkerPlacement"] = None) -> None:
    """Write rank 0's metrics rows into metrics.jsonl while the workers run; emit progress."""

    def tick() -> None:
        step, stage, new = rows.take()
        on_event(Progress(step, stage, new))

    _wait(futures, rows.progress, "run", tick, where=where)
    tick()  # rows rank 0 sent just before returning
