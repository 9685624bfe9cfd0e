"""The run's progress between rank 0 and the driver: a small Ray actor that holds the rows rank 0
reports until the driver has written them (:class:`ProgressBoard`), and the driver's side of it
(:class:`RowCollector`), which writes each row to ``metrics.jsonl`` as it arrives."""
from __future__ import annotations

import time
from typing import Optional

from ..metrics import MetricsError, MetricsWriter, reward_failure
from .events import RunError


class ProgressBoard:
    """Tiny actor: rank 0 reports its stage and each step's metrics row; the driver polls.

    A row stays here only until the driver has it: each poll says how many rows the driver holds
    so far (``taken``), those are dropped, and the rest are returned. An answer that never reached
    the driver (a poll cut short by Ctrl-C) is therefore sent again, and memory stays flat however
    long the run."""

    def __init__(self) -> None:
        self.step, self.stage_name, self.t = -1, "setup", time.time()
        self.pending: list[dict] = []
        self.taken = 0  # rows the driver confirmed, dropped here
        self.rollout_facts: dict[int, dict] = {}

    def stage(self, step: int, name: str) -> None:
        self.step, self.stage_name, self.t = step, name, time.time()

    def rollout(self, step: int, facts: dict) -> None:
        """Disaggregated placement: the rollout workers' figures of a step, merged into its row."""
        self.rollout_facts[step] = facts

    def metrics(self, row: dict) -> None:
        self.pending.append({**self.rollout_facts.pop(row.get("step"), {}), **row})

    def poll(self, taken: int) -> tuple[int, str, list]:
        """(step, stage, the rows after the first ``taken``); the first ``taken`` are dropped."""
        if taken > self.taken:
            del self.pending[:taken - self.taken]
            self.taken = taken
        return self.step, self.stage_name, list(self.pending)

    def where(self) -> tuple[int, str]:
        return self.step, self.stage_name


def progress_actor():
    """The :class:`ProgressBoard` actor, on the driver's node. Its calls (a row per step, a stage every
    0.1 s, a poll every 0.5 s) record no Ray task events, which nobody reads."""
    import ray

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    quiet = ray.method(enable_task_events=False)
    for name in ("stage", "rollout", "metrics", "poll", "where"):
        quiet(getattr(ProgressBoard, name))
    # on the driver's node (not soft: Ray 2.60 placed a soft-affine zero-CPU actor on another node):
    # a lost worker node must not take the run's progress and rows with it
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(ProgressBoard).options(num_cpus=0, scheduling_strategy=here).remote()


class RowCollector:
    """The driver's side of :class:`ProgressBoard`: each row goes to metrics.jsonl as it arrives and
    only the count is kept (the end-of-run summary is read back from the file). A row whose reward
    calls failed above ``max_failure_rate`` stops the run once the rows are written."""

    def __init__(self, progress, writer: MetricsWriter, max_failure_rate: float = 1.0) -> None:
        self.progress, self.writer, self.taken = progress, writer, 0
        self.max_failure_rate = max_failure_rate

    def take(self, timeout: Optional[float] = None) -> tuple[int, str, list]:
        import ray

        step, stage, new = ray.get(self.progress.poll.remote(self.taken), timeout=timeout)
        for row in new:
            self.writer.write(row)
            self.taken += 1
        for row in new:
            why = reward_failure(row, self.max_failure_rate, self.writer.path)
            if why:
                raise RunError(why, code=1)
        return step, stage, new


def drain_rows(rows: Optional[RowCollector]) -> None:
    """After Ctrl-C: write the rows rank 0 already sent (best effort; the workers may be gone)."""
    if rows is None:
        return
    try:
        rows.take(timeout=5)
    except MetricsError:
        raise
    except Exception:  # noqa: BLE001 - interrupted anyway
        return
