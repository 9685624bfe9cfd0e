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
    from ..models.files import FileLoadError
    from ..plan import PlanError
    from ..recipe import RecipeError
    from ..workflow.events import RunError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:  # `rlrecipes list | head`: not a file the user gave
            raise
        except (RecipeError, PlanError, ClusterError, CLIError, RunError, EngineError, FileLoadError, OSError) as e:
            code = getattr(e, "code", 2)
            kind = ("File error" if isinstance(e, (FileLoadError, OSError)) else
                    type(e).__name__.replace("Error", " error").strip())
            err_console.print(f"[bold red]{kind}:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(code) from None
        except KeyboardInterrupt as e:  # one line: the run's own (interrupts.RunInterrupted: the --resume command)
            err_console.print(f"[yellow]{escape(getattr(e, 'message', None) or 'interrupted')}[/]", highlight=False,
                              soft_wrap=True)
            raise typer.Exit(130) from None

    return wrapper


def bounds(key: str) -> dict:
    """typer's ``min`` / ``max`` for a numeric option that sets recipe ``key``: the schema's own bounds,
    so an option and the key it sets accept the same values (an absurd one exits 2 naming the option)."""
    from ..recipe.schema import Recipe

    model, field = Recipe, None
    for part in key.split("."):
        field = model.model_fields[part]
        model = field.annotation
    out: dict = {}
    integer = field.annotation is int or int in getattr(field.annotation, "__args__", ())
    for m in field.metadata:
        if getattr(m, "ge", None) is not None:
            out["min"] = m.ge
        if getattr(m, "gt", None) is not None:
            out["min"] = m.gt + 1 if integer else m.gt
        if getattr(m, "le", None) is not None:
            out["max"] = m.le
        if getattr(m, "lt", None) is not None:
            out["max"] = m.lt - 1 if integer else m.lt
    if "min" not in out or "max" not in out:
        raise ValueError(f"{key} has no lower and upper bound in the recipe schema; a CLI option needs both")
    return out


def die(message: str, code: int = 2) -> None:
    raise CLIError(message, code)

