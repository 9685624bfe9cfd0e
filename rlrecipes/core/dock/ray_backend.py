"""The Ray backend's client: the warehouses (``warehouse.py``) run as one threaded actor per node, the
metadata-only controller inside the first node's (so its claims and commits cost no extra hop
there); the client talks to both, and the driver never touches sample data."""
from __future__ import annotations

import time

import numpy as np

from . import messages as m
from .channel import ChannelPool, ChannelTimeout, Reply
from .errors import DockError, DockTimeout, DEFAULT_TIMEOUT_S
from .packing import Packed, concat_packed, positions_by, slice_packed, unpack
from .client import Batch, DockClient, _put_meta, _cached_meta, _empty_batch


def _check_choice(what: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise DockError(f"TransferDock {what} {value!r}: expected one of {', '.join(allowed)}")


def _ray():
    import ray   # not at import: a process that only plans or uses a local dock does not load Ray
    return ray


class RayDock(DockClient):
    """Ray backend client: picklable (actor handles, the warehouses' channel addresses and the
    dock's client keys), used the same way in every actor.

    Every call goes over this thread's channel to a warehouse (``channel.py``), as a typed request
    (``messages.py``). A get is one call to the warehouse of the caller's node, which claims at the
    controller and answers with the rows it holds (other nodes' rows: one more parallel read). Puts
    and cache marks are sent without waiting (a write that reached a stale warehouse is forwarded by
    it) and settled at the client's next blocking call or :meth:`flush`, where a failed write raises.
    Claims wait for readiness at the controller, so a reader never sees uncommitted rows.
    ``round_trips`` / ``wait_s``: the blocking calls and the seconds spent in them (the step's
    ``dock/*`` metrics).
    """

    transport = "direct"   # what workers.json records: channels to the warehouses (the only transport)

    def __init__(self, warehouses: list, node_ids: list[str], placement: str, channels: list, keys):
        self._warehouses = list(warehouses)   # [0] hosts the controller; Ray places and kills them
        self._node_ids = list(node_ids)
        self._placement = placement
        self._addresses = list(channels)      # each warehouse's listening address
        self._keys = keys                     # the dock's client keys
        self._owner = False
        self._init_client()

    def _init_client(self) -> None:
        # Client-side cache of row -> warehouse (from add_groups, get and moved answers), so a
        # put costs one warehouse call. A stale entry is caught by the controller's commit (the
        # write is taken back and redone at the right warehouse). One warehouse: nothing to learn.
        self._wh_of: dict[int, int] = {}
        self._pending: list[tuple] = []     # unsettled writes and marks: (reply, rows of each write or None)
        self._deferred: dict[int, list] = {}  # warehouse -> Writes held for the next call (put(defer=True))
        self._deferred_marks: list = []       # MarkReady held for the next call
        self._deferred_drops: list[int] = []  # dropped rows held for the next call
        self._home: int | None = None       # this process's node's warehouse (resolved lazily)
        self._ahead = None                  # a reset sent ahead (reset_ahead): a copy has none
        # per warehouse, this client's channels to it: one per calling thread (channel.py)
        self._pools = [ChannelPool(a, self._keys, f"warehouse {w}", "a dock client")
                       for w, a in enumerate(self._addresses)]
        self.round_trips = 0
        self.wait_s = 0.0
        self.encrypted = self._keys.encrypted  # CURVE between machines

    _SHARED = ("_warehouses", "_node_ids", "_placement", "_addresses", "_keys")

    def __getstate__(self):
        # The actors and how to reach them; not this client's state (its row map, unsettled writes,
        # open connections). Only the creator kills the actors.
        return {k: self.__dict__[k] for k in self._SHARED} | {"_owner": False}

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._init_client()   # a copy is a new client: its own row map, no unsettled writes

    def _call(self, w: int, request: m.Request) -> Reply:
        """Send ``request`` to warehouse ``w`` over this thread's channel without waiting: its
        :class:`Reply` (:meth:`_wait` takes one or a list)."""
        ch = self._pools[w].get()
        return Reply(ch, ch.send(request))

    @property
    def channels_open(self) -> int:
        """Channels this client has opened to the warehouses (over all its threads)."""
        return sum(p.opened for p in self._pools)

    def _ctl(self, request: m.ControllerRequest) -> Reply:
        """A controller call (the controller lives in the head warehouse's process)."""
        return self._call(0, request)

    def _wait(self, replies, timeout: float | None = None):
        """The answers of one call or a list of calls, counted as one round trip of the caller.
        Raises :class:`ChannelTimeout` after ``timeout`` seconds."""
        t0 = time.perf_counter()
        try:
            if isinstance(replies, list):
                return [r.result(timeout) for r in replies]
            return replies.result(timeout)
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
        return RayDock(self._warehouses, self._node_ids, placement, self._addresses, self._keys)

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
        return [self._call(w, m.Clear(step)) for w in range(1, len(self._warehouses))] + \
            [self._call(0, m.StartStep(step, groups, wh))]

    def _finish_reset(self, started):
        res = self._wait(started)[-1]
        self._wh_of = {}
        if res is None:
            return None
        self._learn(res.rows, res.warehouses)
        return res.rows

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
        res = self._wait(self._ctl(m.AddGroups(n_groups, group_size, wh)))
        self._learn(res.rows, res.warehouses)
        return res.rows

    # -- writes: sent now (or with the next call), settled at the next blocking call ----------------
    def put(self, columns, rows, *, defer=False) -> None:
        rows = [int(r) for r in rows]
        meta, packed = _put_meta(columns, rows, own=False)
        if len(self._warehouses) == 1:
            wh_of = [0] * len(rows)
        else:
            if any(r not in self._wh_of for r in rows):
                self._learn(rows, self._wait(self._ctl(m.Placement(rows))).warehouses)
            wh_of = [self._wh_of[r] for r in rows]
        for w, pos in positions_by(wh_of).items():
            write = m.write_part(rows, packed, meta, pos)
            if defer:
                self._deferred.setdefault(w, []).append(write)
            else:
                self._pending.append((self._call(w, write), [write.rows]))

    def mark_cached(self, columns, rows, rank, *, defer=False) -> None:
        mark = m.MarkReady(_cached_meta(columns, rows), [int(r) for r in rows], int(rank))
        if defer:
            self._deferred_marks.append(mark)
        else:
            self._pending.append((self._ctl(mark), None))

    def _send_deferred(self, carrier: int | None = None) -> m.Apply:
        """Send the held writes, marks and drops, one ``Apply`` per warehouse (marks and drops go
        with the head's, which hosts the controller), except ``carrier``'s: its writes, and the
        marks and drops, are returned as the ``Apply`` the caller's own call to that warehouse
        carries (any warehouse forwards them to the controller)."""
        deferred, self._deferred = self._deferred, {}
        marks, self._deferred_marks = self._deferred_marks, []
        drops, self._deferred_drops = self._deferred_drops, []
        if carrier is not None:
            carried = m.Apply(deferred.pop(carrier, []), marks, drops)
            marks, drops = [], []
        else:
            carried = m.Apply()
            if marks or drops:
                deferred.setdefault(0, [])
        for w, writes in deferred.items():
            apply = m.Apply(writes, marks, drops) if w == 0 else m.Apply(writes)
            self._pending.append((self._call(w, apply), [wr.rows for wr in writes]))
        return carried

    def _settle(self, answer, rows_of) -> None:
        """The answer of a write (``Stored``, ``Moved`` or ``Refused``), of a mark (None) or of an
        ``Apply`` (``rows_of``: the rows of each write it carried); raises the first failure and
        learns where moved rows went."""
        if answer is None:
            return
        if not isinstance(answer, m.Applied):
            answer = m.Applied([answer])
        if answer.failure is None and len(answer.writes) < len(rows_of):
            raise DockError(f"the dock answered {len(answer.writes)} of {len(rows_of)} writes")
        for rows, res in zip(rows_of, answer.writes):
            if isinstance(res, m.Refused):
                raise DockError(res.message)
            if isinstance(res, m.Moved):              # the warehouse forwarded them
                self._learn(rows, res.warehouses)
        if answer.error is not None:                  # a carried mark or drop failed
            raise DockError(answer.error)

    def flush(self) -> None:
        """Wait for this client's writes and cache marks (sending the deferred ones); raise the
        first failure."""
        if self._deferred or self._deferred_marks or self._deferred_drops:
            self._send_deferred()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for (_, rows_of), res in zip(pending, self._wait([reply for reply, _ in pending])):
            self._settle(res, rows_of)

    # -- reads -------------------------------------------------------------------------------------
    def get(self, consumer, columns, count=None, *, dp_rank=0, dp_size=1, whole_groups=False,
            timeout=DEFAULT_TIMEOUT_S, copy=False) -> Batch:
        columns = list(columns)
        home = self._local_warehouse()
        home = 0 if home is None else home
        carried = self._send_deferred(carrier=home)   # the home warehouse's go with the claim
        reply = self._call(home, m.ClaimRead(
            m.Claim(consumer, columns, count, dp_rank, dp_size, whole_groups, float(timeout)), carried))
        self.flush()   # this client's other writes settle while the claim is in flight
        try:
            res = self._wait(reply, timeout=timeout + 60.0)
        except ChannelTimeout:
            raise DockTimeout(consumer, columns, timeout, {
                "step": "?", "total": "?", "live": "?", "taken": "?", "dp_rank": dp_rank,
                "dp_size": dp_size, "wanted": count, "ready": {}, "ready_all": "? (controller unresponsive)"})
        self._settle(res.applied, [w.rows for w in carried.writes])
        claim = res.claim
        if isinstance(claim, m.TimedOut):
            raise DockTimeout(consumer, columns, timeout, claim.diagnostics)
        for w, rs in claim.by_warehouse.items():
            self._learn(rs, [w] * len(rs))
        cols = claim.columns
        if not claim.rows:
            return _empty_batch(claim)
        data = {}
        if cols:
            got = {res.warehouse: res.share} if res.share is not None else {}
            replies = {w: self._call(w, m.Read(claim.step, cols, rs))
                       for w, rs in claim.by_warehouse.items() if w not in got}
            if replies:
                got.update(zip(replies, self._wait(list(replies.values()))))
            parts: dict[str, list[Packed]] = {c: [] for c in cols}
            pos: list[int] = []
            for w, rs in claim.by_warehouse.items():
                pos.extend(rs)
                for c in cols:
                    parts[c].append(got[w][c])
            # Restore the claimed row order (the warehouses answered grouped by warehouse).
            order = np.argsort(np.asarray(pos), kind="stable")
            want = np.searchsorted(np.asarray(pos)[order], np.asarray(claim.rows))
            idx = order[want].tolist()
            for c in cols:
                p = concat_packed(parts[c])
                data[c] = unpack(p if idx == list(range(len(idx))) else slice_packed(p, idx), copy)
        return Batch(list(claim.rows), data, claim.cached, claim.partition, claim.partition_holders)

    def cached_on(self, column, rows):
        self.flush()
        return self._wait(self._ctl(m.CachedOn(column, list(rows))))

    def all_consumed(self, consumer) -> bool:
        self.flush()
        return self._wait(self._ctl(m.AllConsumed(consumer)))

    def drop_rows(self, rows, *, defer=False) -> None:
        if defer:
            self._deferred_drops.extend(int(r) for r in rows)
            return
        self.flush()
        by_wh = self._wait(self._ctl(m.DropRows([int(r) for r in rows])))
        self._wait([self._call(w, m.Drop(rs)) for w, rs in by_wh.items()])

    def stats(self) -> dict:
        self.flush()
        s = self._wait(self._ctl(m.ControllerStats()))
        s["backend"] = "ray"
        s["warehouses"] = self._wait([self._call(w, m.StoreStats()) for w in range(len(self._warehouses))])
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
