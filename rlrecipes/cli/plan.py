"""`rlrecipes plan`: layouts, per-device memory and reshard volume for N nodes; every violated rule at once."""
from __future__ import annotations

import json
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ._common import bounds, console, user_errors


def render_plan(plan) -> None:
    from ..plan import format_violations

    head = (f"[bold]{plan.recipe}[/] on {plan.nodes} node(s) x {plan.devices_per_node} {plan.device} devices = "
            f"{plan.world} devices · model {plan.model_params / 1e9:.2f}B params · batch "
            f"{plan.global_batch} x {plan.n_samples} (mini-batch {plan.mini_batch})")
    console.print(head)
    t = Table(title="layouts")
    sp = any(r.sp > 1 for r in plan.roles.values())  # the SP column only where a role splits sequences
    for c in ("role", "engine", "TP", "PP", "EP") + (("SP",) if sp else ()) + ("DP", "layer split"):
        t.add_column(c, justify="left" if c in ("role", "engine", "layer split") else "right")
    for r in plan.roles.values():
        if r.role == "ref" and plan.ref_policy == "adapters off":  # no engine: the actor's base (lora_lines)
            continue
        t.add_row(r.role, plan.engines.get(r.role, "-"), str(r.tp), str(r.pp), str(r.ep),
                  *((str(r.sp) if r.role != "rollout" else "-",) if sp else ()),
                  "-" if r.dp is None else str(r.dp), ",".join(map(str, r.pp_layers)) if r.pp_layers else "even")
    console.print(t)
    m = Table(title=f"estimated memory per device, GiB (device: {plan.device_memory_gb:g} GiB)")
    for c in ("phase", "weights", "grads", "optimizer", "activations", "transient", "KV cache", "total"):
        m.add_column(c, justify="right" if c != "phase" else "left")
    labels = ("train group", "rollout group") if plan.disaggregated else ("train (actor)", "rollout")
    rows = list(zip(labels, (plan.train_memory, plan.rollout_memory)))
    if plan.ref_policy == "model":  # resident beside the actor on the train devices
        rows.insert(1, ("+ ref (frozen)", plan.ref_memory))
    for phase, mem in rows:
        g = mem.gib()
        m.add_row(phase, *(f"{g[k]:.2f}" for k in ("weights", "grads", "optimizer", "activations", "transient", "kv_cache", "total")))
    console.print(m)
    for line in plan.placement_lines() + plan.lora_lines() + plan.sequence_lines():
        console.print(escape(line), highlight=False)
    console.print(f"reshard traffic per device per step: [bold]{plan.reshard_bytes_per_device / 2**30:.2f} GiB[/] "
                  f"received at most ({plan.reshard_method}; full model in bf16: {plan.reshard_full_bytes / 2**30:.1f} GiB)")
    if plan.predicted is not None:
        render_prediction(plan.predicted)
    if plan.inference:
        console.print(f"vllm-ascend {plan.inference['vllm_ascend']} additional_config: "
                      f"{plan.inference['additional_config']} · {plan.inference['engine_kwargs']}", highlight=False)
    if plan.agent:
        a = plan.agent
        console.print(f"multi-turn: tools {', '.join(a['tools'])} · format {a['tool_format']} · max_turns "
                      f"{a['max_turns']} · max_tool_calls {a['max_tool_calls']} · max_response_tokens "
                      f"{a['max_response_tokens']}", highlight=False)
        if "sandbox" in a:
            console.print(f"python tool sandbox here: {escape(a['sandbox'])}", highlight=False)
        if "tool_format_check" in a:
            console.print(f"[yellow]tool format not checked:[/] {escape(a['tool_format_check'])}", highlight=False)
    for c in plan.changes:
        console.print(f"[cyan]changed:[/] {c}")
    for m in plan.missing_here:
        console.print(f"[yellow]not runnable on this machine:[/] {escape(m)}", highlight=False)
    if plan.ok:
        console.print("[bold green]plan OK[/]" + (" (for a machine with the engines above)" if plan.missing_here else ""))
    else:
        console.print(f"[bold red]{escape(format_violations(plan))}[/]", highlight=False)


def render_prediction(pred) -> None:
    """The step-time model's table: seconds per stage, what bounds each, the step and TPS/card."""
    from ..hardware import get_hardware

    hw = get_hardware(pred.hardware)
    t = Table(title=f"predicted step on {hw.name} ({hw.title})")
    for c in ("stage", "seconds", "share", "bound", "how"):
        t.add_column(c, justify="right" if c in ("seconds", "share") else "left", overflow="fold")
    for st in pred.stages:
        t.add_row(st.name, f"{st.seconds:.3g}", f"{100 * st.seconds / pred.step_s:.0f} %" if pred.step_s and not pred.overlap else "-",
                  st.bound, escape(st.detail))
    console.print(t)
    how = " (rollout overlaps training: the longer of the two)" if pred.overlap else ""
    console.print(f"predicted: [bold]{pred.step_s:.3g} s per step[/]{how} · [bold]{pred.tps_per_card:.1f} TPS/card[/] "
                  f"({pred.tokens / 1e6:.3g}M tokens: prompt {pred.prompt_tokens:g} + response {pred.response_tokens:g} "
                  f"per sample, {pred.cards:g} cards)", highlight=False)
    for a in pred.assumptions:
        console.print(f"[dim]assumed: {escape(a)}[/]", highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("plan", help="Derive the layouts for N nodes, check every rule, and estimate per-device memory and "
                              "reshard traffic. Exits 1 when a rule is violated.\n\n"
                              "Examples: `rlrecipes plan deepseek_r1_671b --nodes 48`  ·  "
                              "`rlrecipes plan qwen25_7b --nodes 2 --json`  ·  `rlrecipes plan qwen25_7b actor.layout.tp=4`")
    @user_errors
    def plan_cmd(recipe: str = typer.Argument(..., help="Registered name or path to a recipe folder."),
                 overrides: Optional[List[str]] = typer.Argument(None, help="KEY=VALUE overrides."),
                 nodes: Optional[int] = typer.Option(None, "--nodes", "-n", **bounds("resources.nodes"),
                                                     help="Node count (default: the recipe's)."),
                 devices_per_node: Optional[int] = typer.Option(None, "--devices-per-node", "-d",
                                                                **bounds("resources.devices_per_node"),
                                                                help="Devices per node (default: the recipe's)."),
                 smoke: bool = typer.Option(False, "--smoke", help="Plan the smoke configuration."),
                 keep_batch: bool = typer.Option(False, "--keep-batch", help="Keep the global batch when scaling nodes."),
                 as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON.")) -> None:
        from ..plan import build_plan
        from ..recipe import load_recipe

        r = load_recipe(recipe, smoke=smoke, overrides=overrides or [])
        plan = build_plan(r, nodes, devices_per_node, keep_batch=keep_batch)
        if as_json:
            print(json.dumps(plan.to_json(), indent=2))
        else:
            render_plan(plan)
        if not plan.ok:
            raise typer.Exit(1)
