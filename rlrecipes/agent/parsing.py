"""Tool calls in generated text, per format, and tool results rendered as observation text.

Two formats:

``qwen``
    The Qwen2.5 / Qwen3 chat-template format (Hermes style). An assistant turn holds any number
    of calls, each a JSON object on its own lines::

        <tool_call>
        {"name": "calculator", "arguments": {"expression": "407+512"}}
        </tool_call>

    A turn ends at the end-of-turn token (``<|im_end|>``, the EOS), so :meth:`call_complete` is
    always False: the loop parses the finished turn. Text inside ``<think>...</think>`` is
    reasoning, never a call. The observation is rendered by the tokenizer's own chat template
    (:func:`render_tool_turn`), so the tokens the rollout appends are the tokens the template
    gives the whole conversation.

``smoke``
    For the character-level smoke tokenizer (``rlrecipes.data.smoke``), whose 32 tokens are
    special tokens, the digits and ``+-*/=()., ?:abcxy``: no braces or quotes, so no JSON. A call
    is a one-letter tool alias. By default (``bare=True``, what the rollout uses) the letter alone
    is the call and its arguments are the sample's own (the data row's ``tool_kwargs``, e.g.
    ``{"calculator": {"expression": "407+512"}}``); generation pauses at the letter (the alias
    letters are the stop tokens, :meth:`stop_text`; other letters are plain text). With ``bare=False`` a call carries one argument in
    parentheses, which may nest, and generation pauses when the parenthesis closes::

        c                   -> calculator(**the sample's arguments)        (bare=True)
        c(407+512)          -> calculator(expression="407+512")           (bare=False)

    The observation is the result between a colon and an equals sign, ``:919=`` (it ends as the
    prompt ``407+512=`` does, where the answer follows); a failure, or a result that is not a plain
    number, reads ``:?=``. A whole smoke response: ``c:919=919<eos>``: the answer is the text after
    the last observation, and a model that ends its turn right after the result answers with it
    (the smoke reward, ``rlrecipes.rewards.smoke_reward``).

Parsing never raises: a call that cannot be read (bad JSON, no name, arguments that are not an
object, an unterminated call, an unknown alias) is a :class:`ToolCall` with ``error`` set, which
the pool answers with an error observation in its place, so every call gets one observation.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

from .tools import ToolResult


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it."""

    name: str
    arguments: dict = field(default_factory=dict)
    raw: str = ""
    """The call's text, as generated."""
    error: str | None = None
    """Why the call could not be read (then ``name`` / ``arguments`` are what could be recovered)."""


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its text and its calls (in order)."""

    content: str
    calls: list[ToolCall]


class ToolFormat(ABC):
    """How one model family writes tool calls and reads tool results."""

    name: str = ""

    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The calls in one generated turn (never raises)."""

    @abstractmethod
    def call_complete(self, text: str) -> bool:
        """Whether generation should pause now to run the calls in ``text`` (the current
        segment), before any end-of-turn token."""

    def stop_text(self) -> list[str]:
        """Strings (single tokens of the format's tokenizer) at which generation pauses so the
        loop can look for a complete call; the end-of-turn token (EOS) always ends a turn."""
        return []

    @abstractmethod
    def render_observation(self, results: Sequence[ToolResult], calls: Sequence[ToolCall] = (), *,
                           tokenizer: Any = None, tools: list[dict] | None = None) -> str:
        """The text appended after the model's segment (not tokens of the model: masked out)."""

    def results_of(self, observation: str) -> list[str]:
        """The tool results inside an observation's text (what a reward's ``tool_results`` gets)."""
        return [observation]

    def check(self, tokenizer: Any = None, tools: list[dict] | None = None) -> None:
        """Raise ValueError when this format cannot be used with ``tokenizer`` (for ``plan``)."""


# --------------------------------------------------------------------------------------------
# qwen

_THINK_END = "</think>"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)" + re.escape(_CLOSE), re.S)
_NAME = re.compile(r'"name"\s*:\s*"([^"]{1,64})"')
_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.S)


def _read_json_call(body: str, raw: str) -> ToolCall:
    expected = 'expected {"name": <tool name>, "arguments": {<argument>: <value>, ...}}'
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        m = _NAME.search(body)
        return ToolCall(m.group(1) if m else "", {}, raw,
                        f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); {expected}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", {}, raw, f"the tool call has no \"name\" string; {expected}")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, raw, f"the \"arguments\" of tool {obj['name']!r} must be a JSON object, "
                                              f"got {type(args).__name__}; {expected}")
    return ToolCall(obj["name"], args, raw)


