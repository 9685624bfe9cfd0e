"""TPS accounting, stage timers and the metrics.jsonl sink, reported the same way everywhere.

One JSON line per step with: ``step``, ``perf/tokens`` (prompt + response tokens of
all samples trained on), ``perf/tps_per_card = tokens / step_seconds / cards``,
``timing_s/<stage>``, ``timing_s/step``, ``perf/dispatch_skew_s`` (last minus first worker start
of a stage, the maximum over stages), ``reward/mean``, ``actor/loss``, ``actor/kl``,
``actor/clipfrac``, ``actor/grad_norm``, ``response_length/mean``, ``mem/peak_gb``, plus
``perf/overhead_share`` (share of the step outside model compute: dock, dispatch, reshard).
"""
from __future__ import annotations

import json
import math
import os
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
        self.dock_wait: dict[str, float] = {}
        self.dock_trips: dict[str, int] = {}

    @contextmanager
    def stage(self, name: str, dock=None):
        """Time a stage; with ``dock`` (a DockClient) also the round trips and seconds it waited on it."""
        t0 = time.time()
        self.starts.setdefault(name, t0)
        w0, n0 = (dock.wait_s, dock.round_trips) if dock is not None else (0.0, 0)
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.time() - t0
            if dock is not None:
                self.dock_wait[name] = self.dock_wait.get(name, 0.0) + dock.wait_s - w0
                self.dock_trips[name] = self.dock_trips.get(name, 0) + dock.round_trips - n0

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


class MetricsError(RuntimeError):
    """metrics.jsonl cannot be written, vanished or was replaced during a run (the message names it)."""


class MetricsWriter:
    """Appends one JSON object per line to ``<run>/metrics.jsonl``, flushed per line.

    ``rows`` (on resume) replaces the file's content first, atomically (write + rename). Before
    each write the path is checked to still be the file this writer opened: a metrics file that
    vanished or was replaced during the run is an error, never a silent loss of every later row.
    """

    def __init__(self, path: Path, rows: list[dict] | None = None) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if rows is not None:
                tmp = self.path.with_name(f".{self.path.name}.tmp")
                tmp.write_text("".join(json.dumps(_clean(r)) + "\n" for r in rows))
                os.replace(tmp, self.path)
            self._f = self.path.open("a")
        except OSError as e:
            raise MetricsError(f"{self.path}: cannot write the metrics file ({e.strerror})") from None
        self._ino = os.fstat(self._f.fileno()).st_ino
        self.loggers: list = []  # extra sinks (TensorBoard, W&B) that receive the same rows

    def write(self, row: dict) -> None:
        try:
            now = os.stat(self.path).st_ino
        except FileNotFoundError:
            now = None
        if now != self._ino:
            what = "was deleted" if now is None else "was replaced by another file"
            raise MetricsError(f"{self.path} {what} while the run was writing it; the rows from step "
                               f"{row.get('step')} on would be lost. Leave a run's metrics.jsonl alone until it ends")
        try:
            self._f.write(json.dumps(_clean(row)) + "\n")
            self._f.flush()
        except OSError as e:
            raise MetricsError(f"{self.path}: cannot write step {row.get('step')} ({e.strerror})") from None
        for lg in self.loggers:
            lg.log(row)

    def close(self) -> None:
        for lg in self.loggers:
            try:
                lg.close()
            except Exception:  # noqa: BLE001 - a logger's shutdown must not hide the run's outcome
                pass
        try:
            self._f.close()
        except OSError:
            pass


def _clean(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
