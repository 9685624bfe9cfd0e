"""`rlrecipes run`: validate, plan, then train on an embedded Ray (`--smoke`) or a Ray cluster.

The workflow emits events (``workflow/events.py``); this module renders them with rich: a live
table on a terminal, one JSON line per step with ``--quiet``, and a summary table at the end.
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from ._common import bounds, console, die, err_console, user_errors


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
        self.quiet, self.live, self.started = quiet, None, None
        self.last: dict = {}  # the newest metrics row (the view keeps no others)
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
                              f"{ev.rollout_layout} · stages: {' -> '.join(ev.stages)} · run folder {ev.run_dir}"
                              + (f" · python tool sandbox: {escape(ev.data['sandbox'])}"
                                 if ev.data.get("sandbox") else ""))
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
            if ev.new_rows:
                self.last = ev.new_rows[-1]
            if self.quiet:
                for row in ev.new_rows:
                    console.print(json.dumps({k: v for k, v in row.items() if not k.startswith("timing_s/")}),
                                  highlight=False, soft_wrap=True)
            if self.live is not None:
                self.live.update(self._table(ev.step, ev.stage))
        elif isinstance(ev, E.Notice):
            err_console.print(f"[yellow]{ev.text}[/]", highlight=False, soft_wrap=True)
        elif isinstance(ev, E.Interrupted):  # the one line comes when the workers have stopped (cli/_common.py)
            self.stop()
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
        last = self.last
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        t.add_row(f"{max(step, 0) + 1}/{s.total_steps}", stage, fmt(last.get("reward/mean"), ".3f"),
                  fmt(last.get("perf/tps_per_card"), ".1f"), fmt(last.get("timing_s/step"), ".2f"),
                  fmt(last.get("actor/loss"), ".4f"), fmt(last.get("actor/kl"), ".4f"))
        return t

    @staticmethod
    def _summary(ev) -> None:
        s = ev.summary  # metrics.RunSummary: bounded, whatever the run's length
        if not s.steps:
            return
        first, last = s.reward_ends()
        t = Table(title=f"{ev.recipe}: {s.steps} steps in {ev.seconds:.0f}s")
        t.add_column("metric")
        t.add_column("value", justify="right")
        if first is not None:
            t.add_row(f"reward, mean of first {s.EDGE} steps", f"{first:.3f}")
            t.add_row(f"reward, mean of last {s.EDGE} steps", f"{last:.3f}")
        if s.tps_median is not None:
            t.add_row("TPS/card, median (step 1 on)", f"{s.tps_median:.1f}")
        t.add_row("step seconds, mean", f"{s.mean('timing_s/step'):.2f}")
        t.add_row("share outside model compute", f"{s.mean('perf/overhead_share'):.1%}")
        for k in s.stage_keys:
            t.add_row(f"  {k}", f"{s.mean(k):.3f}")
        errors, calls = s.sums.get("reward/errors", 0), s.sums.get("reward/samples", 0)
        if errors:
            t.add_row("reward calls failed (raised / NaN)", f"{errors:.0f} of {calls:.0f} ({errors / calls:.1%})")
        t.add_row("metrics", str(ev.run_dir / "metrics.jsonl"))
        console.print(t)
        if errors:
            err_console.print(f"[yellow]the reward function failed on {errors:.0f} of {calls:.0f} calls "
                              f"({errors / calls:.1%}; those samples scored 0, per step in reward/failure_rate); "
                              f"first error: {escape(s.first_error or 'not recorded')}. Fix reward.fn[/]",
                              highlight=False, soft_wrap=True)


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
            nodes: Optional[int] = typer.Option(None, "--nodes", "-n", **bounds("resources.nodes"),
                                                help="Node count (default: the recipe's)."),
            devices_per_node: Optional[int] = typer.Option(None, "--devices-per-node", "-d",
                                                           **bounds("resources.devices_per_node")),
            smoke: bool = typer.Option(False, "--smoke", help="Tiny same-architecture model on this machine."),
            dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and per-node launch commands; start nothing."),
            steps: Optional[int] = typer.Option(None, "--steps", **bounds("trainer.steps"), help="Override trainer.steps."),
            out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default: <trainer.out_dir>/<recipe>-<time>)."),
            resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this folder from its last checkpoint."),
            keep_batch: bool = typer.Option(False, "--keep-batch", help="Keep the global batch when scaling nodes."),
            address: Optional[str] = typer.Option(None, "--address", help="Ray address (default: RAY_ADDRESS or auto)."),
            quiet: bool = typer.Option(False, "--quiet", "-q", help="No live progress; one line per step.")) -> None:
        from ..inputs import command_problems
        from ..plan import PlanError, build_plan, format_violations
        from ..recipe import find_recipe, load_recipe
        from .plan import render_plan

        ovr = list(overrides or [])
        if steps is not None:
            ovr.append(f"trainer.steps={steps}")
        if resume is not None:
            from ..workflow.resume import resumed_recipe

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
            folder = find_recipe(recipe)
            for line in launch_commands(folder, plan.nodes, extra + ovr):
                console.print(f"  {line}", highlight=False, soft_wrap=True)
            missing = command_problems(["bash", str(folder / "launch.sh"), *extra, *ovr])
            for m in missing:
                console.print(f"    missing: {m}", highlight=False, soft_wrap=True)
            if missing:
                die("--dry-run: the launch commands name paths that are not there:\n  - " + "\n  - ".join(missing))
            return
        from ..interrupts import guard
        from ..workflow.driver import run_recipe

        with guard():  # Ctrl-C at any moment from here on: exit 130 with one line, never a traceback or 0
            run_recipe(r, plan, RunView(quiet), out=out, resume=resume, embedded=smoke and address is None,
                       address=address, overrides=ovr)
