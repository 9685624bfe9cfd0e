"""The driver: start the workers once, then only watch progress and collect metrics.

It writes the run folder (``config.yaml``, ``plan.json``, ``metrics.jsonl``, checkpoints), connects
to Ray (embedded for ``--smoke``), refuses a cluster that is too small before placing anything,
places one worker per device in a placement group, starts the TransferDock (controller +
per-node warehouses), and renders a live view (step, stage, reward, TPS/card) from a small
progress actor that rank 0 reports to. Sample data never passes through here.

Failure behaviour: a dead worker stops the run within seconds with a message naming the worker
and its stage (the last checkpoint is untouched: ``latest`` only moves after a complete save);
Ctrl-C stops the workers and Ray cleanly.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Optional

import yaml
from rich.live import Live
from rich.table import Table

from ..cli._common import CLIError, console, err_console
from ..metrics import MetricsWriter
from ..recipe import Recipe, resolve_path
from .worker import CKPT_LATEST, Worker


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
            raise CLIError(f"data.train_files: {f} does not exist; fix the path in the recipe or pass "
                           f"data.train_files=[...] (relative paths are relative to the recipe folder)")
    r = recipe.model_copy(deep=True)
    r.data.train_files = files
    return r


def _latest_checkpoint(run_dir: Path) -> Optional[Path]:
    marker = run_dir / "checkpoints" / CKPT_LATEST
    if not marker.is_file():
        return None
    ckpt = run_dir / "checkpoints" / marker.read_text().strip()
    return ckpt if ckpt.is_dir() else None


def _view(recipe: Recipe, step: int, stage: str, rows: list, total: int, t0: float) -> Table:
    t = Table(title=f"{recipe.name} · {recipe.algorithm.name} · {time.time() - t0:.0f}s", show_edge=False)
    for c in ("step", "stage", "reward", "TPS/card", "step s", "loss", "kl"):
        t.add_column(c, justify="right")
    last = rows[-1] if rows else {}
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    t.add_row(f"{max(step, 0) + 1}/{total}", stage, fmt(last.get("reward/mean"), ".3f"),
              fmt(last.get("perf/tps_per_card"), ".1f"), fmt(last.get("timing_s/step"), ".2f"),
              fmt(last.get("actor/loss"), ".4f"), fmt(last.get("actor/kl"), ".4f"))
    return t


def run_recipe(recipe: Recipe, plan, out: Optional[Path] = None, resume: Optional[Path] = None,
               quiet: bool = False, cluster: str = "embedded") -> Path:
    import ray

    from .. import device as dev
    from ..cluster import check_resources, cluster_resources, connect, placement_group
    from ..core.dock import TransferDock

    smoke = recipe.model.smoke is not None
    if recipe.actor.engine != "native" or recipe.rollout.engine != "native":
        raise CLIError(f"actor.engine={recipe.actor.engine}, rollout.engine={recipe.rollout.engine}: this build "
                       "ships the native engines only (HF + FSDP2 + DTensor TP/EP, batched KV-cache sampler); the "
                       "megatron-core and vLLM / vllm-ascend adapters are not written yet. Run with "
                       "actor.engine=native rollout.engine=native, or --dry-run to print the plan and launch commands.")
    recipe = _absolute_data(recipe)
    run_dir = _run_dir(recipe, out, resume, smoke)
    ckpt = None
    if resume is not None:
        ckpt = _latest_checkpoint(run_dir)
        if ckpt is None:
            raise CLIError(f"--resume {run_dir}: no complete checkpoint (checkpoints/{CKPT_LATEST} missing); "
                           "set trainer.checkpoint_interval and run again")
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        recipe = Recipe.model_validate({**saved, "trainer": {**saved["trainer"], "steps": recipe.trainer.steps}})
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise CLIError(f"--out {run_dir} already holds a run; pick a new folder or continue it with --resume {run_dir}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    (run_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=2))
    if recipe.folder is not None:
        (run_dir / "recipe_dir.txt").write_text(str(recipe.folder))
    if smoke and not (run_dir / "tokenizer").is_dir():
        from ..data import build_smoke_tokenizer

        build_smoke_tokenizer(run_dir / "tokenizer")

    world = plan.world
    dtype = dev.resolve(recipe.resources.device)
    resource = dev.ray_resource(dtype)
    cpw = recipe.resources.cpus_per_worker
    started_here = False
    if cluster == "embedded":
        started_here = not ray.is_initialized()
        connect(embedded=True, num_cpus=max(os.cpu_count() or 1, 1))
    found = cluster_resources(resource)
    check_resources(found, plan.nodes if resource != "CPU" else 1,
                    plan.devices_per_node if resource != "CPU" else 0, recipe.folder,
                    cpus_needed=world * cpw)

    writer = None
    workers: list = []
    dock = None
    t0 = time.time()
    try:
        pg = placement_group(world, resource, cpw)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        dock = TransferDock.ray(name=f"dock-{os.getpid()}")
        progress = ray.remote(_Progress).options(num_cpus=0).remote()
        RayWorker = ray.remote(Worker)
        env = {"env_vars": {"RLRECIPES_DEVICE": dtype, "OMP_NUM_THREADS": str(max(1, int(cpw))),
                            "TOKENIZERS_PARALLELISM": "false"}}
        for rank in range(world):
            opts = dict(num_cpus=cpw, max_restarts=0, runtime_env=env,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank))
            if resource != "CPU":
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
            raise CLIError(f"{run_dir} is already at step {start} of {total}; pass --steps N with N > {start}")
        writer = MetricsWriter(run_dir / "metrics.jsonl", truncate_after_step=start - 1 if resume else None)
        if not quiet:
            console.print(f"[bold]{recipe.name}[/] · {world} workers · actor "
                          f"{plan.roles['actor'].describe()} -> rollout {plan.roles['rollout'].describe()} · "
                          f"stages: {' -> '.join(info[0]['stages'])} · run folder {run_dir}")
            d = info[0]["data"]
            console.print(f"data: {d['prompts']} prompts ({d['dropped_too_long']} dropped as longer than "
                          f"data.max_prompt_length, {d['skipped_malformed']} malformed rows skipped)")
        futures = [w.run.remote(start, total) for w in workers]
        rows = _watch(recipe, futures, progress, writer, quiet, start, total, t0)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted: stopping workers[/]")
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
    _summary(recipe, rows, run_dir, time.time() - t0)
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
                raise CLIError(_root_cause(futures, f, e, progress, phase), code=1) from None
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


def _watch(recipe, futures, progress, writer, quiet, start, total, t0) -> list:
    """Collect rank 0's metrics rows into metrics.jsonl while the workers run; render progress."""
    import ray

    rows: list = []
    live = None

    def tick() -> None:
        step, stage, new = ray.get(progress.poll.remote(len(rows)))
        for row in new:
            writer.write(row)
            rows.append(row)
            if quiet:
                console.print(json.dumps({k: v for k, v in row.items() if not k.startswith("timing_s/")}),
                              highlight=False, soft_wrap=True)
        if live is not None:
            live.update(_view(recipe, step, stage, rows, total, t0))

    if quiet or not console.is_terminal:
        if not quiet:
            console.print(f"training steps {start}..{total - 1}")
        _wait(futures, progress, "run", tick)
    else:
        with Live(_view(recipe, start - 1, "starting", rows, total, t0), console=console, refresh_per_second=4) as live:
            _wait(futures, progress, "run", tick)
        live = None
    tick()  # rows rank 0 sent just before returning
    return rows


