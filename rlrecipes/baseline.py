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


def load_baseline(path: Path, hardware: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BaselineError(f"{path}: no such baseline file") from None
    except json.JSONDecodeError as e:
        raise BaselineError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    hw = data.get("hardware") or {}
    if hardware not in hw:
        raise BaselineError(f"{path}: no entry for hardware {hardware!r}; entries: {', '.join(hw) or '(none)'}")
    entry = hw[hardware]
    for key in ("tps_per_card", "tolerance", "steps"):
        if key not in entry:
            raise BaselineError(f"{path}: hardware.{hardware}.{key} is missing")
    return entry


def read_metrics(run_dir: Path) -> list[dict]:
    f = Path(run_dir) / "metrics.jsonl"
    if not f.is_file():
        raise BaselineError(f"{run_dir}: no metrics.jsonl; pass the folder a `rlrecipes run` wrote")
    rows = []
    for i, line in enumerate(f.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise BaselineError(f"{f}:{i}: invalid JSON line: {e.msg}") from None
    return rows


def check_run(run_dir: Path, baseline: Path, hardware: str) -> CheckResult:
    entry = load_baseline(baseline, hardware)
    rows = read_metrics(run_dir)
    first, last = entry["steps"]
    window = [r for r in rows if first <= r.get("step", -1) <= last and "perf/tps_per_card" in r]
    if not window:
        have = [r.get("step") for r in rows]
        raise BaselineError(f"{run_dir}/metrics.jsonl has no steps in the baseline window [{first}, {last}] "
                            f"(steps present: {have[:3]}...{have[-3:] if have else []}); run more steps")
    med = statistics.median(r["perf/tps_per_card"] for r in window)
    base = float(entry["tps_per_card"])
    floor = base * (1 - float(entry["tolerance"]))
    ceiling = base * (1 + float(entry.get("refresh_above", entry["tolerance"])))
    return CheckResult(hardware, med, base, floor, ceiling, [r["step"] for r in window], med < floor, med > ceiling)
