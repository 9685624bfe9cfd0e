"""Shared CLI helpers: the error boundary, console, recipe loading."""
from __future__ import annotations

import functools
from typing import Callable

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


class CLIError(Exception):
    """An error shown to the user as one clear message (no traceback)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def user_errors(fn: Callable) -> Callable:
    """Turn the project's expected errors into a red message and a non-zero exit code."""
    from ..cluster import ClusterError
    from ..engines.registry import EngineError
    from ..plan import PlanError
    from ..recipe import RecipeError
    from ..workflow.events import RunError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RecipeError, PlanError, ClusterError, CLIError, RunError, EngineError, FileNotFoundError,
                FileExistsError) as e:
            code = getattr(e, "code", 2)
            kind = type(e).__name__.replace("Error", " error").strip()
            err_console.print(f"[bold red]{kind}:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code) from None
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper


def die(message: str, code: int = 2) -> None:
    raise CLIError(message, code)

