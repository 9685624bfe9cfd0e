"""JSON schemas of tools from their signatures and docstrings, and argument validation against them."""
from __future__ import annotations

import collections.abc
import inspect
import re
import types
import typing
from typing import Any, Callable, Literal, Union

from .errors import ToolSpecError


# --------------------------------------------------------------------------------------------
# schemas from signatures and docstrings

_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Params|Keyword Args|Returns?|Yields?|Raises|Examples?|"
                      r"Notes?|See Also|Warnings?|Attributes)\s*:\s*$", re.I)
_GOOGLE_ARG = re.compile(r"^\s*\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_REST_FIELD = re.compile(r"^\s*:(\w+)(?:\s+([^:]+?))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """``(description, {parameter: description})`` from a Google-style (``Args:``), reST
    (``:param name:``) or NumPy-style (``Parameters`` over a dashed line) docstring. The
    description is the text before the first section or field, with lines joined; continuation
    lines of a parameter are joined to it."""
    lines = inspect.cleandoc(doc or "").splitlines()
    desc: list[str] = []
    params: dict[str, str] = {}
    section, current, args_indent, numpy = None, None, None, False
    skip = set()
    for i, line in enumerate(lines):
        if i in skip:
            continue
        underlined = i + 1 < len(lines) and re.fullmatch(r"\s*-{3,}\s*", lines[i + 1]) is not None
        m_section = _SECTION.match(line) or (_SECTION.match(line.rstrip() + ":") if underlined else None)
        m_rest = _REST_FIELD.match(line)
        if m_rest:
            kind, arg, text = m_rest.groups()
            section, current = "rest", None
            if kind in ("param", "parameter", "arg", "argument", "key", "keyword") and arg:
                current = arg.split()[-1]  # ":param int x:" names x
                params[current] = text.strip()
            continue
        if m_section:
            section = "args" if m_section.group(1).lower() in (
                "args", "arguments", "parameters", "params", "keyword args") else "other"
            current, args_indent, numpy = None, None, underlined
            if underlined:
                skip.add(i + 1)
            continue
        if section is None:
            desc.append(line)
            continue
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if section == "args":
            if args_indent is None:
                args_indent = indent
            if indent <= args_indent:
                if numpy:  # "name : type", the description on the indented lines below
                    current = line.split(":")[0].strip()
                    params[current] = ""
                    continue
                m = _GOOGLE_ARG.match(line)
                if m:
                    current = m.group(1)
                    params[current] = m.group(2).strip()
                    continue
        if current is not None and section in ("args", "rest") and indent > 0:
            params[current] = (params[current] + " " + line.strip()).strip()
    paragraphs = " ".join(x.strip() if x.strip() else "\n\n" for x in desc)
    description = re.sub(r" *\n\n *", "\n\n", paragraphs).strip()
    return description, params


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SUPPORTED = "str, int, float, bool, list[...], dict[str, ...], Literal[...], or Optional[...] / X | None of these"


def json_type(tp: Any, where: str) -> dict:
    """JSON schema of a type hint; ``where`` names the parameter for the error."""
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    if tp in (list, tuple):
        return {"type": "array"}
    if tp is dict:
        return {"type": "object"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple, collections.abc.Sequence):
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis) and len(set(args)) != 1:
            raise ToolSpecError(f"{where}: tuple types must be homogeneous (tuple[int, ...]); got {tp!r}. "
                                "Use list[...]")
        return {"type": "array", "items": json_type(args[0], where)} if args else {"type": "array"}
    if origin is dict:
        if args and args[0] is not str:
            raise ToolSpecError(f"{where}: JSON object keys are strings; use dict[str, ...], not {tp!r}")
        return {"type": "object", "additionalProperties": json_type(args[1], where)} if args else {"type": "object"}
    if origin is Literal:
        kinds = {_JSON_TYPES.get(type(a)) for a in args}
        if None in kinds or len(kinds) != 1:
            raise ToolSpecError(f"{where}: Literal values must all be str, or all int, ...; got {tp!r}")
        return {"type": kinds.pop(), "enum": list(args)}
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            inner = json_type(rest[0], where)
            return {**inner, "type": [inner["type"], "null"]}
        raise ToolSpecError(f"{where}: union {tp!r} is not supported; use one type (or Optional[X]). "
                            f"Supported: {_SUPPORTED}")
    raise ToolSpecError(f"{where}: type {tp!r} has no JSON equivalent. Supported: {_SUPPORTED}")


