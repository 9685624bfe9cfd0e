"""Controller-side bookkeeping: per-column readiness, per-consumer consumption, groups, row -> warehouse
map, token lengths, cache holders, and the balanced hand-out of rows to DP ranks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .errors import DockError
from .balance import partition_claim
from .messages import Claimed


@dataclass
class _ConsumerState:
    taken: np.ndarray                      # [rows] bool: row already handed to some dp rank
    dp_size: int | None = None
    partitions: list[list[list[int]]] = field(default_factory=list)   # [round][dp_rank] -> rows
    holders: list[dict] = field(default_factory=list)   # [round] cached col -> [dp_rank] -> holder per row
    cursor: dict[int, int] = field(default_factory=dict)              # dp_rank -> next round


class _Meta:
    """Readiness / consumption / groups / placement of the rows of one step: the controller's
    state, shared by both backends. No tensors, no locking."""

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
        self.last_partition: list[list[int]] | None = None   # of the last count=None claim
        self.last_holders: dict = {}                          # its cached columns' holders, per bin

    # -- allocation ----------------------------------------------------------------------------
    def _grow(self, n: int):
        def grow(a, fill):
            return np.concatenate([a, np.full(n - a.size, fill, a.dtype)])
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
        start, gids = self.n_rows, np.arange(len(self.groups), len(self.groups) + n_groups)
        self.n_rows += n_groups * group_size
        self._grow(self.n_rows)
        self.groups += [(start + g * group_size, group_size) for g in range(n_groups)]
        self.group_of[start:] = np.repeat(gids, group_size)
        if warehouse is None:  # round robin by group
            warehouse = np.repeat((self.next_wh + np.arange(n_groups)) % self.n_warehouses, group_size)
            self.next_wh += n_groups
        self.warehouse[start:] = warehouse
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
            for d, fill, dt in ((self.ready, False, bool), (self.holder, -1, np.int64), (self.lengths, 0, np.int64)):
                if col not in d:  # (a dict keyed by the fill value made `ready` int64: False == 0)
                    d[col] = np.full(self.n_rows, fill, dt)
            self.ready[col][r] = True
            self.holder[col][r] = holder
            if lens is not None:
                self.lengths[col][r] = np.asarray(list(lens), np.int64)

    def drop_rows(self, rows: Sequence[int]) -> dict[int, list[int]]:
        r = np.asarray(list(rows), np.int64)
        if r.size and (r.min() < 0 or r.max() >= self.n_rows):
            raise DockError(f"drop_rows: rows outside 0..{self.n_rows - 1} in step {self.step}")
        self.dropped[r] = True
        return self._by_warehouse(r)

    def _by_warehouse(self, r: np.ndarray) -> dict[int, list[int]]:
        wh = self.warehouse[r]
        if r.size and (wh == wh[0]).all():  # one warehouse (the usual case)
            return {int(wh[0]): r.tolist()}
        by_wh: dict[int, list[int]] = {}
        for x, w in zip(r.tolist(), wh.tolist()):
            by_wh.setdefault(w, []).append(x)
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
        var = [c for c in self.lengths if c not in self.kinds or not self.kinds[c][1]]  # cached ones too
        use = [c for c in columns if c in var] or var
        return np.maximum(sum((self.lengths[c] for c in use), np.zeros(self.n_rows, np.int64)), 1)

    def try_claim(self, consumer: str, columns: Sequence[str], count: int | None, dp_rank: int,
                  dp_size: int, whole_groups: bool) -> list[int] | None:
        """Rows for this rank now, or None when the caller has to wait."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DockError(f"get({consumer!r}): dp_rank {dp_rank} not in 0..{dp_size - 1}")
        if count is not None and count < 1:
            raise DockError(f"get({consumer!r}): count must be >= 1 or None, got {count}")
        cs = self._consumer(consumer)
        self.last_partition, self.last_holders = None, {}
        untaken = ~self.dropped & ~cs.taken
        if count is None:
            if cs.dp_size is None:
                cs.dp_size = dp_size
            elif cs.dp_size != dp_size:
                raise DockError(f"get({consumer!r}, count=None): dp_size {dp_size} differs from "
                                f"the {cs.dp_size} this consumer used before in step {self.step}")
            rnd = cs.cursor.get(dp_rank, 0)
            if rnd == len(cs.partitions):  # new round: every row not taken must be ready (groups complete)
                if not untaken.any() or (untaken & ~self._ready_all(columns)).any():
                    return None
                self._partition(cs, columns, np.flatnonzero(untaken), dp_size, whole_groups)
            cs.cursor[dp_rank] = rnd + 1
            self.last_partition, self.last_holders = cs.partitions[rnd], cs.holders[rnd]
            return cs.partitions[rnd][dp_rank]
        # Streaming: the first `count` ready rows (or whole groups) nobody of this consumer took.
        avail = untaken & self._ready_all(columns)
        if whole_groups:
            flat, sizes = self._groups_of(np.flatnonzero(untaken))
            chosen: list[int] = []
            for g in np.split(flat, np.cumsum(sizes)[:-1]) if sizes.size else []:
                if avail[g].all() and len(chosen) + g.size <= count:
                    chosen += g.tolist()
            all_left_ready = sizes.size > 0 and bool((avail == untaken).all())
            if not chosen or (len(chosen) < count and not all_left_ready):
                return None
        else:
            rows = np.flatnonzero(avail)
            n_left = int(untaken.sum())
            if rows.size < count and not (rows.size == n_left and n_left > 0):
                return None
            chosen = rows[:count].tolist()
        cs.taken[chosen] = True
        return chosen

    def _partition(self, cs: _ConsumerState, columns: Sequence[str], rows, dp_size: int, whole_groups: bool):
        """A new round of ``cs``: ``rows`` (or their whole groups: units) over ``dp_size`` bins."""
        w = self.row_tokens(columns)
        if whole_groups:  # unit u: rows flat[starts[u]:starts[u] + sizes[u]]; flat ascending
            flat, sizes = self._groups_of(rows)
            starts = np.cumsum(sizes) - sizes
            weights = np.add.reduceat(w[flat], starts).astype(float).tolist() if flat.size else []
        else:
            flat, sizes, starts = rows, 1, np.arange(rows.size)
            weights = w[rows].astype(float).tolist()
        # Where it costs no balance, rows cached on ranks stay with their holder, and stored rows
        # go out in contiguous blocks (row order): a rank's read is then one slice of what one
        # writer put, not a gather from every writer's chunk.
        home = self._home_bins(columns, flat, starts, dp_size)
        unit_bin = np.zeros(len(weights), np.int64)
        for b, units in enumerate(partition_claim(weights, dp_size, home, self.equal_count)):
            unit_bin[units] = b
        row_bin = np.repeat(unit_bin, sizes)
        order = np.argsort(row_bin, kind="stable")             # rows stay ascending within a bin
        part = np.split(flat[order], np.cumsum(np.bincount(row_bin, minlength=dp_size))[:-1])
        cs.taken[rows] = True
        cs.partitions.append([p.tolist() for p in part])
        # a snapshot every rank of the round gets alike (TensorCache.exchange skips its
        # collectives when each bin's rows are all held by that bin's rank)
        cs.holders.append({c: [self.holder[c][p].tolist() for p in part]
                           for c in columns if c in self.holder and (self.holder[c][rows] >= 0).all()})

    def _home_bins(self, columns: Sequence[str], flat, starts, dp_size: int) -> np.ndarray:
        """Per unit (its rows ``flat[starts[u]:starts[u + 1]]``), the bin it would rather be in. With a
        cached column claimed: the rank whose TensorCache holds it (the holder rank counts as the DP
        rank, as in a pure-DP layout; -1 when its rows are held apart or on a rank outside
        ``0..dp_size-1``), for the largest such column. Else its block of the row order (unit i of n:
        bin ``i * dp_size // n``)."""
        cached = [c for c in columns if c in self.holder and (self.holder[c] >= 0).any()]
        if not cached or not starts.size:
            return np.arange(starts.size) * dp_size // max(starts.size, 1)
        held = self.holder[max(cached, key=lambda c: int(self.lengths[c].sum()))][flat]
        lo, hi = np.minimum.reduceat(held, starts), np.maximum.reduceat(held, starts)
        return np.where((lo == hi) & (lo >= 0) & (lo < dp_size), lo, -1)

    def _groups_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The prompt groups whose every live row is in ``rows`` (one at least): their live rows,
        ascending (a group's rows are contiguous, groups in order), and the number per group."""
        live, inside = ~self.dropped, np.zeros(self.n_rows, bool)
        inside[rows] = True
        count = lambda sel: np.bincount(self.group_of[sel], minlength=len(self.groups))  # noqa: E731
        ok = (count(live & inside) > 0) & (count(live & ~inside) == 0)
        flat = np.flatnonzero(live & ok[self.group_of])
        return flat, count(flat)[ok]

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

    def where(self, columns: Sequence[str], rows: Sequence[int]) -> Claimed:
        """A claimed batch's answer: where its rows are (cached: col -> holder rank per row; stored
        columns: warehouse -> rows) and this round's partition."""
        r = np.asarray(list(rows), np.int64)
        cached, stored_cols = {}, []
        for c in columns:
            h = self.holder[c][r] if c in self.holder else None
            if h is None or not (h >= 0).any():
                stored_cols.append(c)
            elif (h < 0).any():
                raise DockError(f"column {c!r}: rows {r[h < 0][:8].tolist()} are in the dock "
                                f"but rows {r[h >= 0][:8].tolist()} are cached on ranks; "
                                "a column must be either cached or stored for a whole batch")
            else:
                cached[c] = h.tolist()
        kinds = {c: self.kinds.get(c, ("float32", True)) for c in stored_cols}
        return Claimed(self.step, rows, cached, stored_cols, self._by_warehouse(r), kinds,
                       self.last_partition, self.last_holders)

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
