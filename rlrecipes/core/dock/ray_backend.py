"""The Ray backend's client: the warehouses (``warehouse.py``) run as one threaded actor per node, the
metadata-only controller inside the first node's (so its claims and commits cost no extra hop
there); the client talks to both, and the driver never touches sample data."""
from __future__ import annotations

import itertools
import time

import numpy as np

from .channel import ChannelPool, ChannelTimeout, Reply

from .errors import DockError, DockTimeout, DEFAULT_TIMEOUT_S, first_error
from .packing import Packed, columns_from_wire, concat_packed, positions_by, slice_packed, unpack, wire_write
from .client import Batch, DockClient, _put_meta, _cached_meta, _empty_batch


def _check_choice(what: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise DockError(f"TransferDock {what} {value!r}: expected one of {', '.join(allowed)}")


def _ray():
    import ray   # not at import: a process that only plans or uses a local dock does not load Ray
    return ray


class RayDock(DockClient):
    """Ray backend client: picklable (actor handles + config), used the same way in every actor.

    A get is one call to the warehouse of the caller's node, which claims at the controller and
    answers with the rows it holds (other nodes' rows: one more parallel read). Puts and cache
    marks are sent without waiting (a write that reached a stale warehouse is forwarded by it) and
    settled at the client's next blocking call or :meth:`flush`, where a failed write raises. Claims
    wait for readiness at the controller, so a reader never sees uncommitted rows. ``round_trips``
    / ``wait_s``: the blocking calls and the seconds spent in them (the step's ``dock/*`` metrics).
    """

    def __init__(self, warehouses: list, node_ids: list[str], placement: str,
                 channels: list | None = None, keys=None, direct: bool = True):
        self._warehouses = list(warehouses)   # [0] hosts the controller
        self._node_ids = list(node_ids)
        self._placement = placement
        # Direct channels (``channel.py``): each warehouse's listening address and the dock's client
        # keys (None: the warehouses do not listen); ``direct=False``: this client makes Ray calls.
        self._addresses = list(channels) if channels is not None else None
        self._keys = keys
        self._direct = direct and channels is not None
        self._owner = False
        self._init_client()

    def _init_client(self) -> None:
        # Client-side cache of row -> warehouse (from add_groups, get and misplaced answers), so a
        # put costs one warehouse call. A stale entry is caught by the controller's commit (the
        # write is taken back and redone at the right warehouse). One warehouse: nothing to learn.
        self._wh_of: dict[int, int] = {}
        self._pending: list[tuple] = []     # unsettled writes: (kind, ref, payload)
        self._deferred: dict[int, list] = {}  # warehouse -> writes held for the next call (put(defer=True))
        self._deferred_marks: list = []       # cache marks held for the next call
        self._deferred_drops: list[int] = []  # dropped rows held for the next call
        self._home: int | None = None       # this process's node's warehouse (resolved lazily)
        self._ahead = None                  # a reset sent ahead (reset_ahead): a copy has none
        # per warehouse, this client's direct channels to it: one per calling thread (channel.py)
        self._pools = [ChannelPool(a, self._keys, f"warehouse {w}", "its calls")
                       for w, a in enumerate(self._addresses)] if self._direct else None
        self.round_trips = 0
        self.wait_s = 0.0
        self.transport = "direct" if self._direct else "ray"   # channels to the warehouses, or Ray calls
        self.encrypted = self._direct and self._keys.encrypted  # CURVE between machines

    _SHARED = ("_warehouses", "_node_ids", "_placement", "_addresses", "_keys", "_direct")

    def __getstate__(self):
        # The actors and how to reach them; not this client's state (its row map, unsettled writes,
        # open connections). Only the creator kills the actors.
        return {k: self.__dict__[k] for k in self._SHARED} | {"_owner": False}

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._init_client()   # a copy is a new client: its own row map, no unsettled writes

    def _call(self, w: int, method: str, *args):
        """Warehouse ``w``'s ``method`` (see ``_Warehouse.call``), sent without waiting: over the
        direct channel when there is one (a :class:`Reply`), else one Ray call with one argument
        (an ``ObjectRef``). :meth:`_wait` takes either."""
        ch = self._pools[w].get() if self._direct else None    # this thread's channel (ChannelPool)
        if ch is not None:
            return Reply(ch, ch.send((method, args)))
        return self._warehouses[w].call.remote((method, args))

    @property
    def channels_open(self) -> int:
        """Direct channels this client has opened to the warehouses (over all its threads)."""
        return sum(p.opened for p in self._pools) if self._direct else 0

    def with_transport(self, transport: str) -> "RayDock":
        """A client on the same actors that calls them over ``direct`` channels or ``ray`` calls."""
        _check_choice("transport", transport, ("direct", "ray"))
        if transport == "direct" and self._addresses is None:
            raise DockError("transport 'direct': this dock's warehouses do not listen for channels "
                            "(it was started with TransferDock.ray(transport='ray'))")
        return RayDock(self._warehouses, self._node_ids, self._placement, self._addresses, self._keys,
                       direct=transport == "direct")

    def _ctl(self, method: str, *args):
        """A controller call (the controller lives in the head warehouse's process)."""
        return self._call(0, "control", method, *args)

    def _wait(self, refs, timeout: float | None = None):
        """The answers of one call or a list of calls (channel replies and Ray refs alike), counted
        as one round trip of the caller. Raises :class:`ChannelTimeout` or Ray's GetTimeoutError
        after ``timeout`` seconds."""
        t0 = time.perf_counter()
        try:
            if not isinstance(refs, list):
                return refs.result(timeout) if isinstance(refs, Reply) else _ray().get(refs, timeout=timeout)
            ray_refs = [r for r in refs if not isinstance(r, Reply)]
            got = iter(_ray().get(ray_refs, timeout=timeout) if ray_refs else ())
            return [r.result(timeout) if isinstance(r, Reply) else next(got) for r in refs]
        finally:
            self.round_trips += 1
            self.wait_s += time.perf_counter() - t0

    def _learn(self, rows, whs) -> None:
        if len(self._warehouses) > 1:
            self._wh_of.update(zip(rows, whs))

    def with_placement(self, placement: str) -> "RayDock":
        """A client on the same actors that allocates rows with another policy
        (``round_robin`` or ``writer_node``)."""
        _check_choice("placement", placement, ("round_robin", "writer_node"))
        return RayDock(self._warehouses, self._node_ids, placement, self._addresses, self._keys, self._direct)

    @property
    def warehouse_nodes(self) -> list[str]:
        """Node id of each warehouse (index = warehouse number)."""
        return list(self._node_ids)

    def _start_reset(self, step, groups):
        self._deferred_drops = []   # moot: the new step has none of those rows
        self.flush()
        wh = self._local_warehouse() if groups is not None and self._placement == "writer_node" else None
        # The other warehouses in parallel with the head's call (its store and the controller):
        # one round trip of latency, the groups included.
        return [self._call(w, "clear", step) for w in range(1, len(self._warehouses))] + \
            [self._call(0, "start_step", step, groups, wh)]

    def _finish_reset(self, started):
        *_, res = self._wait(started)
        self._wh_of = {}
        if res is None:
            return None
        _, rows, whs = res
        self._learn(rows, whs)
        return rows

    def _local_warehouse(self) -> int | None:
        if self._home is None:
            try:
                node = _ray().get_runtime_context().get_node_id()
            except Exception:
                node = None
            self._home = self._node_ids.index(node) if node in self._node_ids else -1
        return self._home if self._home >= 0 else None

    def add_groups(self, n_groups: int, group_size: int) -> list[int]:
        wh = self._local_warehouse() if self._placement == "writer_node" else None
        step, rows, whs = self._wait(self._ctl("add_groups", n_groups, group_size, wh))
        self._learn(rows, whs)
        return rows

    # -- writes: sent now (or with the next call), settled at the next blocking call ----------------
    def put(self, columns, rows, *, defer=False) -> None:
        rows = [int(r) for r in rows]
        meta, packed = _put_meta(columns, rows, own=False)
        if len(self._warehouses) == 1:
            wh_of = [0] * len(rows)
        else:
            if any(r not in self._wh_of for r in rows):
                _, whs = self._wait(self._ctl("placement", rows))
                self._learn(rows, whs)
            wh_of = [self._wh_of[r] for r in rows]
        for w, pos in positions_by(wh_of).items():
            write = wire_write(rows, packed, meta, pos)
            if defer:
                self._deferred.setdefault(w, []).append(write)
            else:
                self._pending.append(("put", self._call(w, "write", *write), write[0]))

    def mark_cached(self, columns, rows, rank, *, defer=False) -> None:
        mark = (_cached_meta(columns, rows), [int(r) for r in rows], int(rank))
        if defer:
            self._deferred_marks.append(mark)
        else:
            self._pending.append(("mark", self._ctl("mark_ready", *mark), None))

    def _send_deferred(self, carrier: int | None = None) -> tuple[list, list, list]:
        """Send the held writes, marks and drops, one ``apply`` call per warehouse (marks and drops
        go with the head's, which hosts the controller), except ``carrier``'s: its writes, and the
        marks and drops, are returned for the caller's own call to that warehouse to carry (any
        warehouse forwards them to the controller)."""
        deferred, self._deferred = self._deferred, {}
        marks, self._deferred_marks = self._deferred_marks, []
        drops, self._deferred_drops = self._deferred_drops, []
        if carrier is not None:
            carried = (deferred.pop(carrier, []), marks, drops)
            marks, drops = [], []
        else:
            carried = ([], [], [])
            if marks or drops:
                deferred.setdefault(0, [])
        for w, writes in deferred.items():
            ms, ds = (marks, drops) if w == 0 else ([], [])
            rows_of = [wr[0] for wr in writes]
            self._pending.append(("apply", self._call(w, "apply", writes, ms, ds), rows_of))
        return carried

    def _settle(self, answers, rows_of) -> None:
        """Answers of writes (None, ``("moved", step, warehouses)`` or ``("error", message)``); a
        failed mark or drop answers after its call's writes, and an error ends the answers early."""
        if len(answers) < len(rows_of) and first_error(answers) is None:
            raise DockError(f"the dock answered {len(answers)} of {len(rows_of)} writes")
        for rows, res in itertools.zip_longest(rows_of, answers):
            if res is None:
                continue
            if res[0] == "error":
                raise DockError(res[1])
            self._learn(rows, res[2])                  # "moved": the warehouse forwarded them

    def flush(self) -> None:
        """Wait for this client's writes and cache marks (sending the deferred ones); raise the
        first failure."""
        if self._deferred or self._deferred_marks or self._deferred_drops:
            self._send_deferred()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for (kind, _, rows), res in zip(pending, self._wait([ref for _, ref, _ in pending])):
            if kind == "apply":             # one answer per write it carried
                self._settle(res, rows)
            else:
                self._settle([res], [rows])

    # -- reads -------------------------------------------------------------------------------------
    def get(self, consumer, columns, count=None, *, dp_rank=0, dp_size=1, whole_groups=False,
            timeout=DEFAULT_TIMEOUT_S, copy=False) -> Batch:
        ray = _ray()
        columns = list(columns)
        home = self._local_warehouse()
        home = 0 if home is None else home
        writes, marks, drops = self._send_deferred(carrier=home)   # the home warehouse's go with the claim
        ref = self._call(home, "claim_read", consumer, columns, count, dp_rank, dp_size, whole_groups,
                         float(timeout), writes, marks, drops)
        self.flush()   # this client's other writes settle while the claim is in flight
        try:
            res = self._wait(ref, timeout=timeout + 60.0)
        except (ray.exceptions.GetTimeoutError, ChannelTimeout):
            raise DockTimeout(consumer, columns, timeout, {
                "step": "?", "total": "?", "live": "?", "taken": "?", "dp_rank": dp_rank,
                "dp_size": dp_size, "wanted": count, "ready": {}, "ready_all": "? (controller unresponsive)"})
        self._settle(res[-1], [w[0] for w in writes])
        if res[0] == "timeout":
            raise DockTimeout(consumer, columns, timeout, res[1])
        _, rows, cached, stored, read_at, local_data, _ = res
        step = stored["step"]
        for w, rs in stored["by_warehouse"].items():
            self._learn(rs, [w] * len(rs))
        cols = stored["columns"]
        if not rows:
            return _empty_batch(stored, cached)
        data = {}
        if cols:
            got = {read_at: columns_from_wire(local_data)} if local_data is not None else {}
            refs = {w: self._call(w, "read", step, cols, rs)
                    for w, rs in stored["by_warehouse"].items() if w not in got}
            if refs:
                got.update(zip(refs, map(columns_from_wire, self._wait(list(refs.values())))))
            parts: dict[str, list[Packed]] = {c: [] for c in cols}
            pos: list[int] = []
            for w, rs in stored["by_warehouse"].items():
                pos.extend(rs)
                for c in cols:
                    parts[c].append(got[w][c])
            # Restore the claimed row order (the warehouses answered grouped by warehouse).
            order = np.argsort(np.asarray(pos), kind="stable")
            want = np.searchsorted(np.asarray(pos)[order], np.asarray(rows))
            idx = order[want].tolist()
            for c in cols:
                p = concat_packed(parts[c])
                data[c] = unpack(p if idx == list(range(len(idx))) else slice_packed(p, idx), copy)
        return Batch(list(rows), data, cached, stored["partition"], stored["partition_holders"])

    def cached_on(self, column, rows):
        self.flush()
        return self._wait(self._ctl("cached_on", column, list(rows)))

    def all_consumed(self, consumer) -> bool:
        self.flush()
        return self._wait(self._ctl("all_consumed", consumer))

    def drop_rows(self, rows, *, defer=False) -> None:
        if defer:
            self._deferred_drops.extend(int(r) for r in rows)
            return
        self.flush()
        by_wh = self._wait(self._ctl("drop_rows", [int(r) for r in rows]))
        self._wait([self._call(w, "drop", rs) for w, rs in by_wh.items()])

    def stats(self) -> dict:
        self.flush()
        s = self._wait(self._ctl("stats", ))
        s["backend"] = "ray"
        s["warehouses"] = self._wait([w.store_stats.remote(True) for w in self._warehouses])
        return s

    def shutdown(self) -> None:
        """Kill the warehouses and with them the controller (only from the client that created them)."""
        if not self._owner:
            return
        ray = _ray()
        for a in self._warehouses:
            try:
                ray.kill(a)
            except Exception:
                pass
        self._owner = False
