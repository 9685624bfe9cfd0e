"""Tool registry: schemas from signatures and docstrings, clear declaration errors, argument
validation and failures as observations, the calculator's refusals, and the tool pool."""
from __future__ import annotations

import threading
import time
from typing import Literal, Optional

import pytest

from rlrecipes.agent import (
    ToolCall,
    ToolError,
    ToolExecutor,
    ToolRegistry,
    ToolSpecError,
    calculator,
    parse_docstring,
    tool_schema,
)


def weather(city: str, days: int, unit: Literal["c", "f"] = "c", hourly: bool = False,
            stations: list[str] | None = None, weights: Optional[dict[str, float]] = None, scale: float = 1.0) -> str:
    """Forecast for a city.

    Uses the nearest stations.

    Args:
        city: The city's English name,
            as on a map.
        days (int): How many days ahead.
        unit: Celsius or Fahrenheit.
        hourly: One value per hour.
        stations: Station ids to use.
        weights: Weight per station.
        scale: A factor.

    Returns:
        The forecast as text.
    """
    return f"{city} {days}"


def test_schema_from_signature_and_google_docstring():
    assert tool_schema(weather) == {"type": "function", "function": {
        "name": "weather",
        "description": "Forecast for a city.\n\nUses the nearest stations.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city's English name, as on a map."},
            "days": {"type": "integer", "description": "How many days ahead."},
            "unit": {"type": "string", "enum": ["c", "f"], "description": "Celsius or Fahrenheit."},
            "hourly": {"type": "boolean", "description": "One value per hour."},
            "stations": {"type": ["array", "null"], "items": {"type": "string"}, "description": "Station ids to use."},
            "weights": {"type": ["object", "null"], "additionalProperties": {"type": "number"},
                        "description": "Weight per station."},
            "scale": {"type": "number", "description": "A factor."},
        }, "required": ["city", "days"]}}}


def test_schema_from_rest_docstring():
    def area(width: float, height: float = 1.0) -> float:
        """Area of a rectangle.

        :param width: Width in metres,
            positive.
        :param float height: Height in metres.
        :returns: the area.
        """
        return width * height

    fn = tool_schema(area)["function"]
    assert fn["description"] == "Area of a rectangle."
    assert fn["parameters"]["properties"] == {
        "width": {"type": "number", "description": "Width in metres, positive."},
        "height": {"type": "number", "description": "Height in metres."}}
    assert fn["parameters"]["required"] == ["width"]
    assert parse_docstring("One line.") == ("One line.", {})
    numpy_style = """Scale a vector.

    Parameters
    ----------
    values : list of float
        The vector,
        any length.
    factor : float
        The factor.

    Returns
    -------
    list of float
    """
    assert parse_docstring(numpy_style) == ("Scale a vector.", {"values": "The vector, any length.",
                                                               "factor": "The factor."})


class Point:
    pass


def _no_hint(x) -> str:
    """Doc."""


def _bad_type(p: Point) -> str:
    """Doc."""


def _star(*values: int) -> str:
    """Doc."""


def _no_doc(x: int) -> str:
    return ""


def _stale(x: int) -> str:
    """Doc.

    Args:
        x: fine.
        y: gone.
    """


def _bad_union(x: int | str) -> str:
    """Doc."""


