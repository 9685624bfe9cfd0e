"""The in-process backend: one lock + condition around the metadata and a column store (tests, one process)."""
from __future__ import annotations

import threading
import time

from .errors import DockTimeout, DEFAULT_TIMEOUT_S
from .packing import unpack, _ColumnStore
from .metadata import _Meta
from .client import Batch, DockClient, _put_meta, _cached_meta, _empty_batch


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

    def put(self, columns, rows) -> None:
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
