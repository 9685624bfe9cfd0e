"""`rlrecipes list`: recipes, model, algorithm, hardware and baseline TPS/card."""
from __future__ import annotations

import json

import typer
from rich.table import Table

from ._common import console, user_errors


def register(app: typer.Typer) -> None:
    @app.command("list", help="List the registered recipes with their model, algorithm, hardware and baseline.\n\n"
                              "Example: `rlrecipes list`  ·  `rlrecipes list --json`")
    @user_errors
    def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
        from ..recipe import load_recipe, registry

        rows = []
        for name, folder in registry().items():
            r = load_recipe(str(folder))
            base = {}
            bfile = folder / "baseline.json"
            if bfile.is_file():
                base = json.loads(bfile.read_text()).get("hardware", {})
            cards = r.resources.nodes * r.resources.devices_per_node // r.resources.dies_per_card
            rows.append({
                "recipe": name, "model": r.model.preset or r.model.family, "algorithm": r.algorithm.name,
                "hardware": f"{r.resources.nodes} node(s), {cards} cards ({r.resources.device})",
                "tps_per_card": {hw: e.get("tps_per_card") for hw, e in base.items()},
                "folder": str(folder), "description": r.description,
            })
        if as_json:
            console.print_json(json.dumps(rows))
            return
        t = Table(title="rlrecipes")
        for c in ("recipe", "model", "algorithm", "hardware", "baseline TPS/card"):
            t.add_column(c, no_wrap=c in ("recipe", "model"), overflow="fold")
        for row in rows:
            tps = ", ".join(f"{hw}: {v}" for hw, v in row["tps_per_card"].items()) or "-"
            t.add_row(row["recipe"], row["model"], row["algorithm"], row["hardware"], tps)
        console.print(t)
