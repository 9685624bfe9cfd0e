"""Rule-based math answer verifier: ``math_verify(completion, answer) -> 1.0 | 0.0``.

Steps:

1. **Extract** the final answer of the completion: the content of the last ``\\boxed{...}`` (or
   ``\\fbox{...}``), nested braces respected; without one, the last number in the text (a
   ``#### 42`` GSM8K marker counts too). The reference answer goes through the same extraction
   when it holds a ``\\boxed{}`` or ``####``, otherwise it is used whole.
2. **Normalise**: drop ``$``, ``\\left``/``\\right``, spacing macros, ``\\text{}``/``\\mathrm{}``
   wrappers, degree signs, currency (``$ \\$ USD dollars € £ ¥``), trailing units words, a leading
   ``x =``; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; thousands separators ``1,234`` -> ``1234``.
3. **Compare**: if both parse to numbers (integers, decimals, signs, ``a/b``, ``\\frac{a}{b}``,
   mixed ``2\\frac{1}{2}``, ``1.5\\times10^{3}``, ``1e3``, percentages) they match when
   ``isclose(rel_tol=1e-4, abs_tol=1e-9)``; a percentage also matches its fraction
   (``50%`` == ``0.5``). Comma-separated tuples/intervals/lists compare element by element with
   the same brackets. Otherwise the normalised strings are compared (case-insensitive, spaces
   removed, ``^{2}`` == ``^2``, ``\\sqrt{2}`` == ``\\sqrt2``, ``(B)`` == ``B``).
"""
from __future__ import annotations

import math
import re

REL_TOL = 1e-4
ABS_TOL = 1e-9

_BOX_MACROS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces), or ``\\boxed 5``; None if absent."""
    best = -1
    macro_len = 0
    for macro in _BOX_MACROS:
        i = text.rfind(macro)
        if i > best:
            best, macro_len = i, len(macro)
    if best < 0:
        return None
    j = best + macro_len
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        depth = 0
        for k in range(j, len(text)):
            ch = text[k]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[j + 1:k]
        return None  # unbalanced braces: no usable box
    # "\boxed 5" form: up to the next whitespace or '$'
    m = re.match(r"[^\s$]+", text[j:])
    return m.group(0) if m else None


_NUM_RE = re.compile(
    r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+"
)


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``-1,234.5``, ``3/4``, ``.5``), with a following ``%`` kept."""
    last = None
    for m in _NUM_RE.finditer(text):
        last = m
    if last is None:
        return None
    s = last.group(0)
    if text[last.end():last.end() + 1] == "%" or text[last.end():last.end() + 2] == "\\%":
        s += "%"
    return s