@pytest.mark.parametrize("fn, words", [
    (_no_hint, ["'_no_hint'", "'x'", "no type hint", "x: str"]),
    (_bad_type, ["'_bad_type'", "'p'", "Point", "no JSON equivalent", "Supported"]),
    (_star, ["'_star'", "*args"]),
    (_no_doc, ["'_no_doc'", "no docstring", "add one"]),
    (_stale, ["'_stale'", "['y']", "fix the docstring"]),
    (_bad_union, ["'_bad_union'", "union", "Optional"]),
])
def test_declaration_errors_name_the_tool_and_the_fix(fn, words):
    with pytest.raises(ToolSpecError) as e:
        ToolRegistry([fn])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_module_function_tools_and_their_errors(tmp_path, monkeypatch):
    (tmp_path / "agent_test_tools.py").write_text(
        'def shout(text: str) -> str:\n    """Upper-case text.\n\n    Args:\n        text: what to shout.\n    """\n'
        "    return text.upper()\n\nLIMIT = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = ToolRegistry(["agent_test_tools:shout", "calculator"])
    assert reg.names == ["shout", "calculator"]
    assert reg.get("shout").spec == "agent_test_tools:shout"
    assert reg.run("shout", {"text": "hi"}).content == "HI"

    cases = {
        "no_such_module_rlrecipes_x:fn": ["cannot import module 'no_such_module_rlrecipes_x'", "PYTHONPATH"],
        "agent_test_tools:shot": ["has no attribute 'shot'", "Did you mean 'shout'?"],
        "agent_test_tools:LIMIT": ["is a int, not callable"],
        "calculater": ["unknown tool 'calculater'", "Did you mean 'calculator'?", "pkg.module:function"],
    }
    for spec, words in cases.items():
        with pytest.raises(ToolSpecError) as e:
            ToolRegistry([spec])
        for w in words:
            assert w in str(e.value), (spec, w, str(e.value))
    with pytest.raises(ToolSpecError, match="already taken"):
        ToolRegistry(["calculator", "calculator"])


def _fail(x: int) -> str:
    """Fails.

    Args:
        x: anything.
    """
    if x == 1:
        raise ValueError("bad x")
    if x == 2:
        raise ToolError("x must not be 2")
    if x == 3:
        return object()  # type: ignore[return-value]
    if x == 4:
        return {"value": [1, 2.5, None]}  # type: ignore[return-value]
    return "z" * x


def test_run_turns_every_failure_into_an_observation():
    reg = ToolRegistry(["calculator", _fail])
    r = reg.run("calculator", {"expression": "2+3"})
    assert (r.ok, r.content, r.error) == (True, "5", None)

    bad = [  # (tool, arguments, kind of failure, words of the observation)
        ("calculator", "not a dict", "invalid_arguments", "must be a JSON object"),
        ("calculator", {}, "invalid_arguments", "missing required argument 'expression'"),
        ("calculator", {"expression": "1", "x": 1}, "invalid_arguments", "unknown argument 'x'"),
        ("calculator", {"expression": 7}, "invalid_arguments", "'expression' must be a string, got integer 7"),
        ("_fail", {"x": True}, "invalid_arguments", "must be an integer, got boolean"),
        ("_fail", {"x": 1.5}, "invalid_arguments", "must be an integer, got number"),
        ("calc", {}, "unknown_tool", "Did you mean 'calculator'?"),
        ("_fail", {"x": 1}, "exception", "raised ValueError: bad x"),
        ("_fail", {"x": 2}, "tool_error", "x must not be 2"),
        ("_fail", {"x": 3}, "bad_output", "neither text nor JSON"),
        ("_fail", {"x": 3.0}, "bad_output", "neither text nor JSON"),  # a whole float is an integer
    ]
    for name, args, kind, words in bad:
        r = reg.run(name, args)
        assert not r.ok and r.error == kind and words in r.content, (name, args, r)
        assert r.content.startswith("Error: ")
    assert reg.run("_fail", {"x": 4}).content == '{"value": [1, 2.5, null]}'
    long = ToolRegistry([_fail], max_observation_chars=50).run("_fail", {"x": 80})
    assert long.ok and long.content.startswith("z" * 50) and "30 more characters" in long.content


def test_a_tool_that_does_not_return_times_out():
    release = threading.Event()

    def stuck(x: int) -> str:
        """Waits.

        Args:
            x: ignored.
        """
        release.wait(30)
        return "late"

    reg = ToolRegistry([stuck])
    try:
        r = reg.run("stuck", {"x": 1}, timeout_s=0.2)
        assert (r.ok, r.error) == (False, "timeout")
        assert "timed out after 0.2 s" in r.content
    finally:
        release.set()


@pytest.mark.parametrize("expr, want", [
    ("2+3", "5"), ("(407 + 512) * 3", "2757"), ("7 // 2", "3"), ("7 % 3", "1"), ("-2**2", "-4"), ("+4", "4"),
    ("1/4", "0.25"), ("2**0.5", "1.41421356237"), ("sqrt(16) + abs(-2)", "6"), ("round(2.567, 2)", "2.57"),
    ("max(1, 5, 3)", "5"), ("10**30", "1" + "0" * 30),
])
def test_calculator_arithmetic(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize("expr, words", [
    ("__import__('os')", "call of '__import__'"),
    ("__import__('os').system('true')", "not allowed"),
    ("().__class__", "not allowed"),
    ("open('/etc/passwd')", "call of 'open'"),
    ("(lambda: 1)()", "not allowed"),
    ("x + 1", "name 'x'"),
    ("'a' * 3", "str constant"),
    ("[1, 2]", "List"),
    ("9**9**9", "exponent too large"),
    ("2**100000", "exponent too large"),
    ("(10**3000) * (10**3000)", "too large"),
    ("round(10**300, -10**9)", "ndigits"),
    ("1/0", "division by zero"),
    ("1e308 * 10", "not a finite number"),
    ("sqrt(-1)", "ValueError"),
    ("1 +", "invalid expression"),
    ("1" * 2000, "too long"),
])
def test_calculator_refuses(expr, words):
    with pytest.raises(ToolError) as e:
        calculator(expr)
    assert words in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# the pool


def _gated_registry(gate: threading.Event, started: threading.Event) -> ToolRegistry:
    def slow(x: int) -> str:
        """Waits for the gate.

        Args:
            x: returned.
        """
        started.set()
        gate.wait(30)
        return f"slow {x}"

    def fast(x: int) -> str:
        """Returns at once.

        Args:
            x: returned.
        """
        return f"fast {x}"

    return ToolRegistry([slow, fast])


def test_pool_slow_tool_does_not_delay_a_fast_one():
    gate, started = threading.Event(), threading.Event()
    with ToolExecutor(_gated_registry(gate, started), max_workers=2, timeout_s=30) as pool:
        futures = pool.submit([ToolCall("slow", {"x": 1}), ToolCall("fast", {"x": 2})])
        assert started.wait(10)
        # the fast call finishes while the slow one is still blocked on the gate
        assert futures[1].result(timeout=10).content == "fast 2"
        assert not futures[0].done()
        gate.set()
        assert [r.content for r in pool.results(futures)] == ["slow 1", "fast 2"]


def test_pool_per_call_timeout_and_results_in_call_order():
    gate, started = threading.Event(), threading.Event()
    try:
        with ToolExecutor(_gated_registry(gate, started), max_workers=4, timeout_s=0.3) as pool:
            calls = [ToolCall("fast", {"x": 1}), ToolCall("slow", {"x": 2}),
                     ToolCall("", {}, "<tool_call>{oops</tool_call>", "not valid JSON"),
                     ToolCall("nope", {}), ToolCall("fast", {"x": "3"}), ToolCall("fast", {"x": 4})]
            results = pool.run(calls)
            assert [(r.ok, r.error) for r in results] == [
                (True, None), (False, "timeout"), (False, "parse_error"), (False, "unknown_tool"),
                (False, "invalid_arguments"), (True, None)]
            assert [r.content for r in results][0::5] == ["fast 1", "fast 4"]
            assert "timed out after 0.3 s" in results[1].content
            assert results[2].content == "Error: not valid JSON"
    finally:
        gate.set()


def test_pool_many_calls_run_concurrently():
    """Eight calls that each wait for all eight to have started can only finish if they overlap."""
    barrier = threading.Barrier(8, timeout=10)

    def meet(x: int) -> int:
        """Waits for the others.

        Args:
            x: returned.
        """
        barrier.wait()
        return x

    with ToolExecutor(ToolRegistry([meet]), max_workers=8, timeout_s=20) as pool:
        results = pool.run([ToolCall("meet", {"x": i}) for i in range(8)])
    assert [r.content for r in results] == [str(i) for i in range(8)]
    with pytest.raises(ValueError, match="max_workers"):
        ToolExecutor(ToolRegistry(), max_workers=0)


def test_python_builtin_runs_sandboxed_with_the_call_timeout():
    reg = ToolRegistry(["python"])
    r = reg.run("python", {"code": "print(6 * 7)"}, timeout_s=10)
    assert (r.ok, r.content) == (True, "42")
    t0 = time.monotonic()
    r = reg.run("python", {"code": "while True: pass"}, timeout_s=0.5)
    assert (r.ok, r.error) == (False, "timeout") and "timed out after 0.5 s" in r.content
    assert time.monotonic() - t0 < 8  # killed at the wall-clock limit, not at the end of a CPU limit
    r = reg.run("python", {"code": "raise KeyError('k')"})
    assert (r.ok, r.error) == (False, "tool_error") and "KeyError: 'k'" in r.content
