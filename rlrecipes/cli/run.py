"""`rlrecipes run`: validate, plan, then train on an embedded Ray (`--smoke`) or a Ray cluster.

The workflow emits events (``workflow/events.py``); this module renders them with rich: a live
table on a terminal, one JSON line per step with ``--quiet``, and a summary table at the end.
"""
from __future__ import annotations

import json
import shlex
import statistics
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.live import Live
from rich.table import Table

from ._common import console, err_console, user_errors


def launch_commands(recipe_dir: Path, nodes: int, extra: list[str]) -> list[str]:
    launch = recipe_dir / "launch.sh"
    args = " ".join(shlex.quote(a) for a in extra)
    cmds = []
    for rank in range(nodes):
        cmd = f"NNODES={nodes} NODE_RANK={rank} MASTER_ADDR=<head-ip> bash {launch}"
        if args:
            cmd += f" {args}"
        cmds.append(f"node {rank}{' (head)' if rank == 0 else ''}: {cmd}")
    return cmds


class RunView:
    """Renders the driver's events: live view (terminal) or JSON lines (--quiet), then a summary."""

    def __init__(self, quiet: bool) -> None:
        self.quiet, self.live, self.started, self.rows = quiet, None, None, []
        self.t0 = time.time()

    def __call__(self, ev) -> None:
        from ..workflow import events as E

        if isinstance(ev, E.RunStarted):
            self.started = ev
            if ev.data.get("chat_joined"):
                err_console.print(f"[yellow]{ev.data['chat_joined']} prompts are chat messages but the tokenizer has no "
                                  "chat template: their contents are joined with newlines (set model.tokenizer to a "
                                  "tokenizer with a template to render them as the model was trained)[/]",
                                  highlight=False, soft_wrap=True)
            if not self.quiet:
                console.print(f"[bold]{ev.recipe}[/] · {ev.workers} workers · actor {ev.actor_layout} -> rollout "
                              f"{ev.rollout_layout} · stages: {' -> '.join(ev.stages)} · run folder {ev.run_dir}")
                d = ev.data
                console.print(f"data: {d['prompts']} prompts ({d['dropped_too_long']} dropped as longer than "
                              f"data.max_prompt_length, {d['skipped_malformed']} malformed rows skipped)")
                if console.is_terminal:
                    self.live = Live(self._table(ev.start_step - 1, "starting"), console=console,
                                     refresh_per_second=4)
                    self.live.start()
                else:
                    console.print(f"training steps {ev.start_step}..{ev.total_steps - 1}")
        elif isinstance(ev, E.Progress):
            self.rows += ev.new_rows
            if self.quiet:
                for row in ev.new_rows:
                    console.print(json.dumps({k: v for k, v in row.items() if not k.startswith("timing_s/")}),
                                  highlight=False, soft_wrap=True)
            if self.live is not None:
                self.live.update(self._table(ev.step, ev.stage))
        elif isinstance(ev, E.Notice):
            err_console.print(f"[yellow]{ev.text}[/]", highlight=False, soft_wrap=True)
        elif isinstance(ev, E.Interrupted):
            self.stop()
            err_console.print("[yellow]interrupted: stopping workers[/]")
        elif isinstance(ev, E.RunFinished):
            self.stop()
            self._summary(ev)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def _table(self, step: int, stage: str) -> Table:
        s = self.started
        t = Table(title=f"{s.recipe} · {s.algorithm} · {time.time() - self.t0:.0f}s", show_edge=False)
        for c in ("step", "stage", "reward", "TPS/card", "step s", "loss", "kl"):
            t.add_column(c, justify="right")
        last = self.rows[-1] if self.rows else {}
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        t.add_row(f"{max(step, 0) + 1}/{s.total_steps}", stage, fmt(last.get("reward/mean"), ".3f"),
                  fmt(last.get("perf/tps_per_card"), ".1f"), fmt(last.get("timing_s/step"), ".2f"),
                  fmt(last.get("actor/loss"), ".4f"), fmt(last.get("actor/kl"), ".4f"))
        return t

    @staticmethod
    def _summary(ev) -> None:
        rows = ev.rows
        if not rows:
            return
        first = [r["reward/mean"] for r in rows[:5] if r.get("reward/mean") is not None]
        last = [r["reward/mean"] for r in rows[-5:] if r.get("reward/mean") is not None]
        tps = [r["perf/tps_per_card"] for r in rows[1:] or rows]
        t = Table(title=f"{ev.recipe}: {len(rows)} steps in {ev.seconds:.0f}s")
        t.add_column("metric")
        t.add_column("value", justify="right")
        if first and last:
            t.add_row("reward, mean of first 5 steps", f"{statistics.fmean(first):.3f}")
            t.add_row("reward, mean of last 5 steps", f"{statistics.fmean(last):.3f}")
        t.add_row("TPS/card, median (step 1 on)", f"{statistics.median(tps):.1f}")
        t.add_row("step seconds, mean", f"{statistics.fmean(r['timing_s/step'] for r in rows):.2f}")
        t.add_row("share outside model compute",
                  f"{statistics.fmean(r.get('perf/overhead_share', 0) for r in rows):.1%}")
        stages = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
        for s in stages:
            t.add_row(f"  {s}", f"{statistics.fmean(r.get(s, 0.0) for r in rows):.3f}")
        t.add_row("metrics", str(ev.run_dir / "metrics.jsonl"))
        console.print(t)