def _summary(recipe: Recipe, rows: list, run_dir: Path, seconds: float) -> None:
    if not rows:
        return
    first = [r["reward/mean"] for r in rows[:5] if r.get("reward/mean") is not None]
    last = [r["reward/mean"] for r in rows[-5:] if r.get("reward/mean") is not None]
    tps = [r["perf/tps_per_card"] for r in rows[1:] or rows]
    t = Table(title=f"{recipe.name}: {len(rows)} steps in {seconds:.0f}s")
    t.add_column("metric")
    t.add_column("value", justify="right")
    if first and last:
        t.add_row("reward, mean of first 5 steps", f"{statistics.fmean(first):.3f}")
        t.add_row("reward, mean of last 5 steps", f"{statistics.fmean(last):.3f}")
    t.add_row("TPS/card, median (step 1 on)", f"{statistics.median(tps):.1f}")
    t.add_row("step seconds, mean", f"{statistics.fmean(r['timing_s/step'] for r in rows):.2f}")
    t.add_row("share outside model compute", f"{statistics.fmean(r.get('perf/overhead_share', 0) for r in rows):.1%}")
    stages = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    for s in stages:
        t.add_row(f"  {s}", f"{statistics.fmean(r.get(s, 0.0) for r in rows):.3f}")
    t.add_row("metrics", str(run_dir / "metrics.jsonl"))
    console.print(t)
