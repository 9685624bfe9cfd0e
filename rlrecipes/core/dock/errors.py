"""Dock errors and the default wait."""
from __future__ import annotations

from typing import Sequence


DEFAULT_TIMEOUT_S = 600.0


class DockError(RuntimeError):
    """Bad use of the dock (unknown rows, mismatched column kinds, ...)."""


class DockTimeout(TimeoutError):
    """A consumer waited longer than its timeout for rows to become ready."""

    def __init__(self, consumer: str, columns: Sequence[str], timeout: float, diag: dict):
        self.consumer = consumer
        self.columns = list(columns)
        self.diag = diag
        per_col = ", ".join(f"{c}: {diag['ready'].get(c, 0)}/{diag['live']}" for c in columns)
        super().__init__(
            f"TransferDock: consumer {consumer!r} (dp_rank {diag['dp_rank']}/{diag['dp_size']}) "
            f"waited {timeout:.1f}s for columns {list(columns)} (wanted {diag['wanted']}); "
            f"step {diag['step']}: {diag['ready_all']} rows ready for all of them and not yet taken "
            f"of {diag['live']} live rows ({diag['total']} allocated, {diag['taken']} already taken "
            f"by {consumer!r}); per column ready/live: {per_col}")
