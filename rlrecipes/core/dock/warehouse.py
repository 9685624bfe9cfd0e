"""The dock's bookkeeping and storage, one implementation for every backend: :class:`_Controller`
(``_Meta`` behind one condition variable) and :class:`_Warehouse` (the tensors of its rows behind one
lock, and on the head warehouse the controller): one threaded actor per node (``ray_backend.py``),
or one object in the client's process (``local.py``). A write stores, then commits, undone on refusal.
"""
from __future__ import annotations

import threading
import time

from .errors import DockError
from . import messages as m
from .packing import positions_by, _ColumnStore
from .metadata import _Meta


class _Controller:
    """The metadata controller: ``_Meta`` behind one condition variable. It runs in the head
    warehouse's process, called from that actor's threads (a threaded actor); a claim blocks its
    thread until the rows are ready. :meth:`handle` takes a controller request
    (``messages.ControllerRequest``) and dispatches on its type."""

    def __init__(self, n_warehouses: int, equal_count: bool):
        self.meta = _Meta(n_warehouses, equal_count)
        self.cond = threading.Condition()
        self._handlers = {
            m.Reset: self.reset, m.AddGroups: self.add_groups, m.Placement: self.placement,
            m.Commit: self.commit, m.Claim: self.claim, m.CurrentStep: self.step,
            m.MarkReady: self.mark_ready, m.DropRows: self.drop_rows, m.CachedOn: self.cached_on,
            m.AllConsumed: self.all_consumed, m.ControllerStats: self.stats,
        }

    def handle(self, req: m.ControllerRequest):
        handler = self._handlers.get(type(req))
        if handler is None:
            raise DockError(f"the dock's controller takes no {type(req).__name__}")
        return handler(req)

    def reset(self, req: m.Reset) -> m.Allocated | None:
        """Start ``step``; with ``groups=(n_groups, group_size)`` allocate them too (as add_groups)."""
        with self.cond:
            self.meta.reset(req.step)
            self.cond.notify_all()
            if req.groups is None:
                return None
            n_groups, group_size = req.groups
            return self._add(n_groups, group_size, req.warehouse)

    def add_groups(self, req: m.AddGroups) -> m.Allocated:
        with self.cond:
            self.cond.notify_all()
            return self._add(req.n_groups, req.group_size, req.warehouse)

    def _add(self, n_groups, group_size, warehouse) -> m.Allocated:
        rows = self.meta.add_groups(n_groups, group_size, warehouse)
        return m.Allocated(self.meta.step, rows, self.meta.warehouse[rows].tolist() if rows else [])

    def placement(self, req: m.Placement) -> m.Placed:
        with self.cond:
            return m.Placed(self.meta.step, self.meta.placement(req.rows))

    def commit(self, req: m.Commit) -> m.Committed | m.Moved | m.Refused:
        """A warehouse stored ``rows``: mark them ready. Called by the warehouse (not the client)
        after the data is in place, so a reader that claims the rows finds them. ``Moved`` when the
        writer's row -> warehouse map was stale, ``Refused`` with the reason; the warehouse then
        takes the write back."""
        with self.cond:
            if req.step != self.meta.step:
                return m.Refused(f"put: the dock moved to step {self.meta.step} while writing rows "
                                 f"{list(req.rows)[:8]} (written at step {req.step})")
            try:
                whs = self.meta.placement(req.rows)
                if any(w != req.warehouse for w in whs):
                    return m.Moved(self.meta.step, whs)
                self.meta.mark_ready(req.meta, req.rows, -1)
            except DockError as e:
                return m.Refused(str(e))
            self.cond.notify_all()
            return m.Committed()

    def claim(self, req: m.Claim) -> m.Claimed | m.TimedOut:
        deadline = time.monotonic() + req.timeout
        with self.cond:
            while True:
                rows = self.meta.try_claim(req.consumer, req.columns, req.count, req.dp_rank, req.dp_size,
                                           req.whole_groups)
                if rows is not None:
                    self.cond.notify_all()  # a new partition may serve ranks waiting for it
                    return self.meta.where(req.columns, rows)
                left = deadline - time.monotonic()
                if left <= 0:
                    return m.TimedOut(self.meta.diagnose(req.consumer, req.columns, req.count, req.dp_rank,
                                                         req.dp_size))
                self.cond.wait(left)

    def step(self, req: m.CurrentStep | None = None) -> int:
        with self.cond:
            return self.meta.step

    def mark_ready(self, req: m.MarkReady) -> None:
        with self.cond:
            self.meta.mark_ready(req.meta, req.rows, req.rank)
            self.cond.notify_all()   # waiting claims look again

    def drop_rows(self, req: m.DropRows) -> dict:
        with self.cond:
            out = self.meta.drop_rows(req.rows)
            self.cond.notify_all()
            return out

    def cached_on(self, req: m.CachedOn) -> list:
        with self.cond:
            return self.meta.cached_on(req.column, req.rows)

    def all_consumed(self, req: m.AllConsumed) -> bool:
        with self.cond:
            return self.meta.all_consumed(req.consumer)

    def stats(self, req: m.ControllerStats | None = None) -> dict:
        with self.cond:
            return self.meta.stats()