def register(app: typer.Typer) -> None:
    @app.command("run", context_settings={"allow_interspersed_args": True},
                 help="Run a recipe. `--smoke` runs the whole pipeline on this machine (embedded Ray, tiny model of the "
                      "same architecture, CPU). Without it, joins the Ray cluster (--address, RAY_ADDRESS or auto) and "
                      "checks it has the nodes and devices the plan needs.\n\n"
                      "Examples: `rlrecipes run qwen25_7b --smoke`  ·  `rlrecipes run qwen25_7b --smoke --steps 5 "
                      "trainer.lr=1e-3`  ·  `rlrecipes run deepseek_r1_671b --nodes 48 --dry-run`  ·  "
                      "`rlrecipes run ./my_recipe --smoke --resume runs/my_recipe-20261121-120000`")
    @user_errors
    def run(recipe: str = typer.Argument(..., help="Registered name or path to a recipe folder."),
            overrides: Optional[List[str]] = typer.Argument(None, help="KEY=VALUE overrides, e.g. trainer.steps=5"),
            nodes: Optional[int] = typer.Option(None, "--nodes", "-n", min=1, help="Node count (default: the recipe's)."),
            devices_per_node: Optional[int] = typer.Option(None, "--devices-per-node", "-d", min=1),
            smoke: bool = typer.Option(False, "--smoke", help="Tiny same-architecture model on this machine."),
            dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and per-node launch commands; start nothing."),
            steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Override trainer.steps."),
            out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default: <trainer.out_dir>/<recipe>-<time>)."),
            resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this folder from its last checkpoint."),
            keep_batch: bool = typer.Option(False, "--keep-batch", help="Keep the global batch when scaling nodes."),
            address: Optional[str] = typer.Option(None, "--address", help="Ray address (default: RAY_ADDRESS or auto)."),
            quiet: bool = typer.Option(False, "--quiet", "-q", help="No live progress; one line per step.")) -> None:
        from ..plan import PlanError, build_plan, format_violations
        from ..recipe import find_recipe, load_recipe
        from .plan import render_plan

        ovr = list(overrides or [])
        if steps is not None:
            ovr.append(f"trainer.steps={steps}")
        if resume is not None:
            from ..workflow.driver import resumed_recipe

            r = resumed_recipe(resume, ovr)  # the run's own config.yaml; only resumable keys may change
        else:
            r = load_recipe(recipe, smoke=smoke, overrides=ovr)
        plan = build_plan(r, nodes, devices_per_node, keep_batch=keep_batch)
        if dry_run:
            render_plan(plan)
        if not plan.ok:
            raise PlanError(format_violations(plan))
        if dry_run:
            extra = ["--smoke"] if smoke else []
            console.print("\n[bold]launch commands[/] (run on every node; the head starts the recipe):")
            for line in launch_commands(find_recipe(recipe), plan.nodes, extra + ovr):
                console.print(f"  {line}", highlight=False, soft_wrap=True)
            return
        from ..workflow.driver import run_recipe

        run_recipe(r, plan, RunView(quiet), out=out, resume=resume, embedded=smoke and address is None,
                   address=address, overrides=ovr)
