"""TransferDock: the sample flow between RL stages without a central driver.

One row per sample; columns (``prompt_ids``, ``response_ids``, ``scores``, ``ref_log_probs``, ...)
are written by the stage that produces them and read by every stage that needs them.

Two backends, one API (:class:`DockClient`):

* ``TransferDock.local()`` -- in-process and thread-safe (one lock + condition); unit tests and
  single-process runs.
* ``TransferDock.ray()`` -- a *controller* actor that holds metadata only (per-column readiness,
  per-consumer consumption, row -> warehouse map, groups, per-row token lengths, cache holders) and
  one *warehouse* actor per Ray node, pinned there with ``NodeAffinitySchedulingStrategy``, that
  holds the tensors of the rows assigned to it. Clients (worker actors, each with the same
  picklable handle) ask the controller *which* rows and *where*, then write to / read from the
  warehouses directly. The driver never touches sample data. A put is one client round trip per
  warehouse: the warehouse stores the rows and commits them (marks them ready) at the controller
  before answering, so readiness never runs ahead of the data.

Data travels as flat numpy arrays (one per column and warehouse call); arrays above Ray's inline
threshold go through the shared-memory object store and are read back zero-copy, so the tensors of
a :class:`Batch` may be read-only views of object-store memory: ``clone()`` before writing in place
(or pass ``copy=True`` to :meth:`DockClient.get`).

Balancing (documented choice): ``get(consumer, cols, count=None, dp_rank=r, dp_size=k)`` means
"everything of this stage". The first rank of the consumer to ask waits until every live row that
the consumer has not taken yet has ``cols`` ready, then partitions those rows (or whole groups)
into ``k`` bins by token count -- greedy LPT with equal row counts per bin (``equal_count=True``,
default; what micro-batched training wants) or Karmarkar-Karp differencing (``equal_count=False``)
-- and every rank receives its own bin. The partition is deterministic (ties broken by row id).
``count=N`` streams: the rank takes the first ``N`` ready rows nobody of that consumer took yet.
"""
from __future__ import annotations

import abc
import asyncio
import heapq
import itertools
import math
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

DEFAULT_TIMEOUT_S = 600.0

__all__ = [
    "Batch", "DockClient", "DockError", "DockTimeout", "LocalDock", "RayDock", "TransferDock",
    "partition_kk", "partition_lpt",
]


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


# ----------------------------------------------------------------------------------------------
# Balancing: pure functions, deterministic.
# ----------------------------------------------------------------------------------------------

def partition_lpt(weights: Sequence[float], k: int, equal_count: bool = True) -> list[list[int]]:
    """Greedy LPT: items by weight descending (ties by index) to the lightest bin.

    With ``equal_count`` every bin gets ``floor(n/k)`` or ``ceil(n/k)`` items. Returns item indices
    per bin, each sorted ascending.
    """
    if k < 1:
        raise ValueError(f"partition into {k} bins: need k >= 1")
    n = len(weights)
    q, rem = divmod(n, k)  # with equal_count: `rem` bins hold q + 1 items, the others q
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    sums = [0.0] * k
    bins: list[list[int]] = [[] for _ in range(k)]
    n_big = 0
    for i in order:
        best = None
        for b in range(k):
            if equal_count and not (len(bins[b]) < q or (len(bins[b]) == q and n_big < rem)):
                continue
            if best is None or sums[b] < sums[best] or (sums[b] == sums[best] and len(bins[b]) < len(bins[best])):
                best = b
        assert best is not None
        bins[best].append(i)
        sums[best] += weights[i]
        if equal_count and len(bins[best]) == q + 1:
            n_big += 1
    return [sorted(b) for b in bins]


def partition_kk(weights: Sequence[float], k: int) -> list[list[int]]:
    """Karmarkar-Karp largest differencing method for k-way partitioning (no count constraint)."""
    if k < 1:
        raise ValueError(f"partition into {k} bins: need k >= 1")
    if not weights:
        return [[] for _ in range(k)]
    tie = itertools.count()
    heap = []  # (-spread, tiebreak, [(sum, items), ...] sorted by sum descending)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        part = [(float(weights[i]), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(weights[i]), next(tie), part))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # Largest of a with smallest of b, and so on.
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda p: (-p[0], min(p[1], default=-1)))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    return [sorted(items) for _, items in heap[0][2]]


# ----------------------------------------------------------------------------------------------
# Packing tensors for transport and storage: one flat numpy array per (column, call).
# ----------------------------------------------------------------------------------------------

_NUMPY_FREE = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu").contiguous()
    if t.dtype in _NUMPY_FREE:
        t = t.view(_NUMPY_FREE[t.dtype])
    return t.numpy()


def _from_numpy(a: np.ndarray, dtype_name: str, copy: bool) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if copy:
        a = a.copy()
    with warnings.catch_warnings():  # object-store arrays are read-only; see module docstring
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(dtype) if t.dtype != dtype else t


@dataclass
class Packed:
    """Rows of one column: ``flat`` holds them back to back; row i has shape ``shapes[i]``."""

    flat: np.ndarray            # [sum of row numels]
    shapes: list[tuple]         # per row
    dtype: str                  # torch dtype name
    stacked: bool               # put as one stacked tensor [rows, *shape] (else a list)

    @property
    def offsets(self) -> np.ndarray:
        sizes = [math.prod(s) for s in self.shapes]
        return np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)


