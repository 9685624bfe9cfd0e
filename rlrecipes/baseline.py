"""Compare a run's TPS/card to a recipe's ``baseline.json`` (the CI gate behind `rlrecipes check`).

``baseline.json`` holds one entry per hardware name::

    {"recipe": "qwen25_7b",
     "hardware": {"atlas-a3": {"tps_per_card": 220, "tolerance": 0.10, "refresh_above": 0.10,
                               "steps": [3, 100], "card": "...", "source": "...", "conditions": {...}}}}

The median of ``perf/tps_per_card`` over the step window [first, last] (inclusive; warm-up
steps excluded) must be at least ``tps_per_card * (1 - tolerance)``; above
``tps_per_card * (1 + refresh_above)`` the baseline is stale and should be refreshed.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path


class BaselineError(ValueError):
    pass


@dataclass
class CheckResult:
    hardware: str
    median_tps: float
    baseline_tps: float
    floor: float
    ceiling: float
    steps_used: list[int]
    regression: bool
    refresh: bool

    def message(self) -> str:
        ratio = self.median_tps / self.baseline_tps if self.baseline_tps else float("inf")
        s = (f"median TPS/card {self.median_tps:.2f} over steps {self.steps_used[0]}-{self.steps_used[-1]} "
             f"({len(self.steps_used)} steps) vs baseline {self.baseline_tps:.2f} on {self.hardware} "
             f"({ratio:.0%}); floor {self.floor:.2f}")
        if self.regression:
            return "REGRESSION: " + s
        if self.refresh:
            return f"OK, above refresh_above ({self.ceiling:.2f}): refresh the baseline. " + s
        return "OK: " + s


def _number(v, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise BaselineError(f"{where} must be a finite number, got {v!r}")
    return float(v)


def load_baseline(path: Path, hardware: str) -> dict:
    """The ``hardware`` entry of a baseline.json, with its types checked (errors name the key)."""
    from .inputs import read_json_object

    try:
        data = read_json_object(Path(path), "baseline.json")
    except ValueError as e:
        raise BaselineError(str(e)) from None
    hw = data.get("hardware")
    if not isinstance(hw, dict):
        raise BaselineError(f"{path}: `hardware` must be an object of entries per hardware name "
                            f"(e.g. {{\"cpu\": {{\"tps_per_card\": 1500, ...}}}}), got {type(hw).__name__}")
    if hardware not in hw:
        raise BaselineError(f"{path}: no entry for hardware {hardware!r}; entries: {', '.join(hw) or '(none)'}")
    entry = hw[hardware]
    where = f"{path}: hardware.{hardware}"
    if not isinstance(entry, dict):
        raise BaselineError(f"{where} must be an object, got {type(entry).__name__}")
    for key in ("tps_per_card", "tolerance", "steps"):
        if key not in entry:
            raise BaselineError(f"{where}.{key} is missing")
    tps = _number(entry["tps_per_card"], f"{where}.tps_per_card")
    tol = _number(entry["tolerance"], f"{where}.tolerance")
    if tps <= 0 or not 0 <= tol < 1:
        raise BaselineError(f"{where}: tps_per_card must be > 0 and tolerance in [0, 1); got {tps}, {tol}")
    if "refresh_above" in entry:
        _number(entry["refresh_above"], f"{where}.refresh_above")
    steps = entry["steps"]
    if (not isinstance(steps, list) or len(steps) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in steps)
            or steps[0] > steps[1]):
        raise BaselineError(f"{where}.steps must be [first, last] step numbers, got {steps!r}")
    return entry


def read_metrics(run_dir: Path, *, allow_partial_last: bool = False) -> list[dict]:
    """The rows of ``<run>/metrics.jsonl``; every error names the file and line.

    ``null`` values (written for NaN) are kept as None; ``allow_partial_last`` tolerates a
    half-written last line (a run killed mid-write), which is then dropped.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise BaselineError(f"{run_dir}: no such run folder")
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        raise BaselineError(f"{run_dir}: no metrics.jsonl; pass the folder a `rlrecipes run` wrote")
    try:
        text = f.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise BaselineError(f"{f}: not UTF-8 text (byte {e.start}); is this a metrics file?") from None
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if allow_partial_last and i == len(lines) and not text.endswith("\n"):
                break  # the tail of an interrupted write
            raise BaselineError(f"{f}:{i}: invalid JSON line: {e.msg}") from None
        if not isinstance(row, dict):
            raise BaselineError(f"{f}:{i}: a row must be a JSON object, got {type(row).__name__}")
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise BaselineError(f"{f}:{i}: row has no integer `step` (got {step!r}); every row `rlrecipes run` "
                                "writes has one")
        rows.append(row)
    return rows


def check_run(run_dir: Path, baseline: Path, hardware: str) -> CheckResult:
    entry = load_baseline(baseline, hardware)
    rows = read_metrics(run_dir)
    first, last = entry["steps"]
    in_window = [r for r in rows if first <= r["step"] <= last]
    window = [r for r in in_window if isinstance(r.get("perf/tps_per_card"), (int, float))]
    if not window:
        have = [r.get("step") for r in rows]
        if in_window:
            raise BaselineError(f"{run_dir}/metrics.jsonl: steps {first}-{last} have no numeric perf/tps_per_card "
                                "(null or missing): the run recorded no throughput to check")
        raise BaselineError(f"{run_dir}/metrics.jsonl has no steps in the baseline window [{first}, {last}] "
                            f"(steps present: {have[:3]}...{have[-3:] if have else []}); run more steps")
    med = statistics.median(r["perf/tps_per_card"] for r in window)
    base = float(entry["tps_per_card"])
    floor = base * (1 - float(entry["tolerance"]))
    ceiling = base * (1 + float(entry.get("refresh_above", entry["tolerance"])))
    return CheckResult(hardware, med, base, floor, ceiling, [r["step"] for r in window], med < floor, med > ceiling)
