"""The dock's bookkeeping and storage, one implementation for every backend: :class:`_Controller`
(``_Meta`` behind one condition variable) and :class:`_Warehouse` (the tensors of its rows behind one
lock, and on the head warehouse the controller): one threaded actor per node (``ray_backend.py``),
or one object in the client's process (``local.py``). A write stores, then commits, undone on refusal.
"""
from __future__ import annotations

import threading
import time

from .errors import DockError, first_error
from .packing import columns_from_wire, columns_to_wire, positions_by, wire_write, _ColumnStore
from .metadata import _Meta


class _Controller:
    """The metadata controller: ``_Meta`` behind one condition variable. It runs in the head
    warehouse's process, called from that actor's threads (a threaded actor: a Ray call to it costs
    about half the latency of an asyncio actor's on a small host); a claim blocks its thread until
    the rows are ready. :meth:`call` runs the other ``_Meta`` methods under the condition."""

    CHANGES = frozenset({"mark_ready", "drop_rows"})               # waiting claims look again
    READS = frozenset({"cached_on", "all_consumed", "stats"})
    OWN = frozenset({"reset", "add_groups", "placement", "commit", "claim", "step"})

    def __init__(self, n_warehouses: int, equal_count: bool):
        self.meta = _Meta(n_warehouses, equal_count)
        self.cond = threading.Condition()

    def call(self, method: str, *args):
        """A controller call by name (clients send names over the wire): one of this class's
        (OWN) or of ``_Meta``'s (CHANGES, READS); anything else raises."""
        if method in self.CHANGES or method in self.READS:
            with self.cond:
                out = getattr(self.meta, method)(*args)
                if method in self.CHANGES:
                    self.cond.notify_all()
                return out
        if method not in self.OWN:
            raise DockError(f"no controller method {method!r}")
        return getattr(self, method)(*args)

    def reset(self, step, groups=None, warehouse=None):
        """Start ``step``; with ``groups=(n_groups, group_size)`` allocate them too (as add_groups)."""
        with self.cond:
            self.meta.reset(step)
            self.cond.notify_all()
            return self._add(*groups, warehouse) if groups is not None else None

    def add_groups(self, n_groups, group_size, warehouse=None):
        with self.cond:
            self.cond.notify_all()
            return self._add(n_groups, group_size, warehouse)

    def _add(self, n_groups, group_size, warehouse):
        rows = self.meta.add_groups(n_groups, group_size, warehouse)
        return self.meta.step, rows, self.meta.warehouse[rows].tolist() if rows else []

    def placement(self, rows):
        with self.cond:
            return self.meta.step, self.meta.placement(rows)

    def commit(self, step, warehouse, meta, rows):
        """A warehouse stored ``rows``: mark them ready. Called by the warehouse (not the client)
        after the data is in place, so a reader that claims the rows finds them. Returns None,
        ``("misplaced", step, warehouses)`` when the writer's row -> warehouse map was stale, or
        ``("error", message)``; the warehouse then takes the write back."""
        with self.cond:
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
            self.cond.notify_all()
            return None

    def claim(self, consumer, columns, count, dp_rank, dp_size, whole_groups, timeout):
        """("ok", rows, cached, stored) or ("timeout", diagnostics)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                rows = self.meta.try_claim(consumer, columns, count, dp_rank, dp_size, whole_groups)
                if rows is not None:
                    self.cond.notify_all()  # a new partition may serve ranks waiting for it
                    cached, stored = self.meta.where(columns, rows)
                    stored["step"] = self.meta.step
                    return ("ok", rows, cached, stored)
                left = deadline - time.monotonic()
                if left <= 0:
                    return ("timeout", self.meta.diagnose(consumer, columns, count, dp_rank, dp_size))
                self.cond.wait(left)

    def step(self):
        with self.cond:
            return self.meta.step


class _Warehouse:
    """The tensors of the rows assigned to this warehouse, behind one lock (a Ray actor runs
    ``max_concurrency`` calls at once, each on its own thread). A write stores the rows, then commits
    them at the controller before answering; rows of another warehouse (the writer's row map was
    stale) are taken back and forwarded there, so a write completes without the writer."""

    MAX_HOPS = 2
    CALLS = frozenset({"control", "clear", "start_step", "write", "read", "apply", "claim_read", "drop"})
    _WRITES_AT = {"apply": 0, "claim_read": 7}   # the position of the ``writes`` argument

    def __init__(self, index: int, head=None, n_warehouses: int = 1, equal_count: bool = True):
        """``head``: the handle of the warehouse that hosts the controller; None: this one does."""
        self.index, self.head, self.peers = index, head, []
        self.ctl = _Controller(n_warehouses, equal_count) if head is None else None
        self.store, self.step, self.lock = _ColumnStore(), None, threading.Lock()
        # the direct-channel listener (open_channel); the ChannelPool to the head's (connect_head)
        self._server = self._head = None

    def call(self, request: tuple):
        """The one entry point of a channel or Ray call: ``request = (method, args)`` (one Ray argument:
        Ray serializes each of an actor call's arguments as an object of its own, about 20 us each).
        Column data travels in the wire format of ``packing.to_wire`` both ways."""
        method, args = request
        if method not in self.CALLS:
            raise DockError(f"warehouse {self.index}: no method {method!r} to call")
        if method == "write":
            args = (args[0], columns_from_wire(args[1]), *args[2:])
        elif method in self._WRITES_AT:   # a list of (rows, columns, meta) writes
            k = self._WRITES_AT[method]
            args = (*args[:k], [(r, columns_from_wire(w), m) for r, w, m in args[k]], *args[k + 1:])
        out = getattr(self, method)(*args)
        if method == "read":
            return columns_to_wire(out)
        if method == "claim_read" and out[0] == "ok" and out[5] is not None:   # ("ok", ..., data, answers)
            return (*out[:5], columns_to_wire(out[5]), out[6])
        return out

    def control(self, method: str, *args):
        """A controller call from a client or another warehouse (head warehouse only)."""
        if self.ctl is None:
            raise DockError(f"warehouse {self.index}: no controller here")
        return self.ctl.call(method, *args)

    def _control(self, method: str, *args):
        """The controller: in this process on the head warehouse (no hop), else one call to the
        head -- over this thread's direct channel when the dock has them, else a Ray call."""
        if self.ctl is not None:
            return self.ctl.call(method, *args)
        ch = self._head.get() if self._head is not None else None
        if ch is not None:
            return ch.result(ch.send(("control", (method, *args))))
        import ray
        return ray.get(self.head.call.remote(("control", (method, *args))))

    def connect_head(self, address: tuple, keys) -> None:
        """Call the head's controller over direct channels (non-head warehouses): one channel per
        thread of this warehouse, opened on its first controller call. Per thread, because a claim
        blocks its channel until the rows are ready, and the commits that make them ready come from
        other threads. ``keys``: the dock's client keys (``channel.DockKeys``)."""
        from .channel import ChannelPool
        self._head = ChannelPool(address, keys, "the head warehouse", f"warehouse {self.index}'s controller calls")

    def open_channel(self, keys) -> tuple:
        """Listen for direct channels from clients (``channel.py``) on this node's address, with the
        dock's ``keys`` (the only process besides the creator to get their server secret); answers
        the address. Each peer is served by a thread of its own through :meth:`call`."""
        import ray
        from .channel import ChannelServer
        if self._server is None:
            self._server = ChannelServer(self.call, keys, ray.util.get_node_ip_address())
        return self._server.address

    def set_peers(self, warehouses: list) -> None:
        self.peers = list(warehouses)

    def node_id(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def clear(self, step):
        with self.lock:
            self.store.clear()
            self.step = step

    def start_step(self, step, groups=None, warehouse=None):
        """The head warehouse's part of a reset in one call: clear this store, then reset the
        controller (allocating ``groups``); the other warehouses are cleared by their own calls."""
        self.clear(step)
        return self.ctl.reset(step, groups, warehouse)

    def write(self, rows, packed: dict, meta: dict, hops: int = 0):
        """Store, then commit at the controller. Answers None when done here, ``("moved", step,
        warehouses)`` when the rows were forwarded to their warehouses and committed there, or
        ``("error", message)`` with nothing kept."""
        with self.lock:
            step = self.step
            undo = [u for c, p in packed.items() for u in self.store.write(c, rows, p)]
        res = self._control("commit", step, self.index, meta, rows)
        if res is None:
            return None
        with self.lock:
            if self.step == step:
                self.store.undo(undo)
        if res[0] != "misplaced":
            return res
        whs = res[2]
        if hops >= self.MAX_HOPS or not self.peers:
            return ("error", f"put: rows {list(rows)[:8]} kept moving between warehouses")
        import ray
        answers = ray.get([self.peers[w].call.remote(("write", (*wire_write(rows, packed, meta, pos), hops + 1)))
                           for w, pos in positions_by(whs).items()])
        bad = first_error(answers)
        return bad or ("moved", res[1], whs)

    def read(self, step, columns, rows) -> dict:
        with self.lock:
            if step != self.step:
                raise DockError(f"warehouse {self.index}: read for step {step}, dock at step {self.step}")
            return {c: self.store.read(c, rows) for c in columns}

    def apply(self, writes=(), marks=(), drops=()):
        """What a client deferred until its next call, in one call and in this order: writes to this
        warehouse (``(rows, packed, meta)`` each, as :meth:`write`), cache marks (``(meta, rows,
        rank)`` each) and dropped rows (one list), the last two for the controller. Answers one
        entry per write: None, ``("moved", ...)`` or ``("error", message)``. It stops at the first
        error: after a failed write, the held marks and drops are not applied (the caller raises
        it); a failed mark or drop adds an ``("error", message)`` after the writes'."""
        answers = []
        for rows, packed, meta in writes:
            answers.append(self.write(rows, packed, meta))
            if first_error(answers[-1:]):
                return answers
        try:
            for mark in marks:
                self._control("mark_ready", *mark)
            # the dropped rows' data: here, and on the other warehouses
            for w, rs in (self._control("drop_rows", list(drops)) if drops else {}).items():
                if w == self.index:
                    self.drop(rs)
                else:
                    self.peers[w].call.remote(("drop", (rs,)))
        except DockError as e:
            answers.append(("error", f"a deferred mark_cached or drop_rows failed: {e}"))
        return answers

    def claim_read(self, consumer, columns, count, dp_rank, dp_size, whole_groups, timeout,
                   writes=(), marks=(), drops=()):
        """The caller's deferred ``writes``, ``marks`` and ``drops`` (see :meth:`apply`), then the controller's
        claim, then this warehouse's share of the claimed rows read here: one client round trip for
        "write my outputs, hand me my next inputs" when the rows live on the caller's node. Answers
        ``("ok", rows, cached, stored, index, data, answers)``, ``("timeout", diagnostics, answers)``
        or, when a deferred write failed, ``("error", message, answers)`` without claiming."""
        answers = self.apply(writes, marks, drops) if writes or marks or drops else []
        bad = first_error(answers)
        if bad is not None:
            return ("error", bad[1], answers)
        res = self._control("claim", consumer, columns, count, dp_rank, dp_size, whole_groups, timeout)
        if res[0] != "ok":
            return (*res, answers)
        _, rows, cached, stored = res
        mine = stored["by_warehouse"].get(self.index)
        data = None
        with self.lock:
            if mine and stored["columns"] and stored["step"] == self.step:
                data = {c: self.store.read(c, mine) for c in stored["columns"]}
        return ("ok", rows, cached, stored, self.index, data, answers)

    def drop(self, rows):
        with self.lock:
            self.store.drop(rows)

    def store_stats(self, node: bool = False):
        """The store's row and byte counts; ``node``: with the Ray node id (in an actor)."""
        with self.lock:
            s = self.store.stats()
        s["index"] = self.index
        s["head_channels"] = self._head.opened if self._head is not None else 0   # to the head's controller
        if node:
            s["node_id"] = self.node_id()
        return s