def pack_column(name: str, value: Any, n_rows: int, own: bool = False) -> Packed:
    """``own``: copy a stacked tensor so later in-place writes by the caller cannot reach the dock
    (list columns are concatenated, which copies anyway)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != n_rows:
            raise DockError(f"put column {name!r}: stacked tensor of shape {tuple(value.shape)} "
                            f"must have its first dim equal to the number of rows ({n_rows})")
        row_shape = tuple(value.shape[1:])
        flat = _to_numpy(value).reshape(-1)
        return Packed(flat.copy() if own else flat, [row_shape] * n_rows, _dtype_name(value.dtype), True)
    if isinstance(value, (list, tuple)):
        if len(value) != n_rows:
            raise DockError(f"put column {name!r}: {len(value)} tensors for {n_rows} rows")
        if n_rows == 0:
            return Packed(np.zeros(0, np.float32), [], "float32", False)
        dtypes = {t.dtype for t in value if isinstance(t, torch.Tensor)}
        if len(dtypes) != 1 or not all(isinstance(t, torch.Tensor) for t in value):
            raise DockError(f"put column {name!r}: a list column needs tensors of one dtype, got "
                            f"{sorted(str(d) for d in dtypes) or [type(v).__name__ for v in value[:3]]}")
        dtype = dtypes.pop()
        flat = _to_numpy(torch.cat([t.reshape(-1) for t in value])) if value else np.zeros(0)
        return Packed(flat, [tuple(t.shape) for t in value], _dtype_name(dtype), False)
    raise DockError(f"put column {name!r}: expected a tensor [rows, ...] or a list of tensors, "
                    f"got {type(value).__name__}")


def slice_packed(p: Packed, idx: Sequence[int]) -> Packed:
    """The rows ``idx`` (positions in ``p``) as a new Packed; one gather copy."""
    off = p.offsets
    if len(idx) == len(p.shapes) and list(idx) == list(range(len(p.shapes))):
        return p
    if idx:
        flat = np.concatenate([p.flat[off[i]:off[i + 1]] for i in idx])
    else:
        flat = p.flat[:0]
    return Packed(flat, [p.shapes[i] for i in idx], p.dtype, p.stacked)


def concat_packed(parts: Sequence[Packed]) -> Packed:
    if len(parts) == 1:
        return parts[0]
    flat = np.concatenate([p.flat for p in parts]) if parts else np.zeros(0)
    return Packed(flat, [s for p in parts for s in p.shapes], parts[0].dtype,
                  all(p.stacked for p in parts))


def unpack(p: Packed, copy: bool) -> torch.Tensor | list[torch.Tensor]:
    t = _from_numpy(p.flat, p.dtype, copy)  # [sum of numels]
    if p.stacked and len(set(p.shapes)) <= 1:
        shape = p.shapes[0] if p.shapes else ()
        return t.reshape(len(p.shapes), *shape)  # [rows, *row_shape]
    off = p.offsets.tolist()
    return [t[off[i]:off[i + 1]].view(p.shapes[i]) for i in range(len(p.shapes))]


class _ColumnStore:
    """Tensors of some rows, by column: appended chunks plus a (column, row) -> position index.

    Used by the local backend and by every warehouse. Not thread-safe on its own.
    """

    def __init__(self):
        self.chunks: dict[str, list[Packed]] = {}
        self.index: dict[str, dict[int, tuple[int, int]]] = {}   # col -> row -> (chunk, position)
        self.live_bytes = 0

    def clear(self):
        self.__init__()

    def write(self, col: str, rows: Sequence[int], p: Packed) -> list:
        """Store ``p`` (one row per entry of ``rows``); returns what :meth:`undo` needs."""
        chunks = self.chunks.setdefault(col, [])
        idx = self.index.setdefault(col, {})
        chunks.append(p)
        c = len(chunks) - 1
        before = [(col, int(r), idx.get(int(r))) for r in rows]
        for j, r in enumerate(rows):
            idx[int(r)] = (c, j)
        self.live_bytes += p.nbytes
        return before

    def undo(self, before: list) -> None:
        """Point the rows of a rejected write back at what they held before it."""
        for col, r, old in reversed(before):
            if old is None:
                self.index[col].pop(r, None)
            else:
                self.index[col][r] = old

    def read(self, col: str, rows: Sequence[int]) -> Packed:
        idx = self.index.get(col, {})
        missing = [r for r in rows if r not in idx]
        if missing:
            raise DockError(f"column {col!r} has no data for rows {missing[:8]}"
                            f"{' ...' if len(missing) > 8 else ''} in this store")
        # Group consecutive reads from the same chunk so the gather is a few slices.
        parts: list[Packed] = []
        run_chunk, run_pos = None, []
        for r in rows:
            c, j = idx[int(r)]
            if c != run_chunk and run_pos:
                parts.append(slice_packed(self.chunks[col][run_chunk], run_pos))
                run_pos = []
            run_chunk = c
            run_pos.append(j)
        if run_pos:
            parts.append(slice_packed(self.chunks[col][run_chunk], run_pos))
        if not parts:
            return Packed(np.zeros(0, np.float32), [], "float32", True)
        return concat_packed(parts)

    def drop(self, rows: Sequence[int]):
        for idx in self.index.values():
            for r in rows:
                idx.pop(int(r), None)
        # Free chunks no row points to any more.
        for col, idx in self.index.items():
            used = {c for c, _ in idx.values()}
            for c, p in enumerate(self.chunks[col]):
                if c not in used and p.flat.size:
                    self.live_bytes -= p.nbytes
                    self.chunks[col][c] = Packed(p.flat[:0], [], p.dtype, p.stacked)

    def stats(self) -> dict:
        return {"bytes": int(self.live_bytes), "columns": {c: len(i) for c, i in self.index.items()}}


# ----------------------------------------------------------------------------------------------
# Metadata: the controller's state, shared by both backends. Pure Python, no tensors, no locking.
# ----------------------------------------------------------------------------------------------

@dataclass
class _ConsumerState:
    taken: np.ndarray                      # [rows] bool: row already handed to some dp rank
    dp_size: int | None = None
    partitions: list[list[list[int]]] = field(default_factory=list)   # [round][dp_rank] -> rows
    cursor: dict[int, int] = field(default_factory=dict)              # dp_rank -> next round


class _Meta:
    """Readiness / consumption / groups / placement of the rows of one step."""

    def __init__(self, n_warehouses: int = 1, equal_count: bool = True):
        self.n_warehouses = n_warehouses
        self.equal_count = equal_count
        self.reset(0)

    def reset(self, step: int):
        self.step = int(step)
        self.n_rows = 0
        self.group_of = np.zeros(0, np.int64)        # [rows]
        self.groups: list[tuple[int, int]] = []      # group -> (first row, size)
        self.dropped = np.zeros(0, bool)             # [rows]
        self.warehouse = np.zeros(0, np.int64)       # [rows] -> warehouse index
        self.ready: dict[str, np.ndarray] = {}       # col -> [rows] bool
        self.holder: dict[str, np.ndarray] = {}      # col -> [rows] int: cache rank, -1 = in store
        self.lengths: dict[str, np.ndarray] = {}     # col -> [rows] token count (numel of the row)
        self.kinds: dict[str, tuple[str, bool]] = {} # col -> (dtype, stacked)
        self.consumers: dict[str, _ConsumerState] = {}
        self.next_wh = 0
        self.version = 0                             # bumped on every change waiters care about
        self.last_partition: list[list[int]] | None = None   # of the last count=None claim

    # -- allocation ----------------------------------------------------------------------------
    def _grow(self, n: int):
        def grow(a, fill):
            out = np.full(n, fill, a.dtype)
            out[: a.size] = a
            return out
        self.group_of = grow(self.group_of, -1)
        self.dropped = grow(self.dropped, False)
        self.warehouse = grow(self.warehouse, 0)
        for d, fill in ((self.ready, False), (self.holder, -1), (self.lengths, 0)):
            for c in d:
                d[c] = grow(d[c], fill)
        for cs in self.consumers.values():
            cs.taken = grow(cs.taken, False)

    def add_groups(self, n_groups: int, group_size: int, warehouse: int | None = None) -> list[int]:
        if n_groups < 0 or group_size < 1:
            raise DockError(f"add_groups(n_groups={n_groups}, group_size={group_size}): "
                            "need n_groups >= 0 and group_size >= 1")
        start = self.n_rows
        self.n_rows += n_groups * group_size
        self._grow(self.n_rows)
        for g in range(n_groups):
            first = start + g * group_size
            gid = len(self.groups)
            self.groups.append((first, group_size))
            self.group_of[first:first + group_size] = gid
            if warehouse is None:  # round robin by group range
                wh = self.next_wh % self.n_warehouses
                self.next_wh += 1
            else:
                wh = warehouse
            self.warehouse[first:first + group_size] = wh
        self.version += 1
        return list(range(start, self.n_rows))

    def _check_rows(self, rows: Sequence[int], what: str) -> np.ndarray:
        r = np.asarray(list(rows), np.int64)
        if r.size and (r.min() < 0 or r.max() >= self.n_rows):
            bad = [int(x) for x in r if x < 0 or x >= self.n_rows][:8]
            raise DockError(f"{what}: rows {bad} were never allocated in step {self.step} "
                            f"({self.n_rows} rows; call add_groups first)")
        if r.size and self.dropped[r].any():
            bad = [int(x) for x in r if self.dropped[x]][:8]
            raise DockError(f"{what}: rows {bad} were dropped in step {self.step}")
        return r

    def placement(self, rows: Sequence[int]) -> list[int]:
        r = self._check_rows(rows, "put")
        return self.warehouse[r].tolist()

    # -- writes --------------------------------------------------------------------------------
    def mark_ready(self, columns: dict[str, tuple[str, bool, Sequence[int]]], rows: Sequence[int],
                   holder: int = -1):
        """``columns``: name -> (dtype, stacked, per-row numel). ``holder`` >= 0: cached on rank."""
        r = self._check_rows(rows, "put")
        for col, (dtype, stacked, lens) in columns.items():
            if lens is not None and len(lens) != r.size:
                raise DockError(f"column {col!r}: {len(lens)} lengths for {r.size} rows")
            kind = (dtype, stacked)
            if dtype and col in self.kinds and self.kinds[col] != kind:
                old = self.kinds[col]
                raise DockError(f"put column {col!r}: step {self.step} already has it as "
                                f"{'stacked' if old[1] else 'list'} {old[0]}, got "
                                f"{'stacked' if stacked else 'list'} {dtype}")
        for col, (dtype, stacked, lens) in columns.items():
            if dtype:
                self.kinds.setdefault(col, (dtype, stacked))
            for d, fill in ((self.ready, False), (self.holder, -1), (self.lengths, 0)):
                if col not in d:
                    d[col] = np.full(self.n_rows, fill, {False: bool, -1: np.int64, 0: np.int64}[fill])
            self.ready[col][r] = True
            self.holder[col][r] = holder
            if lens is not None:
                self.lengths[col][r] = np.asarray(list(lens), np.int64)
        self.version += 1

    def drop_rows(self, rows: Sequence[int]) -> dict[int, list[int]]:
        r = np.asarray(list(rows), np.int64)
        if r.size and (r.min() < 0 or r.max() >= self.n_rows):
            raise DockError(f"drop_rows: rows outside 0..{self.n_rows - 1} in step {self.step}")
        self.dropped[r] = True
        self.version += 1
        by_wh: dict[int, list[int]] = {}
        for x in r.tolist():
            by_wh.setdefault(int(self.warehouse[x]), []).append(x)
        return by_wh

    # -- reads ---------------------------------------------------------------------------------
    def _consumer(self, consumer: str) -> _ConsumerState:
        cs = self.consumers.get(consumer)
        if cs is None:
            cs = self.consumers[consumer] = _ConsumerState(np.zeros(self.n_rows, bool))
        return cs

    def _ready_all(self, columns: Sequence[str]) -> np.ndarray:
        ok = ~self.dropped
        for c in columns:
            if c not in self.ready:
                return np.zeros(self.n_rows, bool)
            ok = ok & self.ready[c]
        return ok

    def row_tokens(self, columns: Sequence[str]) -> np.ndarray:
        """Balancing weight per row: summed numel of the requested columns that vary in length,
        else of every column that does; at least 1."""
        var = [c for c in self.lengths if c in self.kinds and not self.kinds[c][1]] + \
              [c for c in self.lengths if c not in self.kinds]  # cached columns: lengths given
        use = [c for c in columns if c in var] or var
        w = np.zeros(self.n_rows, np.int64)
        for c in use:
            w += self.lengths[c]
        return np.maximum(w, 1)

    def try_claim(self, consumer: str, columns: Sequence[str], count: int | None, dp_rank: int,
                  dp_size: int, whole_groups: bool) -> list[int] | None:
        """Rows for this rank now, or None when the caller has to wait."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DockError(f"get({consumer!r}): dp_rank {dp_rank} not in 0..{dp_size - 1}")
        if count is not None and count < 1:
            raise DockError(f"get({consumer!r}): count must be >= 1 or None, got {count}")
        cs = self._consumer(consumer)
        self.last_partition = None
        live = ~self.dropped
        untaken = live & ~cs.taken
        avail = untaken & self._ready_all(columns)
        if count is None:
            if cs.dp_size is None:
                cs.dp_size = dp_size
            elif cs.dp_size != dp_size:
                raise DockError(f"get({consumer!r}, count=None): dp_size {dp_size} differs from "
                                f"the {cs.dp_size} this consumer used before in step {self.step}")
            rnd = cs.cursor.get(dp_rank, 0)
            if rnd < len(cs.partitions):
                cs.cursor[dp_rank] = rnd + 1
                self.last_partition = cs.partitions[rnd]
                return cs.partitions[rnd][dp_rank]
            # New round: everything not taken must be ready (so whole groups are complete).
            if not untaken.any() or (avail != untaken).any():
                return None
            rows = np.flatnonzero(avail)
            w = self.row_tokens(columns)
            if whole_groups:
                units = self._groups_of(rows)
            else:
                units = [[int(x)] for x in rows]
            weights = [float(w[u].sum()) for u in units]
            bins = (partition_lpt(weights, dp_size, True) if self.equal_count
                    else partition_kk(weights, dp_size))
            part = [sorted(x for i in b for x in units[i]) for b in bins]
            cs.taken[rows] = True
            cs.partitions.append(part)
            cs.cursor[dp_rank] = rnd + 1
            self.version += 1
            self.last_partition = part
            return part[dp_rank]
        # Streaming: the first `count` ready rows (or whole groups) nobody of this consumer took.
        if whole_groups:
            chosen: list[int] = []
            remaining_units = 0
            for g in self._groups_of(np.flatnonzero(untaken)):
                remaining_units += 1
                if avail[g].all() and len(chosen) + len(g) <= count:
                    chosen.extend(g)
            all_left_ready = remaining_units > 0 and bool((avail == untaken).all())
            if not chosen or (len(chosen) < count and not all_left_ready):
                return None
        else:
            rows = np.flatnonzero(avail)
            n_left = int(untaken.sum())
            if rows.size < count and not (rows.size == n_left and n_left > 0):
                return None
            chosen = rows[:count].tolist()
        cs.taken[chosen] = True
        self.version += 1
        return chosen

    def _groups_of(self, rows: np.ndarray) -> list[list[int]]:
        """Rows grouped by prompt group; only groups whose every live row is in ``rows``."""
        rowset = set(rows.tolist())
        out = []
        for gid in sorted({int(self.group_of[r]) for r in rowset}):
            first, size = self.groups[gid]
            members = [x for x in range(first, first + size) if not self.dropped[x]]
            if members and all(x in rowset for x in members):
                out.append(members)
        return out

    def diagnose(self, consumer: str, columns: Sequence[str], count, dp_rank, dp_size) -> dict:
        cs = self._consumer(consumer)
        live = ~self.dropped
        return {
            "step": self.step, "total": self.n_rows, "live": int(live.sum()),
            "taken": int((cs.taken & live).sum()), "dp_rank": dp_rank, "dp_size": dp_size,
            "wanted": "all remaining" if count is None else count,
            "ready": {c: int((self.ready[c] & live).sum()) if c in self.ready else 0 for c in columns},
            "ready_all": int((self._ready_all(columns) & ~cs.taken).sum()),
        }

    def where(self, columns: Sequence[str], rows: Sequence[int]) -> tuple[dict, dict]:
        """(cached: col -> holder rank per row, stored: warehouse -> rows) for a claimed batch."""
        r = np.asarray(list(rows), np.int64)
        cached, stored_cols = {}, []
        for c in columns:
            h = self.holder[c][r] if c in self.holder else np.full(r.size, -1)
            if (h >= 0).any():
                if (h < 0).any():
                    raise DockError(f"column {c!r}: rows {r[h < 0][:8].tolist()} are in the dock "
                                    f"but rows {r[h >= 0][:8].tolist()} are cached on ranks; "
                                    "a column must be either cached or stored for a whole batch")
                cached[c] = h.tolist()
            else:
                stored_cols.append(c)
        by_wh: dict[int, list[int]] = {}
        for x in r.tolist():
            by_wh.setdefault(int(self.warehouse[x]), []).append(x)
        kinds = {c: self.kinds.get(c, ("float32", True)) for c in stored_cols}
        return cached, {"columns": stored_cols, "by_warehouse": by_wh, "kinds": kinds,
                        "partition": self.last_partition}

    def cached_on(self, column: str, rows: Sequence[int]) -> list[int | None]:
        r = self._check_rows(rows, "cached_on")
        if column not in self.holder:
            return [None] * r.size
        return [int(h) if h >= 0 else None for h in self.holder[column][r]]

    def all_consumed(self, consumer: str) -> bool:
        cs = self._consumer(consumer)
        return bool((cs.taken | self.dropped).all())

    def stats(self) -> dict:
        live = ~self.dropped
        return {
            "step": self.step, "rows": self.n_rows, "live_rows": int(live.sum()),
            "groups": len(self.groups), "dropped_rows": int(self.dropped.sum()),
            "ready": {c: int((a & live).sum()) for c, a in self.ready.items()},
            "cached": {c: int(((h >= 0) & live).sum()) for c, h in self.holder.items() if (h >= 0).any()},
            "consumed": {c: int((cs.taken & live).sum()) for c, cs in self.consumers.items()},
            "rows_per_warehouse": np.bincount(self.warehouse[live], minlength=self.n_warehouses).tolist(),
        }


