"""``plan``'s checks of a multi-turn rollout (``rollout.multi_turn``), before any process starts.

It loads every tool (an unknown name or a ``module:function`` that does not import is reported
with the fix), checks that the tool format can be written and rendered with the run's tokenizer
(built for smoke models, loaded from the model folder otherwise; where the folder is not on this
machine the check is left to ``run`` and said so), refuses layouts the agent loop does not serve
yet, reports which sandbox the ``python`` tool gets here, and refuses that tool where its sandbox
cannot run (``rollout.multi_turn.sandbox``: bubblewrap is required unless ``rlimits`` is chosen).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional

from ..recipe import Recipe
from ..agent.setup import build_tools, sandbox_line, sandbox_refusal, tool_format_name  # noqa: F401  (plan reports them)
from .checks import Violation, one_rank_sessions

AGENT_RULE = "multi-turn rollout has what it needs"


def _tokenizer(r: Recipe) -> tuple[Any, Optional[str]]:
    """The run's tokenizer, or ``(None, why it was not checked)``."""
    from transformers import AutoTokenizer

    if r.model.smoke is not None and not r.model.path and not r.model.tokenizer:  # the run's, whatever the format
        from ..data.smoke import build_smoke_tokenizer

        with tempfile.TemporaryDirectory() as d:
            return AutoTokenizer.from_pretrained(str(build_smoke_tokenizer(d)), local_files_only=True), None
    folder = r.model.tokenizer or r.model.path
    if not folder or not Path(folder).is_dir():
        return None, f"the tokenizer folder {folder!r} is not on this machine; run checks the tool format"
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True), None
    except Exception as e:  # noqa: BLE001 -- any loading failure is reported, not raised
        return None, f"the tokenizer at {folder!r} did not load ({type(e).__name__}: {e})"


def agent_checks(r: Recipe) -> tuple[list[Violation], Optional[dict]]:
    """Violations of the multi-turn settings and what ``plan`` prints about them (None when off)."""
    mt = r.rollout.multi_turn
    if not mt.enabled:
        return [], None
    from ..agent import ToolSpecError, get_format

    v: list[Violation] = []
    info: dict = {"tools": list(mt.tools), "tool_format": tool_format_name(r), "max_turns": mt.max_turns,
                  "max_tool_calls": mt.max_tool_calls, "max_response_tokens": mt.max_response_tokens}
    tools = None
    try:
        tools = build_tools(r, fail_closed=False)
    except (ToolSpecError, ValueError, TypeError) as e:
        v.append(Violation(AGENT_RULE, f"rollout.multi_turn.tools: {e}"))
    if mt.max_tool_calls < 1:
        v.append(Violation(AGENT_RULE, "rollout.multi_turn.max_tool_calls is 0: no tool would ever run; "
                                       "set it >= 1 or rollout.multi_turn.enabled=false"))
    if mt.max_response_tokens < r.rollout.sampling.max_new_tokens:
        v.append(Violation(AGENT_RULE, f"rollout.multi_turn.max_response_tokens={mt.max_response_tokens} is below one "
                                       f"turn's rollout.sampling.max_new_tokens={r.rollout.sampling.max_new_tokens}; "
                                       "raise it (it bounds the whole trajectory: every turn and observation)"))
    why = one_rank_sessions(r, "multi-turn rollouts")
    if why:
        v.append(Violation(AGENT_RULE, why))
    if r.algorithm.routing_replay:
        v.append(Violation(AGENT_RULE, "algorithm.routing_replay records routing in single-turn generate calls only; "
                                       "set algorithm.routing_replay=false for a multi-turn rollout"))
    if tools is not None:
        fmt = get_format(info["tool_format"])
        tok, why = _tokenizer(r)
        if tok is None:
            info["tool_format_check"] = why
        else:
            try:
                fmt.check(tok, tools.schemas())
                for text in fmt.stop_text():
                    if len(tok(text, add_special_tokens=False)["input_ids"]) != 1:
                        raise ValueError(f"its stop string {text!r} is not one token of this tokenizer")
            except ValueError as e:
                smoke_tok = r.model.smoke is not None and not r.model.path and not r.model.tokenizer
                fix = (" (the smoke model's character tokenizer); set rollout.multi_turn.tool_format=smoke, or "
                       "model.tokenizer to the folder of a tokenizer the format renders" if smoke_tok else "")
                v.append(Violation(AGENT_RULE, f"rollout.multi_turn.tool_format={mt.tool_format} "
                                               f"({info['tool_format']}): {e}{fix}"))
        if "python" in tools:
            info["sandbox"] = sandbox_line(tools)
            why = sandbox_refusal(tools)
            if why:
                v.append(Violation(AGENT_RULE, why))
    return v, info


__all__ = ["AGENT_RULE", "agent_checks", "build_tools", "sandbox_line", "sandbox_refusal", "tool_format_name"]
