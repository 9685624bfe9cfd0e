"""`rlrecipes run`: validate, plan, connect to Ray and train (or `--smoke` on this machine)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import List, Optional

import typer

from ._common import console, die, user_errors


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


def register(app: typer.Typer) -> None:
    @app.command("run", context_settings={"allow_interspersed_args": True},
                 help="Run a recipe. `--smoke` runs the whole pipeline on this machine (embedded Ray, tiny model of the "
                      "same architecture, CPU). Without it, joins the Ray cluster (RAY_ADDRESS or auto) and checks it "
                      "has the nodes and devices the plan needs.\n\n"
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
        from ..cluster import ClusterError, check_resources, cluster_resources, connect, start_hint
        from ..device import ray_resource
        from ..plan import PlanError, build_plan, format_violations
        from ..recipe import find_recipe, load_recipe
        from .plan import render_plan

        ovr = list(overrides or [])
        if steps is not None:
            ovr.append(f"trainer.steps={steps}")
        if resume is not None and not (resume / "config.yaml").is_file():
            die(f"--resume {resume}: not a run folder (no config.yaml); pass the folder a previous `rlrecipes run` printed")
        r = load_recipe(recipe, smoke=smoke, overrides=ovr)
        plan = build_plan(r, nodes, devices_per_node, keep_batch=keep_batch)
        if not plan.ok:
            if dry_run:
                render_plan(plan)
            raise PlanError(format_violations(plan))
        if dry_run:
            render_plan(plan)
            extra = ["--smoke"] if smoke else []
            console.print("\n[bold]launch commands[/] (run on every node; the head starts the recipe):")
            for line in launch_commands(find_recipe(recipe), plan.nodes, extra + ovr):
                console.print(f"  {line}", highlight=False, soft_wrap=True)
            return
        if smoke:
            from ..workflow.driver import run_recipe

            run_recipe(r, plan, out=out, resume=resume, quiet=quiet)
            return
        try:
            connect(address)
        except ClusterError as e:
            raise ClusterError(f"{e}\n{start_hint(plan.nodes, find_recipe(recipe))}") from None
        found = cluster_resources(ray_resource(r.resources.device))
        check_resources(found, plan.nodes, plan.devices_per_node, find_recipe(recipe))
        from ..workflow.driver import run_recipe

        run_recipe(r, plan, out=out, resume=resume, quiet=quiet, cluster="existing")
