"""The API every backend implements (:class:`DockClient`) and what a get returns (:class:`Batch`)."""
from __future__ import annotations

import abc
import math

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .errors import DEFAULT_TIMEOUT_S
from .packing import Packed, pack_column


# ----------------------------------------------------------------------------------------------
# The client-facing API.
# ----------------------------------------------------------------------------------------------

@dataclass
class Batch:
    """Rows handed to one consumer rank.

    ``columns[name]`` is a stacked tensor ``[rows, *shape]`` for columns put stacked, else a list of
    per-row tensors (unpadded; the workflow's micro-batching pads them: ``workflow/batching.py``).
    Cached columns are not in ``columns``; ``holders[name][i]`` is the rank whose TensorCache holds
    row ``rows[i]`` (fetch with ``TensorCache.exchange``).
    """

    rows: list[int]
    columns: dict[str, torch.Tensor | list[torch.Tensor]]
    holders: dict[str, list[int]] = field(default_factory=dict)
    # count=None only: the rows of every dp rank in this round (entry r = rank r's rows), e.g. for
    # TensorCache.exchange(columns, batch.partition) without gathering the wants first.
    partition: list[list[int]] | None = None
    # count=None only: for each cached column, the holder rank of every row of ``partition``
    # (entry r: rank r's rows), the same on every rank; ``TensorCache.exchange(cols,
    # batch.partition, holders=batch.partition_holders)`` then needs no collective when nothing moves.
    partition_holders: dict[str, list[list[int]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str):
        return self.columns[name]


class DockClient(abc.ABC):
    """The API every backend implements; the semantics: docs/transfer_dock.md."""

    round_trips: int = 0
    """Blocking calls this client made to other processes (0 in process)."""
    wait_s: float = 0.0
    """Seconds this client spent waiting in them."""

    def flush(self) -> None:
        """Wait until this client's writes and cache marks are committed (a backend may send them
        without waiting); raises the first failed one."""

    _ahead: tuple | None = None  # (step, groups, the started reset's handle) from reset_ahead

    def reset(self, step: int, groups: tuple[int, int] | None = None) -> list[int] | None:
        """Start step ``step`` with no rows. ``groups=(n_groups, group_size)`` also allocates the
        step's first groups in the same call (one round trip, not two) and returns their rows, as
        :meth:`add_groups` would. After ``reset_ahead(step, groups)`` it takes that call's answer."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            done = self._finish_reset(ahead[2])
            if ahead[:2] == (step, groups):
                return done
        return self._finish_reset(self._start_reset(step, groups))

    def reset_ahead(self, step: int, groups: tuple[int, int] | None = None) -> None:
        """Send ``reset(step, groups)`` now and take its answer at that call, so a coming step's first
        dock call does not wait for it. Only once nobody reads or writes the current step's rows any
        more: the workflow sends it after a colocated step's last collective, when every worker has
        flushed its writes. An in-process backend resets at once."""
        if self._ahead is not None:
            self._finish_reset(self._ahead[2])
        self._ahead = (step, groups, self._start_reset(step, groups))

    @abc.abstractmethod
    def _start_reset(self, step: int, groups: tuple[int, int] | None) -> Any:
        """Begin the reset; returns what :meth:`_finish_reset` needs (an answer, or its handle)."""

    @abc.abstractmethod
    def _finish_reset(self, started: Any) -> list[int] | None:
        """Wait for a started reset; the rows of its groups (None without groups)."""

    @abc.abstractmethod
    def add_groups(self, n_groups: int, group_size: int) -> list[int]:
        ...

    @abc.abstractmethod
    def put(self, columns: dict[str, torch.Tensor | list[torch.Tensor]], rows: Sequence[int], *,
            defer: bool = False) -> None:
        """Store ``columns`` for ``rows`` and mark them ready; the data goes to each row's warehouse
        whoever writes it.

        ``defer=True``: hold the write until this client's next :meth:`get` (or :meth:`flush`,
        :meth:`reset`), which carries it in the same call -- "write my outputs, hand me my next
        inputs" in one round trip. For a put followed directly by this client's next dock call:
        nobody else sees the rows before that call (a process that waits on a collective with the
        rows' readers in between deadlocks them until their claim times out), and the tensors must
        not be changed in place until then. An in-process backend writes at once either way."""
        ...

    @abc.abstractmethod
    def get(self, consumer: str, columns: Sequence[str], count: int | None = None, *, dp_rank: int = 0,
            dp_size: int = 1, whole_groups: bool = False, timeout: float = DEFAULT_TIMEOUT_S,
            copy: bool = False) -> Batch:
        ...

    @abc.abstractmethod
    def mark_cached(self, columns: dict[str, Sequence[int] | None] | Sequence[str], rows: Sequence[int],
                    rank: int, *, defer: bool = False) -> None:
        """Record that ``rank``'s TensorCache holds ``columns`` of ``rows`` (a dict gives each
        column's per-row token counts, for balancing). ``defer`` as in :meth:`put`."""
        ...

    @abc.abstractmethod
    def cached_on(self, column: str, rows: Sequence[int]) -> list[int | None]:
        ...

    @abc.abstractmethod
    def all_consumed(self, consumer: str) -> bool:
        ...

    @abc.abstractmethod
    def drop_rows(self, rows: Sequence[int], *, defer: bool = False) -> None:
        """Drop ``rows`` from the step: no claim hands them out, and their data is freed.
        ``defer=True``: hold the drop until this client's next dock call, which carries it (as for
        :meth:`put`); a claim that needs every live row waits for it meanwhile, so nobody is handed a
        dropped row. A reset discards held drops (the new step has none of these rows)."""
        ...

    @abc.abstractmethod
    def stats(self) -> dict:
        ...

    def shutdown(self) -> None:
        pass


def _put_meta(columns: dict[str, Any], rows: Sequence[int], own: bool) -> tuple[dict, dict[str, Packed]]:
    packed = {c: pack_column(c, v, len(rows), own) for c, v in columns.items()}
    meta = {c: (p.dtype, p.stacked, [math.prod(s[:1]) if s else 1 for s in p.shapes])
            for c, p in packed.items()}
    return meta, packed


def _cached_meta(columns, rows) -> dict:
    if isinstance(columns, dict):
        return {c: ("", False, list(l) if l is not None else [1] * len(rows)) for c, l in columns.items()}
    return {c: ("", False, [1] * len(rows)) for c in columns}


def _empty_batch(claim) -> Batch:
    """The Batch of a claim (``messages.Claimed``) that took no rows."""
    cols = {}
    for c in claim.columns:
        dtype, stacked = claim.kinds[c]
        cols[c] = torch.empty(0, dtype=getattr(torch, dtype)) if stacked else []
    return Batch([], cols, {c: [] for c in claim.cached}, claim.partition, claim.partition_holders)
