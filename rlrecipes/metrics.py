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
import statistics
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional

from .disk import NO_SPACE_ERRNOS, no_space_message

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
    A row the disk has no room for is cut back off (the file keeps its whole rows) and the error
    says no space is left, with the file system's free space.
    """

    def __init__(self, path: Path, rows: list[dict] | None = None) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if rows is not None:
                tmp = self.path.with_name(f".{self.path.name}.tmp")
                try:
                    tmp.write_text("".join(json.dumps(_clean(r)) + "\n" for r in rows))
                except OSError:
                    tmp.unlink(missing_ok=True)
                    raise
                os.replace(tmp, self.path)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            if e.errno in NO_SPACE_ERRNOS:
                raise MetricsError(no_space_message(self.path, "the metrics file")) from None
            raise MetricsError(f"{self.path}: cannot write the metrics file ({e.strerror})") from None
        self._ino = os.fstat(self._fd).st_ino
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
        data, end = (json.dumps(_clean(row)) + "\n").encode(), None
        try:
            end = os.fstat(self._fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            if end is not None:
                try:
                    os.ftruncate(self._fd, end)  # no half-written row: the file keeps the rows written before
                except OSError:
                    pass
            if e.errno in NO_SPACE_ERRNOS:
                raise MetricsError(no_space_message(self.path, f"the row of step {row.get('step')}")) from None
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
            os.close(self._fd)
        except OSError:
            pass


def reward_failure(row: dict, limit: float, path: Path) -> Optional[str]:
    """Why a step's row stops the run: more than ``limit`` (``reward.max_failure_rate``) of its reward
    calls failed (raised, or returned NaN / inf). None when the step is within it."""
    rate, calls = row.get("reward/failure_rate"), row.get("reward/samples")
    if not _number(rate) or rate <= limit or not calls:
        return None
    fix = min(1.0, math.ceil(rate * 10) / 10)
    return (f"step {row.get('step')}: the reward function failed on {rate:.0%} of the step's {calls} calls "
            f"(it raised, or returned NaN / inf; those samples scored 0), above reward.max_failure_rate={limit}; "
            f"first error: {row.get('reward/first_error') or 'not recorded'}. Fix reward.fn so that it returns a "
            f"finite number for every sample, or, if those samples may score 0, set reward.max_failure_rate={fix:g}. "
            f"The run stopped; its metrics are in {path}")


def _clean(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def read_rows(path: Path, first_step: int = 0) -> Iterator[dict]:
    """The rows of a metrics file from ``first_step`` on, one at a time (a half-written or damaged
    line is skipped: the file may have been cut by a stopped run)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("step", -1) >= first_step:
                yield row


class RunSummary:
    """What the end-of-run summary and the bad-run check need from a run's rows, in bounded memory.

    :meth:`add` takes one row at a time and keeps sums, counts, the first and last five rewards and
    the first reward error, so nothing grows with the step count. The median TPS/card over the rows
    after the first is exact: :meth:`from_file` streams ``metrics.jsonl`` once at the end of a run and
    holds that one column only while it reads (``tps_median``)."""

    EDGE = 5  # rewards averaged at either end

    def __init__(self) -> None:
        self.steps = 0
        self.first_rewards: list[float] = []
        self.last_rewards: deque = deque(maxlen=self.EDGE)
        self.sums: dict[str, float] = {}  # timing_s/*, perf/overhead_share, reward errors and samples
        self.skipped = 0
        self.first_error: str = ""
        self.tps_median: Optional[float] = None
        self._tps: list[float] = []

    def add(self, row: dict) -> None:
        self.steps += 1
        reward = row.get("reward/mean")
        if not _number(reward):
            reward = None
        if reward is not None and self.steps <= self.EDGE:
            self.first_rewards.append(reward)
        self.last_rewards.append(reward)
        for k, v in row.items():
            if (k.startswith("timing_s/") or k in ("perf/overhead_share", "reward/errors", "reward/samples")) \
                    and isinstance(v, (int, float)):
                self.sums[k] = self.sums.get(k, 0.0) + v
        if row.get("actor/skipped_step"):
            self.skipped += 1
        if not self.first_error and row.get("reward/first_error"):
            self.first_error = str(row["reward/first_error"])
        if row.get("perf/tps_per_card") is not None:
            self._tps.append(row["perf/tps_per_card"])

    def finish(self) -> "RunSummary":
        """Compute the median TPS/card (step 1 on, or the only row) and drop the column."""
        tps = self._tps[1:] or self._tps
        self.tps_median = statistics.median(tps) if tps else None
        self._tps = []
        return self

    @classmethod
    def from_file(cls, path: Path, first_step: int = 0) -> "RunSummary":
        """The summary of the rows of ``path`` from ``first_step`` on (one streaming pass)."""
        s = cls()
        if Path(path).is_file():
            for row in read_rows(path, first_step):
                s.add(row)
        return s.finish()

    def mean(self, key: str) -> float:
        return self.sums.get(key, 0.0) / self.steps if self.steps else 0.0

    @property
    def stage_keys(self) -> list[str]:
        return sorted(k for k in self.sums if k.startswith("timing_s/") and k != "timing_s/step")

    def reward_ends(self) -> tuple[Optional[float], Optional[float]]:
        """Mean reward of the first and of the last five steps (None without rewards)."""
        last = [r for r in self.last_rewards if r is not None]
        if not self.first_rewards or not last:
            return None, None
        return statistics.fmean(self.first_rewards), statistics.fmean(last)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
