"""The built-in tools: a safe ``calculator`` and ``python`` in the sandbox."""
from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from .errors import ToolError
from .sandbox import run_python


# --------------------------------------------------------------------------------------------
# built-in tools

MAX_INT_BITS = 10_000  # about 3000 decimal digits
MAX_EXPRESSION_CHARS = 1000
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _round(x: Any, ndigits: Any = None) -> Any:
    if ndigits is not None and (not isinstance(ndigits, int) or abs(ndigits) > 100):
        raise ToolError("round(x, ndigits): ndigits must be an integer between -100 and 100")
    return round(x, ndigits)


_FUNCTIONS: dict[str, Callable] = {
    "sqrt": math.sqrt, "exp": math.exp, "log": math.log, "log2": math.log2, "log10": math.log10,
    "sin": math.sin, "cos": math.cos, "tan": math.tan, "asin": math.asin, "acos": math.acos, "atan": math.atan,
    "abs": abs, "round": _round, "floor": math.floor, "ceil": math.ceil, "min": min, "max": max,
}


def _size_check(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number (overflow or an undefined operation)")
    return value


def _pow(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        bits = b * (abs(a).bit_length() - 1)
        if bits > MAX_INT_BITS:
            raise ToolError(f"exponent too large: {a}**{b} has about {int(bits * math.log10(2))} digits "
                            f"(the limit is about {int(MAX_INT_BITS * math.log10(2))})")
    return a ** b  # a float power is one C call whatever its size; OverflowError is caught


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _size_check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _size_check(_pow(a, b))
        if isinstance(node.op, ast.Mult) and isinstance(a, int) and isinstance(b, int) \
                and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
            raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
        return _size_check(_BINOPS[type(node.op)](a, b))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
            and not node.keywords:
        args = [_eval(a) for a in node.args]
        return _size_check(_FUNCTIONS[node.func.id](*args))
    what = type(node).__name__
    if isinstance(node, ast.Name):
        what = f"name {node.id!r}"
    elif isinstance(node, ast.Call):
        what = f"call of {ast.unparse(node.func)!r}"
    elif isinstance(node, ast.Constant):
        what = f"{type(node.value).__name__} constant"
    raise ToolError(f"not allowed in an arithmetic expression: {what}. Allowed: numbers, + - * / // % **, "
                    f"parentheses, {', '.join(_CONSTANTS)}, and {', '.join(_FUNCTIONS)}")


def _format_number(x: Any) -> str:
    if isinstance(x, float):
        if x.is_integer() and abs(x) < 1e16:
            return str(int(x))
        return f"{x:.12g}"
    return str(x)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(407 + 512) * 3". The
            constants pi, e, tau and the functions sqrt, exp, log, log2, log10, sin, cos, tan,
            asin, acos, atan, abs, round, floor, ceil, min, max are available.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression too long ({len(expression)} characters; the limit is {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"invalid expression: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise ToolError(f"invalid expression: {type(e).__name__}: {e}"[:300]) from None
    try:
        return _format_number(_eval(tree))
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as e:
        raise ToolError(f"{type(e).__name__}: {e}") from None
    except RecursionError:
        raise ToolError("expression too deeply nested") from None


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints (stdout, then stderr).

    Each call starts a fresh interpreter (nothing is kept between calls); print the values you need.

    Args:
        code: The complete program, as it would be written in a .py file.
    """
    r = run_python(code)
    if not r.ok:
        raise ToolError(r.observation())
    return r.observation()


BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator, "python": python}
