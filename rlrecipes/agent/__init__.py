"""Multi-turn agent helpers: tools, tool-call formats, a tool-call executor and the Python sandbox.

These are the pieces the rollout stage's agent loop (``rollout.multi_turn``: :mod:`.loop`) is
made of; :mod:`.setup` builds them from the recipe. Per sample the loop:

1. generate until the tool format says to pause (:meth:`ToolFormat.call_complete`, the smoke
   format's closing parenthesis), the end-of-turn token (Qwen's ``<|im_end|>``) or a limit;
2. parse the new segment with :meth:`ToolFormat.parse` into :class:`ToolCall` s (a malformed
   call is a call with ``error`` set, never an exception);
3. hand them to :meth:`ToolExecutor.submit`, which runs them concurrently in a bounded thread pool,
   each under its own timeout, while the loop goes on generating the other samples;
4. when a sample's futures are done (:meth:`ToolExecutor.results`, in call order, one
   :class:`ToolResult` per call, ``ok=False`` for every kind of failure), render them with
   :meth:`ToolFormat.render_observation` (Qwen: the tokenizer's own chat template through
   :func:`render_tool_turn`, so the appended tokens are the template's), tokenize that text
   without special-token additions and append it with ``response_mask`` 0;
5. continue generating on the same sample until EOS, ``max_turns``, ``max_tool_calls`` or the
   token budget.

The tools live in a :class:`ToolRegistry` (built-ins ``calculator`` and ``python``, or
``"pkg.module:function"``) whose :meth:`ToolRegistry.schemas` is the ``tools=`` list of the chat
template. ``python`` runs in :func:`run_python`: bubblewrap (required: without it nothing runs, unless
rlimits only is chosen explicitly), and always rlimits, a wall-clock timeout, an empty environment
and truncated output (:func:`sandbox_mode` says which isolation this machine gives; ``plan`` shows
it). docs/sandbox.md describes the guarantees and their limits.

This package imports nothing from the rest of rlrecipes (layer 1).
"""
from .parsing import (
    SMOKE_ALPHABET,
    TOOL_FORMATS,
    ParsedTurn,
    QwenFormat,
    SmokeFormat,
    ToolCall,
    ToolFormat,
    get_format,
    render_tool_turn,
)
from .executor import ToolExecutor
from .sandbox import SandboxConfig, SandboxMode, SandboxResult, run_python, sandbox_mode
from .tools import (
    BUILTIN_TOOLS,
    Tool,
    ToolError,
    ToolRegistry,
    ToolResult,
    ToolSpecError,
    calculator,
    parse_docstring,
    tool_schema,
    validate_arguments,
)

__all__ = [
    "BUILTIN_TOOLS", "ParsedTurn", "QwenFormat", "SMOKE_ALPHABET", "SandboxConfig", "SandboxMode", "SandboxResult",
    "SmokeFormat", "TOOL_FORMATS", "Tool", "ToolCall", "ToolError", "ToolFormat", "ToolExecutor", "ToolRegistry",
    "ToolResult", "ToolSpecError", "calculator", "get_format", "parse_docstring", "render_tool_turn", "run_python",
    "sandbox_mode", "tool_schema", "validate_arguments",
]
