"""What the driver tells its caller while a run goes on; ``cli/run.py`` renders these with rich.

The workflow never prints: it emits events to a callback and raises :class:`RunError` with a
message meant for the user (naming the worker, stage, file or key) and an exit code.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Union

if TYPE_CHECKING:
    from ..metrics import RunSummary


class RunError(RuntimeError):
    """A run failed or was refused; ``str(e)`` is the user-facing message, ``code`` the exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass
class RunStarted:
    recipe: str
    algorithm: str
    run_dir: Path
    workers: int
    actor_layout: str
    rollout_layout: str
    stages: list[str]
    data: dict
    start_step: int
    total_steps: int


@dataclass
class Progress:
    """Polled about twice a second: the step and stage rank 0 is in, and the metrics rows that
    arrived since the previous event (each row is in exactly one event; keep what you need)."""

    step: int
    stage: str
    new_rows: list[dict] = field(default_factory=list)


@dataclass
class RunFinished:
    """The run ended normally. ``summary`` aggregates this session's rows (bounded memory: the
    driver keeps no rows; it is read back from metrics.jsonl at the end)."""

    recipe: str
    run_dir: Path
    summary: "RunSummary"
    seconds: float


@dataclass
class Interrupted:
    run_dir: Path


@dataclass
class Notice:
    """Something the user should know that does not stop the run (e.g. metrics reconciled on resume)."""

    text: str


Event = Union[RunStarted, Progress, RunFinished, Interrupted, Notice]
EventSink = Callable[[Event], None]