def extract_answer(completion: str) -> str | None:
    """Final answer of a completion: last box, else text after the last ``####``, else last number."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    if any(m in completion for m in _BOX_MACROS):
        return None  # a box was attempted but is malformed (unbalanced braces): no answer
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip()
        if tail:
            return tail.splitlines()[0]
    return last_number(completion)


def _strip_braced_macro(s: str, macro: str) -> str:
    """``\\text{abc}`` -> ``abc`` for every occurrence (nested braces respected)."""
    while True:
        i = s.find(macro + "{")
        if i < 0:
            return s
        j = i + len(macro)
        depth, k = 0, j
        for k in range(j, len(s)):
            if s[k] == "{":
                depth += 1
            elif s[k] == "}":
                depth -= 1
                if depth == 0:
                    break
        else:
            return s
        s = s[:i] + s[j + 1:k] + s[k + 1:]


_UNIT_WORDS = (
    "dollars?", "cents?", "usd", "eur", "euros?", "pounds?", "yuan", "rmb", "yen", "rupees?",
    "units?", "square", "sq", "cubic", "meters?", "metres?", "centimeters?", "millimeters?", "kilometers?",
    "cm", "mm", "km", "m", "inches?", "inch", "feet", "foot", "ft", "yards?", "miles?", "mph",
    "kg", "g", "grams?", "kilograms?", "lbs?", "ounces?", "oz", "liters?", "litres?", "ml", "l",
    "seconds?", "secs?", "s", "minutes?", "mins?", "hours?", "hrs?", "h", "days?", "weeks?", "months?", "years?",
    "degrees?", "deg", "points?", "people", "persons?", "students?", "apples?", "items?", "pages?",
    "times", "ways", "cookies", "marbles", "books", "cars", "boxes", "pieces", "tickets",
)
_UNIT_TAIL = re.compile(r"(?:\s*(?:" + "|".join(_UNIT_WORDS) + r")(?:\^?\{?[23]\}?)?\.?)+\s*$", re.IGNORECASE)


def normalize_answer(s: str) -> str:
    """Canonical string form of an answer (see module docstring); used for both sides."""
    s = s.strip()
    s = _strip_braced_macro(s, "\\boxed")
    for macro in ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\textrm", "\\mbox", "\\operatorname"):
        s = _strip_braced_macro(s, macro)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for tok in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\quad", "\\qquad", "\\displaystyle"):
        s = s.replace(tok, "")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\^\s*\{?\\circ\}?|°|\\degree", "", s)
    s = s.replace("\\%", "%")
    for cur in ("€", "£", "¥", "₹"):
        s = s.replace(cur, "")
    s = s.strip()
    s = re.sub(r"^(?:usd|eur|rmb|rs\.?)\s*", "", s, flags=re.IGNORECASE)
    s = s.rstrip(".").strip()
    # "x = 5" / "k=3": keep the right-hand side of a single leading variable assignment
    m = re.match(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(.+)$", s)
    if m:
        s = m.group(1)
    # trailing unit words ("5 cm", "12 apples"): only strip after something numeric-looking
    if re.search(r"[\d}]", s):
        stripped = _UNIT_TAIL.sub("", s)
        if stripped.strip():
            s = stripped
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"(?<!\d)(\d{1,3}(?:,\d{3})+)(?![\d,])", lambda mm: mm.group(1).replace(",", ""), s)
    return s


def _frac_value(s: str) -> float | None:
    m = re.fullmatch(r"(-?)\s*(\d+)?\s*\\frac\s*\{\s*(-?\d+(?:\.\d+)?)\s*\}\s*\{\s*(-?\d+(?:\.\d+)?)\s*\}", s)
    if not m:
        m = re.fullmatch(r"(-?)\s*(\d+)?\s*\\frac\s*(\d)\s*(\d)", s)  # \frac12
    if not m:
        return None
    sign, whole, num, den = m.groups()
    if float(den) == 0:
        return None
    v = float(num) / float(den)
    if whole:
        v = float(whole) + v
    return -v if sign else v


def parse_number(s: str) -> tuple[float, bool] | None:
    """Numeric value of a normalised answer and whether it was a percentage; None if not a number."""
    s = s.replace(" ", "")
    pct = s.endswith("%")
    if pct:
        s = s[:-1]
    if s.startswith("+"):
        s = s[1:]
    if s.startswith("(") and s.endswith(")") and "," not in s:
        s = s[1:-1]
    v = _frac_value(s)
    if v is None:
        m = re.fullmatch(r"(-?\d+(?:\.\d+)?|-?\.\d+)(?:\\times10\^\{?(-?\d+)\}?|[eE]([+-]?\d+))?", s)
        if m:
            v = float(m.group(1)) * (10.0 ** int(m.group(2) or m.group(3) or 0))
        else:
            m = re.fullmatch(r"(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)", s)
            if m and float(m.group(2)) != 0:
                v = float(m.group(1)) / float(m.group(2))
            else:
                m = re.fullmatch(r"-?\(?(-?\d+)\)?/\(?(\d+)\)?", s)  # (3)/(4) leftovers
                if m and float(m.group(2)) != 0:
                    v = float(m.group(1)) / float(m.group(2))
    if v is None or math.isnan(v) or math.isinf(v):
        return None
    return v, pct


def _numbers_match(a: tuple[float, bool], b: tuple[float, bool]) -> bool:
    (va, pa), (vb, pb) = a, b
    cands_a = [va] + ([va / 100.0] if pa else [])
    cands_b = [vb] + ([vb / 100.0] if pb else [])
    return any(math.isclose(x, y, rel_tol=REL_TOL, abs_tol=ABS_TOL) for x in cands_a for y in cands_b)


def _canon_string(s: str) -> str:
    s = s.lower().replace(" ", "")
    s = re.sub(r"\^\{(\w)\}", r"^\1", s)
    s = re.sub(r"_\{(\w)\}", r"_\1", s)
    s = re.sub(r"\\sqrt\{(\w+)\}", r"\\sqrt\1", s)
    s = re.sub(r"\\frac\{(\w)\}\{(\w)\}", r"\\frac\1\2", s)
    s = re.sub(r"^\((\w)\)$", r"\1", s)  # (B) -> b
    s = s.replace("{", "").replace("}", "") if re.fullmatch(r"[\w{}]+", s) else s
    return s


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def answers_match(pred: str, ref: str) -> bool:
    """True when two (extracted) answers are equivalent after normalisation."""
    p, r = normalize_answer(pred), normalize_answer(ref)
    if not p or not r:
        return False
    np_, nr = parse_number(p), parse_number(r)
    if np_ is not None and nr is not None:
        return _numbers_match(np_, nr)
    # tuples / intervals / lists: same brackets, element-wise comparison
    br = re.compile(r"^([(\[{]?)(.*?)([)\]}]?)$", re.S)
    mp, mr = br.match(p), br.match(r)
    if "," in p and "," in r and mp and mr and (mp.group(1), mp.group(3)) == (mr.group(1), mr.group(3)):
        ep, er = _split_top_level(mp.group(2)), _split_top_level(mr.group(2))
        if len(ep) == len(er) and len(ep) > 1:
            return all(answers_match(x, y) for x, y in zip(ep, er))
    return _canon_string(p) == _canon_string(r)


def math_verify(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the reference answer, else 0.0.

    Args:
        completion: model output text (reasoning + final answer, ideally in ``\\boxed{}``).
        answer: reference answer (plain, LaTeX, or itself containing ``\\boxed{}`` / ``####``).
    """
    if completion is None or answer is None:
        return 0.0
    pred = extract_answer(str(completion))
    if pred is None:
        return 0.0
    ref = str(answer)
    if last_boxed(ref) is not None or "####" in ref:
        ref = extract_answer(ref) or ref
    return 1.0 if answers_match(pred, ref) else 0.0
