"""Tools a model may call: a registry of ``module:function`` tools and built-ins, with JSON schemas
derived from signatures and docstrings, argument validation, and failures as observations.

A tool is a plain Python function with type hints and a docstring::

    def lookup(city: str, unit: Literal["c", "f"] = "c") -> str:
        '''Current temperature of a city.

        Args:
            city: The city's English name.
            unit: Celsius or Fahrenheit.
        '''

Its schema (the OpenAI / Hugging Face "function" tool format that chat templates render) is
``{"type": "function", "function": {"name", "description", "parameters": {"type": "object",
"properties", "required"}}}``: the description is the docstring's text before its sections,
each property's type comes from the hint and its description from a Google-style ``Args:``
section or reST ``:param name:`` lines, and parameters without defaults are required.

:meth:`ToolRegistry.run` never raises because of a call: an unknown tool, a missing, unknown or
wrong-typed argument, a tool that raises, times out or returns something that is not text or
JSON data each becomes a :class:`ToolResult` with ``ok=False`` whose ``content`` is the error
observation the model sees. Errors in *declaring* a tool (not importable, not callable, a
parameter without a type hint or with a type JSON cannot express) raise :class:`ToolSpecError`
when the registry is built, naming the tool and the fix.
"""
from __future__ import annotations

import difflib
import importlib
import json
import re
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from .builtins import BUILTIN_TOOLS, calculator, python  # noqa: F401  (re-exported)
from .errors import ToolError, ToolResult, ToolSpecError  # noqa: F401  (re-exported)
from .sandbox import SandboxConfig, run_python
from .schema import (json_type, parse_docstring, tool_schema, validate_arguments,  # noqa: F401  (re-exported)
                     _coerce)


# --------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class Tool:
    """One registered tool: its exposed name, the function, its schema and where it came from."""

    name: str
    fn: Callable
    schema: dict
    spec: str
    """``"calculator"``, ``"pkg.module:function"`` or ``"<callable>"``."""
    sandboxed: bool = False
    """The built-in ``python``: the registry runs it in the sandbox with the call's timeout."""


def load_function(spec: str) -> Callable:
    """The callable named ``"pkg.module:function"`` (``function`` may be dotted: ``Class.method``)."""
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ToolSpecError(f"tool {spec!r}: expected 'pkg.module:function'")
    try:
        obj = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or the module's own error at import time
        raise ToolSpecError(f"tool {spec!r}: cannot import module {mod_name!r} ({type(e).__name__}: {e}); check "
                            "the module path and that it is installed or on PYTHONPATH") from e
    for part in attr.split("."):
        nxt = getattr(obj, part, None)
        if nxt is None:
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            owner = getattr(obj, "__name__", mod_name)
            raise ToolSpecError(f"tool {spec!r}: {owner!r} has no attribute {part!r}.{hint}")
        obj = nxt
    if not callable(obj):
        raise ToolSpecError(f"tool {spec!r}: {mod_name}.{attr} is a {type(obj).__name__}, not callable; "
                            "name a function")
    return obj


