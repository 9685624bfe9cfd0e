"""The rows a colocated worker generated itself this step, kept for the stages that can use them in place.

A worker's rollout rows are whole prompt groups in group order, so reward and outcome advantage
need nobody else's rows; a forward stage (ref / old / values) whose engine has one DP rank per
worker, like the rollout's, can run on them too, and so can an update that needs no re-balance.
Those stages skip the dock claim and the wait for every other worker's rollout that comes with it.

Nothing goes to the dock while the step stays local: the rows' columns stay here, their stage
outputs in the TensorCache. Only when a stage is about to claim re-balanced rows (a forward stage
with another DP layout, GAE, an update whose loads are out of balance) does every worker
:meth:`~OwnRows.publish` them, in one put and one "held on rank r" mark.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..algos.columns import CACHED
from ..core.dock import Batch
from .batching import subset


class OwnRows:
    """Every rollout round's rows of this worker, their columns, and their scores once scored."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: dict[str, torch.Tensor | list] = {}
        self._scores: dict[str, list[torch.Tensor]] = {}  # "scores", "acc": one tensor per scored round
        self._scored = 0  # rows[:_scored] have scores
        self._round = 0   # rows[_round:_scored]: the round scored last
        self.published = False  # in the dock since publish(); later outputs are written as they come

    def add(self, rows: Sequence[int], cols: dict) -> None:
        self.rows += list(rows)
        for c, v in cols.items():
            old = self.cols.get(c)
            if isinstance(v, torch.Tensor):
                self.cols[c] = v if old is None else torch.cat([old, v])
            else:
                self.cols[c] = (old or []) + list(v)

    def unscored(self, columns: Sequence[str]) -> Batch:
        """The rows not scored yet (this round's), as a dock batch of ``columns``."""
        lo = self._round = self._scored
        self._scored = len(self.rows)
        return Batch(self.rows[lo:], {c: self.cols.get(c, [])[lo:] for c in columns}, {}, None)

    def add_scores(self, scores: torch.Tensor, **more: torch.Tensor) -> None:
        """The scores of the rows :meth:`unscored` handed out last, and other per-row columns of the
        reward (``acc``: the raw reward)."""
        for c, v in {"scores": scores, **more}.items():
            self._scores.setdefault(c, []).append(v)

    def last_round(self, columns: Sequence[str]) -> tuple[list[int], dict]:
        """The rows of the round scored last and their ``columns`` (generated ones, or ``scores`` /
        ``acc``)."""
        lo, hi = self._round, self._scored
        out = {}
        for c in columns:
            if c in self.cols:
                out[c] = self.cols[c][lo:hi]
            else:  # a reward column: this round's scores (none yet, or none on a rank without rows)
                vals = self._scores.get(c)
                out[c] = vals[-1] if vals and hi > lo else torch.zeros(0)
        return self.rows[lo:hi], out

    def publish(self, dock, cache, rank: int, live: set[int] | None) -> None:
        """Put the live rows' columns, scores and advantages into the dock in one write, and mark the
        cached columns that hold them as held on ``rank``: what a claim of re-balanced rows reads."""
        if self.published:
            return
        self.published = True
        scored = self._scored == len(self.rows)
        data = self.select(list(self.cols) + (list(self._scores) if scored and self._scores else []), live)
        rows = data.pop("rows")
        if not rows:
            return
        if cache.has("advantages", rows):
            data["advantages"] = torch.stack(cache.get("advantages", rows))
        dock.put(data, rows)
        held = [c for c in CACHED if cache.has(c, rows)]
        if held:
            dock.mark_cached(held, rows, rank)

    def select(self, columns: Sequence[str], live: set[int] | None = None) -> dict:
        """``{"rows": [...], column: values}`` (the shape ``train_rows`` returns) of the rows in
        ``live`` (None: all), in generation order; ``scores`` is a column once every row is scored."""
        cols = dict(self.cols)
        if self._scored == len(self.rows):
            cols.update({c: torch.cat(v) for c, v in self._scores.items()})
            cols.setdefault("scores", torch.zeros(0))  # nothing was scored: no rows
        if not self.rows:  # a rollout TP peer holds none
            return {"rows": [], **{c: cols.get(c, []) for c in columns}}
        data = {"rows": list(self.rows), **{c: cols[c] for c in columns}}
        return data if live is None else subset(data, [i for i, x in enumerate(self.rows) if x in live])
