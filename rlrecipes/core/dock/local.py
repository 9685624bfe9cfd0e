"""The in-process backend: one warehouse (``warehouse.py``) in the client's process, hosting the
controller. The same write (store, then commit, undone on refusal), claim and read as the Ray
backend's warehouses, with no process boundary (unit tests, single-process runs, the in-worker dock)."""
from __future__ import annotations

from .errors import DockError, DockTimeout, DEFAULT_TIMEOUT_S
from .packing import unpack
from .client import Batch, DockClient, _put_meta, _cached_meta, _empty_batch
from . import messages as m
from .warehouse import _Warehouse


class LocalDock(DockClient):
    """In-process backend, thread-safe: the warehouse's lock guards the tensors, the controller's
    condition variable the metadata (a get blocks on it until its rows are ready)."""

    def __init__(self, *, equal_count: bool = True):
        self._wh = _Warehouse(0, None, 1, equal_count)
        self.reset(0)

    def __reduce__(self):
        raise TypeError("a local TransferDock lives in one process and cannot be pickled; "
                        "share it between threads, or use TransferDock.ray(...) across processes")

    def _start_reset(self, step, groups):
        self._wh.clear(m.Clear(step))
        res = self._wh.handle(m.Reset(step, groups))
        return res.rows if res is not None else None

    def _finish_reset(self, started):
        return started

    def add_groups(self, n_groups: int, group_size: int) -> list[int]:
        return self._wh.handle(m.AddGroups(n_groups, group_size)).rows

    def put(self, columns, rows, *, defer=False) -> None:  # in process: always written at once
        rows = [int(r) for r in rows]
        meta, packed = _put_meta(columns, rows, own=True)  # the store keeps the arrays: copy them
        res = self._wh.write(m.Write(rows, packed, meta))
        if isinstance(res, m.Refused):  # one warehouse: never moved
            raise DockError(res.message)

    def get(self, consumer, columns, count=None, *, dp_rank=0, dp_size=1, whole_groups=False,
            timeout=DEFAULT_TIMEOUT_S, copy=False) -> Batch:
        columns = list(columns)
        res = self._wh.claim_read(m.ClaimRead(
            m.Claim(consumer, columns, count, dp_rank, dp_size, whole_groups, float(timeout)), m.Apply()))
        claim = res.claim
        if isinstance(claim, m.TimedOut):
            raise DockTimeout(consumer, columns, timeout, claim.diagnostics)
        if not claim.rows:
            return _empty_batch(claim)
        if claim.columns and res.share is None:
            raise DockError(f"get({consumer!r}): the dock moved past step {claim.step} while its "
                            f"rows were being read; a reset must not overlap a stage's reads")
        return Batch(list(claim.rows), {c: unpack(p, copy) for c, p in (res.share or {}).items()}, claim.cached,
                     claim.partition, claim.partition_holders)

    def mark_cached(self, columns, rows, rank, *, defer=False) -> None:
        self._wh.handle(m.MarkReady(_cached_meta(columns, rows), [int(r) for r in rows], int(rank)))

    def cached_on(self, column, rows):
        return self._wh.handle(m.CachedOn(column, rows))

    def all_consumed(self, consumer) -> bool:
        return self._wh.handle(m.AllConsumed(consumer))

    def drop_rows(self, rows, *, defer=False) -> None:
        rows = [int(r) for r in rows]
        self._wh.handle(m.DropRows(rows))
        self._wh.drop(m.Drop(rows))

    def stats(self) -> dict:
        s = self._wh.handle(m.ControllerStats())
        s["backend"] = "local"
        s["warehouses"] = [self._wh.store_stats(node=False)]
        return s
