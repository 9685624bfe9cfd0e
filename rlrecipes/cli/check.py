"""`rlrecipes check`: the CI gate: median TPS/card of a run against a baseline."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ._common import console, die, err_console, user_errors


def register(app: typer.Typer) -> None:
    @app.command("check", help="Compare the median TPS/card over the baseline's step window with its tolerance. "
                               "Exits 1 on a regression; says so when the run beats `refresh_above`.\n\n"
                               "Example: `rlrecipes check runs/qwen25_7b-smoke --baseline recipes/qwen25_7b/baseline.json --hardware cpu`")
    @user_errors
    def check(run_dir: Path = typer.Argument(..., help="A run folder (holds metrics.jsonl)."),
              baseline: Optional[Path] = typer.Option(None, "--baseline", "-b",
                                                      help="baseline.json (default: the run's recipe folder's)."),
              hardware: str = typer.Option("cpu", "--hardware", help="Entry of baseline.json to compare with.")) -> None:
        from ..baseline import BaselineError, check_run

        if not run_dir.is_dir():
            die(f"{run_dir}: no such run folder; pass the folder a `rlrecipes run` wrote")
        if baseline is None:
            cfg = run_dir / "recipe_dir.txt"
            if not cfg.is_file():
                die(f"{run_dir}: cannot find the recipe's baseline; pass --baseline recipes/<recipe>/baseline.json")
            baseline = Path(cfg.read_text().strip()) / "baseline.json"
        try:
            res = check_run(run_dir, baseline, hardware)
        except BaselineError as e:
            die(str(e))
        predicted = _predicted(run_dir)
        if res.regression:
            err_console.print(f"[bold red]{escape(res.message())}[/]", highlight=False)
            if predicted:
                err_console.print(predicted, highlight=False)
            raise typer.Exit(1)
        console.print(f"[bold {'yellow' if res.refresh else 'green'}]{res.message()}[/]", highlight=False)
        if predicted:
            console.print(predicted, highlight=False)


def _predicted(run_dir: Path) -> str:
    """The step-time model's TPS/card for this run, as its plan.json holds it ("" for a run planned
    before the model existed, or whose plan.json is unreadable: the gate does not depend on it)."""
    import json

    try:
        pred = json.loads((run_dir / "plan.json").read_text()).get("predicted")
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(pred, dict) or "tps_per_card" not in pred:
        return ""
    return (f"predicted by plan on {pred.get('hardware')}: {pred['tps_per_card']:.2f} TPS/card "
            f"({pred.get('step_s', 0):.3g} s per step); measured and baseline above")