class _Warehouse:
    """The tensors of the rows assigned to this warehouse, behind one lock (a Ray actor runs
    ``max_concurrency`` calls at once, each on its own thread). A write stores the rows, then commits
    them at the controller before answering; rows of another warehouse (the writer's row map was
    stale) are taken back and forwarded there, so a write completes without the writer."""

    MAX_HOPS = 2

    def __init__(self, index: int, head=None, n_warehouses: int = 1, equal_count: bool = True):
        """``head``: the handle of the warehouse that hosts the controller; None: this one does."""
        self.index, self.head = index, head
        self.ctl = _Controller(n_warehouses, equal_count) if head is None else None
        self.store, self.step, self.lock = _ColumnStore(), None, threading.Lock()
        # the channel listener (open_channel); per other warehouse, a ChannelPool to it (connect)
        self._server, self._peers = None, []
        self._handlers = {
            m.Clear: self.clear, m.StartStep: self.start_step, m.Write: self.write, m.Read: self.read,
            m.Apply: self.apply, m.ClaimRead: self.claim_read, m.Drop: self.drop, m.StoreStats: self.store_stats,
        }

    def handle(self, req: m.Request):
        """The one entry point of every dock call, from a channel (``channel.py``) or in process
        (``local.py``): a request of ``messages.py``, dispatched on its type; a controller request
        goes to the controller. The answer is checked against the request's ``ANSWER``."""
        if isinstance(req, m.ControllerRequest):
            return m.checked_answer(req, self._control(req))
        handler = self._handlers.get(type(m.checked_request(req)))
        if handler is None:
            raise DockError(f"warehouse {self.index} takes no {type(req).__name__}")
        return m.checked_answer(req, handler(req))

    def _control(self, req: m.ControllerRequest):
        """The controller: in this process on the head warehouse (no hop), else one call to the
        head over this thread's channel to it."""
        if self.ctl is not None:
            return self.ctl.handle(req)
        return self._ask(0, req).result()

    def _ask(self, w: int, req: m.Request):
        """Send ``req`` to warehouse ``w`` over this thread's channel to it: its ``Reply``."""
        from .channel import Reply
        ch = self._peers[w].get()
        return Reply(ch, ch.send(req))

    def connect(self, addresses: list, keys) -> None:
        """Reach the other warehouses (the head's controller, forwarded writes, drops) over channels
        (``keys``: the dock's client keys, ``channel.DockKeys``): one per thread of this warehouse
        and peer, opened on the thread's first call there. Per thread, because a claim blocks its
        channel until the rows are ready, and the commits that make them ready come from other threads."""
        from .channel import ChannelPool
        self._peers = [None if w == self.index else
                       ChannelPool(a, keys, "the head warehouse" if w == 0 else f"warehouse {w}",
                                   f"warehouse {self.index}")
                       for w, a in enumerate(addresses)]

    def open_channel(self, keys) -> tuple:
        """Listen for channels from clients and the other warehouses (``channel.py``) on this node's
        address, with the dock's ``keys`` (the only process besides the creator to get their server
        secret); answers the address. Each peer is served by a thread of its own through :meth:`handle`."""
        import ray
        from .channel import ChannelServer
        if self._server is None:
            self._server = ChannelServer(self.handle, keys, ray.util.get_node_ip_address())
        return self._server.address

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def clear(self, req: m.Clear) -> None:
        with self.lock:
            self.store.clear()
            self.step = req.step

    def start_step(self, req: m.StartStep) -> m.Allocated | None:
        """The head warehouse's part of a reset in one call: clear this store, then reset the
        controller (allocating ``groups``); the other warehouses are cleared by their own calls."""
        self.clear(m.Clear(req.step))
        return self.ctl.reset(m.Reset(req.step, req.groups, req.warehouse))

    def write(self, req: m.Write) -> m.Stored | m.Moved | m.Refused:
        """Store, then commit at the controller. ``Stored`` when done here, ``Moved`` when the rows
        were forwarded to their warehouses and committed there, or ``Refused`` with nothing kept."""
        rows, packed = req.rows, req.columns
        with self.lock:
            step = self.step
            undo = [u for c, p in packed.items() for u in self.store.write(c, rows, p)]
        res = self._control(m.Commit(step, self.index, req.meta, rows))
        if isinstance(res, m.Committed):
            return m.Stored()
        with self.lock:
            if self.step == step:
                self.store.undo(undo)
        if isinstance(res, m.Refused):
            return res
        if req.hops >= self.MAX_HOPS or not self._peers:
            return m.Refused(f"put: rows {list(rows)[:8]} kept moving between warehouses")
        parts = {w: m.write_part(rows, packed, req.meta, pos, req.hops + 1)
                 for w, pos in positions_by(res.warehouses).items()}
        sent = [self._ask(w, part) for w, part in parts.items() if w != self.index]
        here = [self.write(parts[self.index])] if self.index in parts else []   # its rows that are this one's
        bad = m.first_refused(here + [r.result() for r in sent])
        return bad or m.Moved(res.step, res.warehouses)

    def read(self, req: m.Read) -> dict:
        with self.lock:
            if req.step != self.step:
                raise DockError(f"warehouse {self.index}: read for step {req.step}, dock at step {self.step}")
            return {c: self.store.read(c, req.rows) for c in req.columns}

    def apply(self, req: m.Apply) -> m.Applied:
        """What a client deferred until its next call, in one call and in this order: writes to this
        warehouse (as :meth:`write`), cache marks and dropped rows, the last two for the controller.
        Stops at the first refused write: after it, the held marks and drops are not applied (the
        caller raises it); a failed mark or drop is the answer's ``error``."""
        answers = []
        for write in req.writes:
            answers.append(self.write(write))
            if isinstance(answers[-1], m.Refused):
                return m.Applied(answers)
        try:
            for mark in req.marks:
                self._control(mark)
            # the dropped rows' data: here, and on the other warehouses
            by_wh = self._control(m.DropRows(list(req.drops))) if req.drops else {}
            sent = [self._ask(w, m.Drop(rs)) for w, rs in by_wh.items() if w != self.index]
            if self.index in by_wh:
                self.drop(m.Drop(by_wh[self.index]))
            for r in sent:
                r.result()
        except DockError as e:
            return m.Applied(answers, f"a deferred mark_cached or drop_rows failed: {e}")
        return m.Applied(answers)

    def claim_read(self, req: m.ClaimRead) -> m.ClaimedHere:
        """The caller's deferred writes, marks and drops (see :meth:`apply`), then the controller's
        claim, then this warehouse's share of the claimed rows read here: one client round trip for
        "write my outputs, hand me my next inputs" when the rows live on the caller's node. Without
        a claim when a deferred write failed."""
        c = req.carried
        applied = self.apply(c) if c.writes or c.marks or c.drops else m.Applied([])
        if applied.failure is not None:
            return m.ClaimedHere(applied)
        res = self._control(req.claim)
        if not isinstance(res, m.Claimed):
            return m.ClaimedHere(applied, res)
        mine = res.by_warehouse.get(self.index)
        share = None
        with self.lock:
            if mine and res.columns and res.step == self.step:
                share = {col: self.store.read(col, mine) for col in res.columns}
        return m.ClaimedHere(applied, res, self.index, share)

    def drop(self, req: m.Drop) -> None:
        with self.lock:
            self.store.drop(req.rows)

    def store_stats(self, req: m.StoreStats | None = None, node: bool = True) -> dict:
        """The store's row and byte counts, with this warehouse's index, its open channels to the
        head's controller and (``node``, in an actor) its Ray node id."""
        with self.lock:
            s = self.store.stats()
        s["index"] = self.index
        head = self._peers[0] if self._peers and self.index != 0 else None
        s["head_channels"] = head.opened if head is not None else 0
        if node:
            s["node_id"] = self.node_id()
        return s