class QwenFormat(ToolFormat):
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Qwen3); see the module doc.

    Args:
        chat_template_kwargs: passed to ``apply_chat_template`` when rendering observations
            (e.g. ``{"enable_thinking": False}`` for Qwen3), as the prompt was rendered.
    """

    name = "qwen"

    def __init__(self, chat_template_kwargs: dict[str, Any] | None = None):
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def parse(self, text: str) -> ParsedTurn:
        head = ""
        if _THINK_END in text:  # reasoning before the last </think> holds no calls
            cut = text.rindex(_THINK_END) + len(_THINK_END)
            head, text = text[:cut], text[cut:]
        calls, pieces, pos = [], [], 0
        for m in _BLOCK.finditer(text):
            pieces.append(text[pos:m.start()])
            calls.append(_read_json_call(m.group(1).strip(), m.group(0)))
            pos = m.end()
        rest = text[pos:]
        if _OPEN in rest:  # an unterminated call (the turn hit its token limit, or a missing close tag)
            i = rest.index(_OPEN)
            pieces.append(rest[:i])
            calls.append(ToolCall("", {}, rest[i:], f"unterminated tool call: {_OPEN} without {_CLOSE}"))
        else:
            pieces.append(rest)
        return ParsedTurn(re.sub(r"\n{3,}", "\n\n", head + "".join(pieces)).strip(), calls)

    def call_complete(self, text: str) -> bool:
        return False  # the turn ends at <|im_end|>; the loop parses it then

    def results_of(self, observation: str) -> list[str]:
        found = _RESPONSE.findall(observation)
        return [x.strip("\n") for x in found] if found else [observation]

    def render_observation(self, results, calls=(), *, tokenizer=None, tools=None) -> str:
        if tokenizer is None:
            raise ValueError("the qwen tool format renders observations with the tokenizer's chat template; "
                             "pass tokenizer=")
        return render_tool_turn(tokenizer, results, calls, tools=tools, **self.chat_template_kwargs)

    def check(self, tokenizer=None, tools=None) -> None:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("tool format 'qwen' needs a tokenizer with a chat template that renders 'tool' "
                             "messages (a Qwen2.5 / Qwen3 instruct tokenizer); this tokenizer has no chat template. "
                             "Use tool_format: smoke with the smoke tokenizer")
        marker = "rlrecipes-tool-result-0xC0FFEE"
        obs = render_tool_turn(tokenizer, [ToolResult("probe", marker)], [ToolCall("probe", {})], tools=tools,
                               **self.chat_template_kwargs)
        if marker not in obs:
            raise ValueError("tool format 'qwen': the tokenizer's chat template does not render 'tool' messages "
                             f"(the result is missing from {obs!r})")


def render_tool_turn(tokenizer: Any, results: Sequence[ToolResult], calls: Sequence[ToolCall] = (), *,
                     tools: list[dict] | None = None, end_of_turn: str | None = None,
                     **template_kwargs: Any) -> str:
    """The text a chat template puts between the end of an assistant turn and the next assistant
    turn's first generated token, for the tool results ``results``.

    Renders ``[user, assistant(calls), tool...]`` with the generation prompt through
    ``tokenizer.apply_chat_template(..., tools=tools, tokenize=False)`` and returns everything
    after the assistant turn's ``end_of_turn`` token (default: the tokenizer's EOS,
    ``<|im_end|>`` for Qwen), which the model generated itself: what the template writes after
    that token, the tool turn, and the next assistant header. Appending it to the model's turn
    gives the template's own rendering of the tool turn. (The assistant turn itself is not
    compared with the template: Qwen3's renders the last assistant turn differently from an
    earlier one, and the rollout keeps the tokens the model generated.) Raises ValueError when
    the template does not close an assistant turn with ``end_of_turn``.
    """
    end_of_turn = end_of_turn or getattr(tokenizer, "eos_token", None)
    if not end_of_turn:
        raise ValueError("render_tool_turn: the tokenizer has no eos_token; pass end_of_turn= (the token that ends an "
                         "assistant turn)")
    if not calls:
        calls = [ToolCall(r.name, {}) for r in results]
    marker = "rlrecipes-assistant-turn"  # where the assistant's own text is in the rendering
    assistant = {"role": "assistant", "content": marker,
                 "tool_calls": [{"type": "function", "function": {"name": c.name or "tool", "arguments": c.arguments}}
                                for c in calls]}
    messages = [{"role": "user", "content": "."}, assistant]
    messages += [{"role": "tool", "name": r.name, "content": r.content} for r in results]
    text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         **template_kwargs)
    at = text.rfind(marker)
    end = text.find(end_of_turn, at) if at >= 0 else -1
    if end < 0:
        raise ValueError(f"render_tool_turn: the chat template does not end an assistant turn with {end_of_turn!r}; "
                         "pass end_of_turn= (the token the model generates at the end of its turn)")
    return text[end + len(end_of_turn):]


# --------------------------------------------------------------------------------------------
# smoke

SMOKE_ALPHABET = frozenset("0123456789+-*/=()., ?:abcxy")
"""The characters of the smoke tokenizer (``rlrecipes.data.smoke.CHARS``; a test checks they agree)."""
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


class SmokeFormat(ToolFormat):
    """One-letter calls and ``:919=`` observations for the smoke tokenizer; see the module doc.

    Args:
        aliases: tool letter -> ``(tool name, name of its one argument)``.
        bare: a call is the letter alone, with the sample's arguments (see the module doc).
    """

    name = "smoke"

    def __init__(self, aliases: dict[str, tuple[str, str]] | None = None, bare: bool = True):
        self.aliases = dict(aliases or {"c": ("calculator", "expression")})
        self.bare = bool(bare)
        for k in self.aliases:
            if len(k) != 1 or k not in "abcxy":
                raise ValueError(f"smoke tool format: alias {k!r} must be one of the letters a b c x y "
                                 "(the only letters of the smoke tokenizer)")

    def _scan(self, text: str) -> list[tuple[int, int, str | None]]:
        """``(start, end, error)`` of each call; ``end`` is -1 for an unterminated one."""
        out, i = [], 0
        while i < len(text) - 1:
            if text[i] in "abcxy" and text[i + 1] == "(":
                depth, j = 0, i + 1
                while j < len(text):
                    depth += {"(": 1, ")": -1}.get(text[j], 0)
                    if depth == 0:
                        break
                    j += 1
                if j == len(text):
                    out.append((i, -1, "unterminated call: '(' without ')'"))
                    break
                out.append((i, j + 1, None))
                i = j + 1
            else:
                i += 1
        return out

    def _bare_parse(self, text: str) -> ParsedTurn:
        calls = [ToolCall(self.aliases[ch][0], {}, ch) for ch in text if ch in self.aliases]
        return ParsedTurn("".join(ch for ch in text if ch not in self.aliases), calls)

    def parse(self, text: str) -> ParsedTurn:
        if self.bare:
            return self._bare_parse(text)
        calls, pieces, pos = [], [], 0
        for start, end, err in self._scan(text):
            pieces.append(text[pos:start])
            raw = text[start:] if end < 0 else text[start:end]
            letter = raw[0]
            if err:
                calls.append(ToolCall(self.aliases.get(letter, ("", ""))[0], {}, raw, err))
            elif letter not in self.aliases:
                known = ", ".join(f"{k}(...) = {v[0]}" for k, v in self.aliases.items())
                calls.append(ToolCall("", {}, raw, f"unknown tool letter {letter!r}; known: {known}"))
            else:
                tool, arg = self.aliases[letter]
                calls.append(ToolCall(tool, {arg: raw[2:-1]}, raw))
            pos = len(text) if end < 0 else end
        pieces.append(text[pos:])
        return ParsedTurn("".join(pieces), calls)

    def stop_text(self) -> list[str]:
        return list(self.aliases) if self.bare else [")"]

    def results_of(self, observation: str) -> list[str]:
        return re.findall(r":([^:=]*)=", observation) or [observation]

    def call_complete(self, text: str) -> bool:
        if self.bare:
            return bool(text) and text[-1] in self.aliases
        spans = self._scan(text)
        return bool(spans) and spans[-1][1] == len(text)

    def render_observation(self, results, calls=(), *, tokenizer=None, tools=None) -> str:
        out = []
        for r in results:
            value = r.content.strip()
            out.append(f":{value}=" if r.ok and _NUMBER.fullmatch(value) else ":?=")
        return "".join(out)

    def check(self, tokenizer=None, tools=None) -> None:
        if tokenizer is None:
            return
        vocab = tokenizer.get_vocab()
        missing = sorted(c for c in SMOKE_ALPHABET if c not in vocab)
        if missing:
            raise ValueError(f"tool format 'smoke' needs the smoke tokenizer's characters; this tokenizer lacks "
                             f"{missing}. Use tool_format: qwen with a Qwen chat template")
        if tools is not None:
            names = {t["function"]["name"] for t in tools}
            unknown = sorted({v[0] for v in self.aliases.values()} - names)
            if unknown:
                raise ValueError(f"tool format 'smoke': aliases name tools that are not registered: {unknown}")


TOOL_FORMATS: dict[str, type[ToolFormat]] = {"qwen": QwenFormat, "smoke": SmokeFormat}


def get_format(name: str, **options: Any) -> ToolFormat:
    """The tool format named ``name`` (``qwen`` or ``smoke``)."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {name!r}; choose one of {', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[name](**options)