# ----------------------------------------------------------------------------------------------
# The client-facing API.
# ----------------------------------------------------------------------------------------------

@dataclass
class Batch:
    """Rows handed to one consumer rank.

    ``columns[name]`` is a stacked tensor ``[rows, *shape]`` for columns put stacked, else a list of
    per-row tensors (unpadded). Cached columns are not in ``columns``; ``holders[name][i]`` is the
    rank whose TensorCache holds row ``rows[i]`` (fetch with ``TensorCache.exchange``).
    """

    rows: list[int]
    columns: dict[str, torch.Tensor | list[torch.Tensor]]
    holders: dict[str, list[int]] = field(default_factory=dict)
    # count=None only: the rows of every dp rank in this round (entry r = rank r's rows), e.g. for
    # TensorCache.exchange(columns, batch.partition) without gathering the wants first.
    partition: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, name: str):
        return self.columns[name]

    def lengths(self, name: str) -> torch.Tensor:
        """Row lengths (first dim) of a column; ``[rows]`` int64."""
        col = self.columns[name]
        if isinstance(col, torch.Tensor):
            return torch.full((col.shape[0],), col.shape[1] if col.dim() > 1 else 1, dtype=torch.int64)
        return torch.tensor([t.shape[0] if t.dim() else 1 for t in col], dtype=torch.int64)

    def padded(self, name: str, pad_value: float | int = 0, *, left: bool = False,
               max_len: int | None = None) -> torch.Tensor:
        """A list column right- (or left-) padded into ``[rows, max_len]`` (a copy)."""
        col = self.columns[name]
        if isinstance(col, torch.Tensor):
            return col.clone()
        if not col:
            return torch.zeros(0, max_len or 0)
        n = max_len if max_len is not None else max(t.shape[0] for t in col)
        out = torch.full((len(col), n, *col[0].shape[1:]), pad_value, dtype=col[0].dtype)  # [rows, n]
        for i, t in enumerate(col):
            t = t[:n]
            if left:
                out[i, n - t.shape[0]:] = t
            else:
                out[i, : t.shape[0]] = t
        return out

    def mask(self, name: str, *, left: bool = False, max_len: int | None = None) -> torch.Tensor:
        """``[rows, max_len]`` bool mask of real (unpadded) positions of a list column."""
        lens = self.lengths(name)
        n = max_len if max_len is not None else int(lens.max()) if len(lens) else 0
        ar = torch.arange(n)
        return (ar[None, :] >= n - lens[:, None]) if left else (ar[None, :] < lens[:, None])


