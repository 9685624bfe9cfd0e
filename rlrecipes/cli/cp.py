"""`rlrecipes cp`: copy a recipe folder to edit and run."""
from __future__ import annotations

import shutil
from pathlib import Path

import typer

from ._common import console, die, user_errors


def register(app: typer.Typer) -> None:
    @app.command("cp", help="Copy a recipe folder (recipe.yaml, smoke.yaml, launch.sh, baseline.json, README.md) "
                            "to DEST. The copy runs as is: `rlrecipes run DEST --smoke`.\n\n"
                            "Example: `rlrecipes cp qwen3_moe_30b ./my_recipe`")
    @user_errors
    def cp(recipe: str = typer.Argument(..., help="Registered name or path to a recipe folder."),
           dest: Path = typer.Argument(..., help="New folder; must not exist.")) -> None:
        from ..recipe import find_recipe, load_recipe

        from ..inputs import writable_dir

        src = find_recipe(recipe)
        if dest.is_dir():
            die(f"{dest} already exists; refusing to overwrite it. Choose a new folder or remove it first.")
        bad = writable_dir(dest, "destination")
        if bad:
            die(bad[0])
        load_recipe(str(src))
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "__init__.py"))
        launch = dest / "launch.sh"
        if launch.exists():
            launch.chmod(0o755)
        console.print(f"copied [bold]{src.name}[/] to [bold]{dest}[/]; edit {dest}/recipe.yaml, then "
                      f"`rlrecipes plan {dest} --nodes N` or `rlrecipes run {dest} --smoke`")