class ToolRegistry:
    """Tools by name, their schemas for the chat template, and fault-free calls.

    Args:
        tools: built-in names (``calculator``, ``python``), ``"pkg.module:function"`` strings or
            callables. Raises ToolSpecError for a tool that cannot be registered.
        sandbox: the sandbox of the built-in ``python`` tool (its ``timeout_s`` is replaced by
            each call's timeout).
        default_timeout_s: the timeout of a call that gives none.
        max_observation_chars: a longer tool output is cut, with a marker saying how much.
    """

    def __init__(self, tools: Iterable[str | Callable] = (), *, sandbox: SandboxConfig | None = None,
                 default_timeout_s: float = 10.0, max_observation_chars: int = 8192):
        if default_timeout_s <= 0 or max_observation_chars <= 0:
            raise ValueError("ToolRegistry: default_timeout_s and max_observation_chars must be > 0")
        self.sandbox = sandbox or SandboxConfig()
        self.default_timeout_s = default_timeout_s
        self.max_observation_chars = max_observation_chars
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, spec: str | Callable, name: str | None = None) -> Tool:
        """Register one tool (see the class doc); ``name`` overrides the exposed name."""
        if callable(spec):
            fn, where = spec, "<callable>"
        elif not isinstance(spec, str) or not spec.strip():
            raise ToolSpecError(f"a tool must be a built-in name or 'pkg.module:function'; got {spec!r}")
        elif ":" in spec:
            fn, where = load_function(spec.strip()), spec.strip()
        elif spec.strip() in BUILTIN_TOOLS:
            fn, where = BUILTIN_TOOLS[spec.strip()], spec.strip()
        else:
            close = difflib.get_close_matches(spec.strip(), BUILTIN_TOOLS, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ToolSpecError(f"unknown tool {spec!r}: built-in tools are {', '.join(sorted(BUILTIN_TOOLS))}; "
                                f"or give an import path 'pkg.module:function'.{hint}")
        name = name or getattr(fn, "__name__", None) or where
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", name):
            raise ToolSpecError(f"tool {where!r}: name {name!r} is not a valid tool name (letters, digits, _ . -)")
        if name in self._tools:
            raise ToolSpecError(f"tool {where!r}: the name {name!r} is already taken by {self._tools[name].spec!r}; "
                                "give one of them another name")
        tool = Tool(name, fn, tool_schema(fn, name), where, sandboxed=fn is python)
        self._tools[name] = tool
        return tool

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Tool:
        return self._tools[name]

    def schemas(self) -> list[dict]:
        """The ``tools=`` list for ``tokenizer.apply_chat_template``."""
        return [t.schema for t in self._tools.values()]

    def run(self, name: str, arguments: Any, timeout_s: float | None = None) -> ToolResult:
        """Call a tool; every failure is a ``ToolResult`` with ``ok=False`` (see the module doc)."""
        t0 = time.monotonic()
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s

        def fail(kind: str, msg: str) -> ToolResult:
            return ToolResult(name, self._cut(f"Error: {msg}"), False, kind, time.monotonic() - t0)

        tool = self._tools.get(name)
        if tool is None:
            close = difflib.get_close_matches(str(name), self._tools, n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            available = ", ".join(self._tools) or "none"
            return fail("unknown_tool", f"unknown tool {name!r}; available tools: {available}.{hint}")
        problems = validate_arguments(tool.schema, arguments)
        if problems:
            return fail("invalid_arguments", f"invalid arguments for tool {name!r}: " + "; ".join(problems))
        arguments = _coerce(tool.schema, arguments)
        if tool.sandboxed:
            r = run_python(arguments["code"], replace(self.sandbox, timeout_s=timeout_s))
            kind = None if r.ok else ("timeout" if r.timed_out else "tool_error")
            return ToolResult(name, self._cut(r.observation()), r.ok, kind, time.monotonic() - t0)
        status, value = _call_with_timeout(tool.fn, arguments, timeout_s, name)
        if status == "timeout":
            return fail("timeout", f"tool {name!r} timed out after {timeout_s:g} s")
        if status == "tool_error":
            return fail("tool_error", str(value) or f"tool {name!r} failed")
        if status == "exception":
            return fail("exception", f"tool {name!r} raised {type(value).__name__}: {value}")
        try:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:
            return fail("bad_output", f"tool {name!r} returned a {type(value).__name__}, which is neither text nor "
                                      f"JSON data ({e})")
        return ToolResult(name, self._cut(text), True, None, time.monotonic() - t0)

    def _cut(self, text: str) -> str:
        n = self.max_observation_chars
        if len(text) <= n:
            return text
        return text[:n] + f"\n[... truncated: {len(text) - n} more characters]"


def _call_with_timeout(fn: Callable, arguments: dict, timeout_s: float, name: str) -> tuple[str, Any]:
    """Run ``fn(**arguments)`` in a daemon thread and wait at most ``timeout_s``.

    Returns ``(status, value)``: ``ok`` and the return value, ``tool_error`` / ``exception`` and
    the exception, or ``timeout``. Python cannot stop a thread: a tool that never returns keeps
    its thread (and nothing else) after the timeout; put untrusted or unbounded work in the
    sandbox.
    """
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(**arguments)
        except ToolError as e:
            box["tool_error"] = e
        except BaseException as e:  # noqa: BLE001 -- a tool failure is an observation
            box["exception"] = e

    th = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        return "timeout", None
    for status in ("tool_error", "exception"):
        if status in box:
            return status, box[status]
    return "ok", box.get("value")
