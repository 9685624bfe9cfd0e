"""The Ray backend: a metadata-only controller actor, one warehouse actor per node holding the tensors,
and the client that talks to both; the driver never touches sample data."""
from __future__ import annotations

import asyncio
import time

import numpy as np

from .errors import DockError, DockTimeout, DEFAULT_TIMEOUT_S
from .packing import Packed, slice_packed, concat_packed, unpack, _ColumnStore
from .metadata import _Meta
from .client import Batch, DockClient, _put_meta, _cached_meta, _empty_batch


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

    @property
    def warehouse_nodes(self) -> list[str]:
        """The Ray node id of each warehouse (one per node)."""
        return list(self._node_ids)

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

    def put(self, columns, rows) -> None:
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
