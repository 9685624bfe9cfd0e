"""What a tool call can end in: a result (always), or a declaration error."""
from __future__ import annotations

from dataclasses import dataclass


class ToolSpecError(ValueError):
    """A tool cannot be registered (raised when the registry is built, never during a rollout)."""


class ToolError(Exception):
    """Raise from a tool to return ``str(exc)`` as an error observation (no traceback is shown)."""


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one tool call, always returned, never raised."""

    name: str
    content: str
    """The observation text the model sees (the tool's output, or the error message)."""
    ok: bool = True
    error: str | None = None
    """Kind of failure: ``unknown_tool``, ``invalid_arguments``, ``parse_error``, ``timeout``,
    ``exception``, ``tool_error``, ``bad_output``; None when ``ok``."""
    latency_s: float = 0.0