def tool_schema(fn: Callable, name: str | None = None) -> dict:
    """The "function" tool schema of ``fn`` from its signature and docstring (see the module doc).

    Raises ToolSpecError naming the tool and the problem: no docstring, a parameter without a
    type hint, a type JSON cannot express, ``*args`` / ``**kwargs`` / positional-only parameters,
    a docstring that documents a parameter the function does not have.
    """
    name = name or getattr(fn, "__name__", None) or type(fn).__name__
    tool = f"tool {name!r}"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ToolSpecError(f"{tool}: cannot read its signature ({e}); wrap it in a plain Python function") from e
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # NameError for a string annotation that names nothing
        raise ToolSpecError(f"{tool}: cannot resolve its type hints ({type(e).__name__}: {e}); "
                            "import the types its annotations name in its module") from e
    doc = inspect.getdoc(fn)
    if not doc:
        raise ToolSpecError(f"{tool}: it has no docstring; add one: its first lines are the description the "
                            "model sees, and an 'Args:' section describes each parameter")
    description, param_docs = parse_docstring(doc)
    props, required = {}, []
    for p in sig.parameters.values():
        where = f"{tool}, parameter {p.name!r}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolSpecError(f"{where}: *args / **kwargs cannot be described to a model; name each parameter")
        if p.kind is p.POSITIONAL_ONLY:
            raise ToolSpecError(f"{where}: positional-only parameters cannot be passed by name; remove the '/'")
        if p.name not in hints:
            raise ToolSpecError(f"{where} has no type hint; annotate it (e.g. '{p.name}: str'). "
                                f"Supported: {_SUPPORTED}")
        prop = json_type(hints[p.name], where)
        if p.name in param_docs and param_docs[p.name]:
            prop["description"] = param_docs[p.name]
        props[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    stale = sorted(set(param_docs) - set(props))
    if stale:
        raise ToolSpecError(f"{tool}: its docstring documents {stale}, which are not parameters of the function; "
                            "fix the docstring")
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": required}}}


def validate_arguments(schema: dict, arguments: Any) -> list[str]:
    """Problems of ``arguments`` against a tool schema's parameters (empty list: valid)."""
    params = schema["function"]["parameters"]
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {_json_name(arguments)}"]
    errs = [f"unknown argument {k!r}" for k in arguments if k not in params["properties"]]
    errs += [f"missing required argument {k!r}" for k in params["required"] if k not in arguments]
    for k, v in arguments.items():
        if k in params["properties"]:
            errs += _check(params["properties"][k], v, k)
    return errs


def _json_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _is(kind: str, v: Any) -> bool:
    """Whether ``v`` (decoded JSON) is of JSON type ``kind`` (a whole float counts as an integer)."""
    if isinstance(v, bool):
        return kind == "boolean"
    if kind == "integer":
        return isinstance(v, int) or isinstance(v, float) and v.is_integer()
    if kind == "number":
        return isinstance(v, (int, float))
    return isinstance(v, {"string": str, "boolean": bool, "array": (list, tuple), "object": dict,
                          "null": type(None)}[kind])


def _check(schema: dict, v: Any, path: str) -> list[str]:
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if not any(_is(k, v) for k in kinds):
        want = " or ".join(kinds)
        article = "an" if want[0] in "aeiou" else "a"
        return [f"argument {path!r} must be {article} {want}, got {_json_name(v)} {v!r:.60}"]
    if "enum" in schema and v not in schema["enum"]:
        return [f"argument {path!r} must be one of {schema['enum']}, got {v!r:.60}"]
    if isinstance(v, (list, tuple)) and "items" in schema:
        return [e for i, x in enumerate(v) for e in _check(schema["items"], x, f"{path}[{i}]")]
    if isinstance(v, dict) and "additionalProperties" in schema:
        return [e for k, x in v.items() for e in _check(schema["additionalProperties"], x, f"{path}.{k}")]
    return []


def _coerce(schema: dict, arguments: dict) -> dict:
    """Whole floats passed for integer parameters become ints (``3.0`` -> ``3``)."""
    out = dict(arguments)
    for k, v in arguments.items():
        prop = schema["function"]["parameters"]["properties"].get(k, {})
        if prop.get("type") in ("integer", ["integer", "null"]) and isinstance(v, float):
            out[k] = int(v)
    return out