class DockClient(abc.ABC):
    """The API every backend implements. See the module docstring for the semantics."""

    @abc.abstractmethod
    def reset(self, step: int) -> None:
        ...

    @abc.abstractmethod
    def add_groups(self, n_groups: int, group_size: int) -> list[int]:
        ...

    @abc.abstractmethod
    def put(self, columns: dict[str, torch.Tensor | list[torch.Tensor]], rows: Sequence[int], *,
            rank: int | None = None) -> None:
        """Store ``columns`` for ``rows`` and mark them ready. ``rank`` (the writer's worker rank) is
        accepted for symmetry with :meth:`mark_cached` but not used: stored data goes to the row's
        warehouse whoever writes it."""
        ...

    @abc.abstractmethod
    def get(self, consumer: str, columns: Sequence[str], count: int | None = None, *, dp_rank: int = 0,
            dp_size: int = 1, whole_groups: bool = False, timeout: float = DEFAULT_TIMEOUT_S,
            copy: bool = False) -> Batch:
        ...

    @abc.abstractmethod
    def mark_cached(self, columns: dict[str, Sequence[int] | None] | Sequence[str], rows: Sequence[int],
                    rank: int) -> None:
        ...

    @abc.abstractmethod
    def cached_on(self, column: str, rows: Sequence[int]) -> list[int | None]:
        ...

    @abc.abstractmethod
    def all_consumed(self, consumer: str) -> bool:
        ...

    @abc.abstractmethod
    def drop_rows(self, rows: Sequence[int]) -> None:
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


