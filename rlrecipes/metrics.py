"""TPS accounting, stage timers and the metrics.jsonl sink, reported the same way everywhere.

One JSON line per step with (DESIGN §6): ``step``, ``perf/tokens`` (prompt + response tokens of
all samples trained on), ``perf/tps_per_card = tokens / step_seconds / cards``,
``timing_s/<stage>``, ``timing_s/step``, ``perf/dispatch_skew_s`` (last minus first worker start
of a stage, the maximum over stages), ``reward/mean``, ``actor/loss``, ``actor/kl``,
``actor/clipfrac``, ``actor/grad_norm``, ``response_length/mean``, ``mem/peak_gb``, plus
``perf/overhead_share`` (share of the step outside model compute: dock, dispatch, reshard).
"""
from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

# Stages whose time is model compute; everything else in a step is overhead.
COMPUTE_STAGES = ("rollout", "ref", "old", "values", "update", "critic_update")


class StageTimer:
    """Wall time and start timestamp of each stage of one step on one worker."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.starts: dict[str, float] = {}
        self.compute: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        t0 = time.time()
        self.starts.setdefault(name, t0)
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.time() - t0

    def add_compute(self, name: str, seconds: float) -> None:
        """Model-compute seconds inside a stage (the rest of the stage is overhead)."""
        self.compute[name] = self.compute.get(name, 0.0) + seconds


def dispatch_skew(starts_per_worker: Iterable[dict[str, float]]) -> float:
    """Max over stages of (last worker start - first worker start)."""
    by_stage: dict[str, list[float]] = {}
    for starts in starts_per_worker:
        for k, t in starts.items():
            by_stage.setdefault(k, []).append(t)
    return max((max(v) - min(v) for v in by_stage.values() if len(v) > 1), default=0.0)


def tps_per_card(tokens: int, seconds: float, cards: float) -> float:
    return tokens / seconds / cards if seconds > 0 and cards > 0 else 0.0


class MetricsWriter:
    """Appends one JSON object per line to ``<run>/metrics.jsonl`` (flushed per line)."""

    def __init__(self, path: Path, truncate_after_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_after_step is not None and self.path.exists():
            # a resumed run continues after its checkpoint: drop lines of steps it will redo
            keep = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= truncate_after_step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        self._f = self.path.open("a")

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
