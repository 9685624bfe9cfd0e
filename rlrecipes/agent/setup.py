"""What a run builds of its multi-turn rollout from the recipe (``rollout.multi_turn``): the tool
format's name, the tool registry with its ``python`` sandbox (refused where that sandbox cannot
run), and the line that says which sandbox this machine gives. The workers' setup and ``plan``
both call these, so what ``plan`` checks is what runs. The recipe is read by attribute only: this
package imports nothing from the rest of rlrecipes (layer 1)."""
from __future__ import annotations

from typing import Any, Optional

Recipe = Any  # rlrecipes.recipe.Recipe (not imported: layer 1)


def tool_format_name(r: Recipe) -> str:
    """``rollout.multi_turn.tool_format`` with ``auto`` resolved: smoke for smoke models (their
    character tokenizer), qwen otherwise."""
    name = r.rollout.multi_turn.tool_format
    if name == "auto":
        return "smoke" if r.model.smoke is not None and not r.model.path and not r.model.tokenizer else "qwen"
    return name


def build_tools(r: Recipe, *, fail_closed: bool = True):
    """The :class:`~rlrecipes.agent.ToolRegistry` of ``rollout.multi_turn.tools`` (raises
    ToolSpecError naming a bad entry), its ``python`` tool isolated as ``rollout.multi_turn.sandbox``
    says. ``fail_closed``: raise ToolSpecError (the refusal, with the fix) when that tool is listed
    and its sandbox cannot run here, as a worker's setup does."""
    from ..agent import SandboxConfig, ToolRegistry, ToolSpecError

    mt = r.rollout.multi_turn
    tools = ToolRegistry(mt.tools, default_timeout_s=mt.tool_timeout_s, sandbox=SandboxConfig(isolation=mt.sandbox))
    why = sandbox_refusal(tools)
    if fail_closed and why:
        raise ToolSpecError(why)
    return tools


def sandbox_line(tools) -> Optional[str]:
    """Which sandbox the registry's ``python`` tool gets on this machine (None without that tool)."""
    from ..agent import sandbox_mode

    return sandbox_mode(tools.sandbox).describe() if tools is not None and "python" in tools else None


def sandbox_refusal(tools) -> Optional[str]:
    """Why the ``python`` tool cannot run here (its sandbox is ``none``), naming the key and the fix."""
    from ..agent import sandbox_mode

    if tools is None or "python" not in tools:
        return None
    mode = sandbox_mode(tools.sandbox)
    return f"rollout.multi_turn.sandbox={tools.sandbox.isolation}: {mode.refusal()}" if mode.kind == "none" else None