def _empty_batch(stored: dict, cached: dict) -> Batch:
    cols = {}
    for c in stored["columns"]:
        dtype, stacked = stored["kinds"][c]
        cols[c] = torch.empty(0, dtype=getattr(torch, dtype)) if stacked else []
    return Batch([], cols, {c: [] for c in cached}, stored["partition"])


class LocalDock(DockClient):
    """In-process backend: metadata and data in this process, guarded by one condition variable."""

    def __init__(self, *, equal_count: bool = True):
        self._meta = _Meta(1, equal_count)
        self._store = _ColumnStore()
        self._cond = threading.Condition()

    def __reduce__(self):
        raise TypeError("a local TransferDock lives in one process and cannot be pickled; "
                        "share it between threads, or use TransferDock.ray(...) across processes")

    def reset(self, step: int) -> None:
        with self._cond:
            self._meta.reset(step)
            self._store.clear()
            self._cond.notify_all()

    def add_groups(self, n_groups: int, group_size: int) -> list[int]:
        with self._cond:
            rows = self._meta.add_groups(n_groups, group_size)
            self._cond.notify_all()
            return rows

    def put(self, columns, rows, *, rank=None) -> None:
        rows = [int(r) for r in rows]
        meta, packed = _put_meta(columns, rows, own=True)
        with self._cond:
            self._meta.placement(rows)  # validates rows
            self._meta.mark_ready(meta, rows)  # validates kinds before data is written
            for c, p in packed.items():
                self._store.write(c, rows, p)
            self._cond.notify_all()

    def get(self, consumer, columns, count=None, *, dp_rank=0, dp_size=1, whole_groups=False,
            timeout=DEFAULT_TIMEOUT_S, copy=False) -> Batch:
        columns = list(columns)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                rows = self._meta.try_claim(consumer, columns, count, dp_rank, dp_size, whole_groups)
                if rows is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DockTimeout(consumer, columns, timeout,
                                      self._meta.diagnose(consumer, columns, count, dp_rank, dp_size))
                self._cond.wait(left)
            cached, stored = self._meta.where(columns, rows)
            self._cond.notify_all()  # a new partition may serve ranks waiting for it
            if not rows:
                return _empty_batch(stored, cached)
            data = {c: self._store.read(c, rows) for c in stored["columns"]}
        return Batch(list(rows), {c: unpack(p, copy) for c, p in data.items()}, cached,
                     stored["partition"])

    def mark_cached(self, columns, rows, rank) -> None:
        with self._cond:
            self._meta.mark_ready(_cached_meta(columns, rows), [int(r) for r in rows], holder=int(rank))
            self._cond.notify_all()

    def cached_on(self, column, rows):
        with self._cond:
            return self._meta.cached_on(column, rows)

    def all_consumed(self, consumer) -> bool:
        with self._cond:
            return self._meta.all_consumed(consumer)

    def drop_rows(self, rows) -> None:
        rows = [int(r) for r in rows]
        with self._cond:
            self._meta.drop_rows(rows)
            self._store.drop(rows)
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            s = self._meta.stats()
            s["backend"] = "local"
            s["warehouses"] = [self._store.stats()]
            return s


