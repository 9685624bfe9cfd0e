"""`rlrecipes show`: print a recipe (as written, or merged and validated)."""
from __future__ import annotations

from typing import List, Optional

import typer
from rich.syntax import Syntax

from ._common import console, user_errors


def register(app: typer.Typer) -> None:
    @app.command("show", help="Print a recipe's YAML. With --resolved: the merged config (defaults, smoke, overrides) "
                              "with every field.\n\nExamples: `rlrecipes show qwen25_7b`  ·  "
                              "`rlrecipes show qwen25_7b --smoke --resolved trainer.steps=5`")
    @user_errors
    def show(recipe: str = typer.Argument(..., help="Registered name or path to a recipe folder."),
             overrides: Optional[List[str]] = typer.Argument(None, help="KEY=VALUE overrides, e.g. trainer.steps=5"),
             smoke: bool = typer.Option(False, "--smoke", help="Show smoke.yaml instead of recipe.yaml."),
             resolved: bool = typer.Option(False, "--resolved", help="Merge defaults and overrides, validate, print all fields.")) -> None:
        from ..recipe import dump_yaml, find_recipe, load_recipe

        if resolved or overrides:
            text = dump_yaml(load_recipe(recipe, smoke=smoke, overrides=overrides or []))
        else:
            load_recipe(recipe, smoke=smoke)  # validate before printing
            text = (find_recipe(recipe) / ("smoke.yaml" if smoke else "recipe.yaml")).read_text()
        if console.is_terminal:
            console.print(Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
        else:
            print(text, end="")