# ----------------------------------------------------------------------------------------------
# Ray backend.
# ----------------------------------------------------------------------------------------------

class _Controller:
    """Ray actor body (async): metadata only. All methods run on one event loop: no locks."""

    def __init__(self, n_warehouses: int, equal_count: bool):
        self.meta = _Meta(n_warehouses, equal_count)
        self.changed: asyncio.Event | None = None

    def _notify(self):
        if self.changed is not None:
            self.changed.set()
            self.changed = None

    async def reset(self, step):
        self.meta.reset(step)
        self._notify()

    async def add_groups(self, n_groups, group_size, warehouse=None):
        rows = self.meta.add_groups(n_groups, group_size, warehouse)
        self._notify()
        return self.meta.step, rows, self.meta.warehouse[rows].tolist() if rows else []

    async def placement(self, rows):
        return self.meta.step, self.meta.placement(rows)

    async def mark_ready(self, meta, rows, holder=-1):
        self.meta.mark_ready(meta, rows, holder)
        self._notify()

    async def commit(self, step, warehouse, meta, rows):
        """A warehouse stored ``rows``: mark them ready. Called by the warehouse (not the client)
        after the data is in place, so a reader that claims the rows finds them. Returns None,
        ``("misplaced", step, warehouses)`` when the writer's row -> warehouse map was stale, or
        ``("error", message)``; the warehouse then takes the write back."""
        if step != self.meta.step:
            return ("error", f"put: the dock moved to step {self.meta.step} while writing rows "
                             f"{list(rows)[:8]} (written at step {step})")
        try:
            whs = self.meta.placement(rows)
            if any(w != warehouse for w in whs):
                return ("misplaced", self.meta.step, whs)
            self.meta.mark_ready(meta, rows, -1)
        except DockError as e:
            return ("error", str(e))
        self._notify()
        return None

    async def claim(self, consumer, columns, count, dp_rank, dp_size, whole_groups, timeout):
        """("ok", rows, cached, stored) or ("timeout", diagnostics)."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.meta.try_claim(consumer, columns, count, dp_rank, dp_size, whole_groups)
            if rows is not None:
                self._notify()
                cached, stored = self.meta.where(columns, rows)
                stored["step"] = self.meta.step
                return ("ok", rows, cached, stored)
            left = deadline - time.monotonic()
            if left <= 0:
                return ("timeout", self.meta.diagnose(consumer, columns, count, dp_rank, dp_size))
            if self.changed is None:
                self.changed = asyncio.Event()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass

    async def cached_on(self, column, rows):
        return self.meta.cached_on(column, rows)

    async def all_consumed(self, consumer):
        return self.meta.all_consumed(consumer)

    async def drop_rows(self, rows):
        by_wh = self.meta.drop_rows(rows)
        self._notify()
        return by_wh

    async def stats(self):
        return self.meta.stats()

    async def step(self):
        return self.meta.step


class _Warehouse:
    """Ray actor body (async, one event loop: no locks): the tensors of the rows assigned to this
    warehouse (one per node). A write stores the rows, then tells the controller they are ready
    (``commit``) before answering the writer -- one client round trip per put and warehouse."""

    def __init__(self, index: int, controller):
        self.index = index
        self.controller = controller
        self.store = _ColumnStore()
        self.step = None

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    async def clear(self, step):
        self.store.clear()
        self.step = step

    async def write(self, rows, packed: dict, meta: dict):
        """Store, then commit at the controller. None when done; else the controller's answer
        (``("misplaced", step, warehouses)`` or ``("error", message)``), with nothing kept."""
        step = self.step
        undo = [u for c, p in packed.items() for u in self.store.write(c, rows, p)]
        res = await self.controller.commit.remote(step, self.index, meta, rows)
        if res is not None and self.step == step:
            self.store.undo(undo)
        return res

    async def read(self, step, columns, rows) -> dict:
        if step != self.step:
            raise DockError(f"warehouse {self.index}: read for step {step}, dock at step {self.step}")
        return {c: self.store.read(c, rows) for c in columns}

    async def drop(self, rows):
        self.store.drop(rows)

    async def stats(self):
        s = self.store.stats()
        s["index"] = self.index
        s["node_id"] = self.node_id()
        return s


class RayDock(DockClient):
    """Ray backend client: picklable (actor handles + config), used the same way in every actor."""

    def __init__(self, controller, warehouses: list, node_ids: list[str], placement: str):
        self._controller = controller
        self._warehouses = list(warehouses)
        self._node_ids = list(node_ids)
        self._placement = placement
        self._owner = False
        # Client-side cache of row -> warehouse (from add_groups, get and misplaced answers), so a
        # put costs one warehouse call. A stale entry is caught by the controller's commit (the
        # write is taken back and redone at the right warehouse). One warehouse: nothing to learn.
        self._wh_of: dict[int, int] = {}

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_owner"] = False   # only the creator kills the actors
        d["_wh_of"] = {}
        return d

    def _learn(self, rows, whs) -> None:
        if len(self._warehouses) > 1:
            self._wh_of.update(zip(rows, whs))

    def with_placement(self, placement: str) -> "RayDock":
        """A client on the same actors that allocates rows with another policy
        (``round_robin`` or ``writer_node``)."""
        if placement not in ("round_robin", "writer_node"):
            raise DockError(f"placement {placement!r}: expected round_robin or writer_node")
        return RayDock(self._controller, self._warehouses, self._node_ids, placement)

    @property
    def warehouse_nodes(self) -> list[str]:
        """Node id of each warehouse (index = warehouse number)."""
        return list(self._node_ids)

    def _ray(self):
        import ray
        return ray

    def reset(self, step: int) -> None:
        ray = self._ray()
        # Warehouses and controller in parallel: one round trip of latency.
        ray.get([w.clear.remote(step) for w in self._warehouses] + [self._controller.reset.remote(step)])
        self._wh_of = {}

    def _local_warehouse(self) -> int | None:
        try:
            node = self._ray().get_runtime_context().get_node_id()
        except Exception:
            return None
        return self._node_ids.index(node) if node in self._node_ids else None

    def add_groups(self, n_groups: int, group_size: int) -> list[int]:
        wh = self._local_warehouse() if self._placement == "writer_node" else None
        step, rows, whs = self._ray().get(self._controller.add_groups.remote(n_groups, group_size, wh))
        self._learn(rows, whs)
        return rows

    def put(self, columns, rows, *, rank=None) -> None:
        ray = self._ray()
        rows = [int(r) for r in rows]
        meta, packed = _put_meta(columns, rows, own=False)
        todo = list(range(len(rows)))      # positions in `rows` still to write
        for attempt in range(3):
            if len(self._warehouses) == 1:
                wh_of = [0] * len(todo)
            else:
                if any(rows[i] not in self._wh_of for i in todo):
                    _, whs = ray.get(self._controller.placement.remote([rows[i] for i in todo]))
                    self._learn([rows[i] for i in todo], whs)
                wh_of = [self._wh_of[rows[i]] for i in todo]
            by_wh: dict[int, list[int]] = {}
            for i, w in zip(todo, wh_of):
                by_wh.setdefault(w, []).append(i)
            writes = [(pos, self._warehouses[w].write.remote(
                [rows[i] for i in pos], {c: slice_packed(p, pos) for c, p in packed.items()},
                {c: (d, st, [ls[i] for i in pos]) for c, (d, st, ls) in meta.items()}))
                for w, pos in by_wh.items()]
            todo = []
            for (pos, _), res in zip(writes, ray.get([r for _, r in writes])):
                if res is None:
                    continue
                if res[0] == "error":
                    raise DockError(res[1])
                self._learn([rows[i] for i in pos], res[2])      # misplaced: learn and redo
                todo += pos
            if not todo:
                return
        raise DockError(f"put: rows {rows[:8]} kept moving between warehouses")

    def get(self, consumer, columns, count=None, *, dp_rank=0, dp_size=1, whole_groups=False,
            timeout=DEFAULT_TIMEOUT_S, copy=False) -> Batch:
        ray = self._ray()
        columns = list(columns)
        ref = self._controller.claim.remote(consumer, columns, count, dp_rank, dp_size, whole_groups,
                                            float(timeout))
        try:
            res = ray.get(ref, timeout=timeout + 60.0)
        except ray.exceptions.GetTimeoutError:
            raise DockTimeout(consumer, columns, timeout, {
                "step": "?", "total": "?", "live": "?", "taken": "?", "dp_rank": dp_rank,
                "dp_size": dp_size, "wanted": count, "ready": {}, "ready_all": "? (controller unresponsive)"})
        if res[0] == "timeout":
            raise DockTimeout(consumer, columns, timeout, res[1])
        _, rows, cached, stored = res
        step = stored["step"]
        for w, rs in stored["by_warehouse"].items():
            self._learn(rs, [w] * len(rs))
        cols = stored["columns"]
        parts: dict[str, list[Packed]] = {c: [] for c in cols}
        pos: list[int] = []
        if cols and rows:
            refs = {w: self._warehouses[w].read.remote(step, cols, rs)
                    for w, rs in stored["by_warehouse"].items()}
            got = dict(zip(refs, ray.get(list(refs.values()))))
            for w, rs in stored["by_warehouse"].items():
                pos.extend(rs)
                for c in cols:
                    parts[c].append(got[w][c])
        if not rows:
            return _empty_batch(stored, cached)
        data = {}
        if cols:
            # Restore the claimed row order (the warehouses answered grouped by warehouse).
            order = np.argsort(np.asarray(pos), kind="stable")
            want = np.searchsorted(np.asarray(pos)[order], np.asarray(rows))
            idx = order[want].tolist()
            for c in cols:
                p = concat_packed(parts[c])
                data[c] = unpack(p if idx == list(range(len(idx))) else slice_packed(p, idx), copy)
        return Batch(list(rows), data, cached, stored["partition"])

    def mark_cached(self, columns, rows, rank) -> None:
        self._ray().get(self._controller.mark_ready.remote(
            _cached_meta(columns, rows), [int(r) for r in rows], int(rank)))

    def cached_on(self, column, rows):
        return self._ray().get(self._controller.cached_on.remote(column, list(rows)))

    def all_consumed(self, consumer) -> bool:
        return self._ray().get(self._controller.all_consumed.remote(consumer))

    def drop_rows(self, rows) -> None:
        ray = self._ray()
        by_wh = ray.get(self._controller.drop_rows.remote([int(r) for r in rows]))
        ray.get([self._warehouses[w].drop.remote(rs) for w, rs in by_wh.items()])

    def stats(self) -> dict:
        ray = self._ray()
        s = ray.get(self._controller.stats.remote())
        s["backend"] = "ray"
        s["warehouses"] = ray.get([w.stats.remote() for w in self._warehouses])
        return s

    def shutdown(self) -> None:
        """Kill the controller and warehouses (only from the client that created them)."""
        if not self._owner:
            return
        ray = self._ray()
        for a in [self._controller, *self._warehouses]:
            try:
                ray.kill(a)
            except Exception:
                pass
        self._owner = False


class TransferDock:
    """Constructors of the two backends."""

    @staticmethod
    def local(*, equal_count: bool = True) -> LocalDock:
        """In-process dock (threads). ``equal_count``: balanced bins hold equal row counts (LPT);
        False: Karmarkar-Karp on tokens only."""
        return LocalDock(equal_count=equal_count)

    @staticmethod
    def ray(*, name: str | None = None, nodes: Sequence[str] | None = None,
            placement: str = "round_robin", equal_count: bool = True,
            warehouse_threads: int = 4) -> RayDock:
        """Start the controller and one warehouse per alive Ray node (or per id in ``nodes``).

        ``placement``: ``round_robin`` assigns prompt groups to warehouses in turn;
        ``writer_node`` puts the groups on the warehouse of the node that calls ``add_groups``.
        ``name``: a name prefix for the actors (findable with ``ray.get_actor``).
        ``warehouse_threads``: kept for compatibility; ignored (warehouses are async actors:
        one event loop, reads return gathered arrays without holding a lock).
        Needs ``ray.init`` first. Call ``shutdown()`` on the returned client to stop the actors.
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            raise DockError("TransferDock.ray(): Ray is not initialised; call ray.init() (or "
                            "rlrecipes.cluster) first, or use TransferDock.local()")
        if placement not in ("round_robin", "writer_node"):
            raise DockError(f"TransferDock.ray(placement={placement!r}): expected round_robin or writer_node")
        if nodes is None:
            nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        nodes = list(nodes)
        if not nodes:
            raise DockError("TransferDock.ray(): no alive Ray nodes")
        opts = {"num_cpus": 0, "max_restarts": 0}
        ctl_opts = dict(opts)
        if name:
            ctl_opts["name"] = f"{name}:controller"
        controller = ray.remote(_Controller).options(**ctl_opts).remote(len(nodes), equal_count)
        warehouses = []
        for i, node in enumerate(nodes):
            w_opts = dict(opts, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
            if name:
                w_opts["name"] = f"{name}:warehouse{i}"
            warehouses.append(ray.remote(_Warehouse).options(**w_opts).remote(i, controller))
        got = ray.get([w.node_id.remote() for w in warehouses])
        if got != nodes:  # NodeAffinity with soft=False guarantees this; check anyway
            raise DockError(f"warehouses landed on {got}, expected {nodes}")
        dock = RayDock(controller, warehouses, nodes, placement)
        dock._owner = True
        dock.reset(0)
        return dock
