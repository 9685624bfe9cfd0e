"""TransferDock, Ray backend on a 3-node Ray cluster simulated on one machine
(``ray.cluster_utils.Cluster``, 1 CPU per node): semantics, warehouse placement, large reads,
concurrent writer / reader actors on different nodes.

One cluster and one dock per module: actor start-up costs seconds on a busy 2-core machine."""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import pickle
import socket
import threading
import time

import pytest
import torch

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from rlrecipes.core.dock import DockError, DockTimeout, RayDock, TransferDock  # noqa: E402

pytestmark = pytest.mark.dist


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
_steps = itertools.count(100)


@pytest.fixture(scope="module")
def shared_dock():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node0": 1},
                                                       "include_dashboard": False})
    try:
        c.add_node(num_cpus=1, resources={"node1": 1})
        c.add_node(num_cpus=1, resources={"node2": 1})
        c.wait_for_nodes()
        # Workers import this module (actor classes below) and rlrecipes from the checkout.
        ray.init(address=c.address, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([ROOT, HERE])}})
        d = TransferDock.ray()
        yield d
        d.shutdown()
    finally:
        ray.shutdown()
        c.shutdown()


def _node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


@pytest.fixture
def dock(shared_dock):
    shared_dock.reset(next(_steps))
    return shared_dock


def ids(row: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64) + 1000 * row  # [n]


def test_ray_semantics_match_local(dock):
    rows = dock.add_groups(4, 2)
    lens = [10, 10, 1, 1, 5, 5, 6, 4]
    dock.put({"ids": [ids(r, n) for r, n in zip(rows, lens)]}, rows)
    dock.put({"s": torch.arange(8.)}, rows)
    bins = [dock.get("adv", ["ids", "s"], None, dp_rank=r, dp_size=2, whole_groups=True, timeout=5)
            for r in (1, 0)]
    assert sorted(bins[0].rows + bins[1].rows) == rows
    for b in bins:
        assert all((x ^ 1) in b.rows for x in b.rows)
        assert b["s"].tolist() == [float(x) for x in b.rows]
        for r, t in zip(b.rows, b["ids"]):
            assert torch.equal(t, ids(r, lens[r]))
    # the same partition as the local backend computes
    loc = TransferDock.local()
    loc.add_groups(4, 2)
    loc.put({"ids": [ids(r, n) for r, n in zip(rows, lens)], "s": torch.arange(8.)}, rows)
    assert loc.get("adv", ["ids", "s"], None, dp_rank=1, dp_size=2, whole_groups=True).rows == bins[0].rows
    assert dock.all_consumed("adv")
    dock.drop_rows([0, 1])
    st = dock.stats()
    assert st["live_rows"] == 6 and sum(w["columns"]["ids"] for w in st["warehouses"]) == 6


def test_ray_timeout_names_consumer_columns_and_counts(dock):
    rows = dock.add_groups(1, 3)
    dock.put({"a": torch.ones(2)}, rows[:2])
    with pytest.raises(DockTimeout) as e:
        dock.get("ref", ["a"], 3, timeout=0.3)
    msg = str(e.value)
    assert "'ref'" in msg and "['a']" in msg and "2 rows ready" in msg and "3 live rows" in msg
    with pytest.raises(DockError, match="never allocated"):
        dock.put({"a": torch.ones(1)}, [9])


def test_ray_reset_and_mark_cached(dock):
    dock.add_groups(1, 2)
    dock.reset(5)
    rows = dock.add_groups(1, 2)
    assert rows == [0, 1] and dock.stats()["step"] == 5 and dock.stats()["rows"] == 2
    dock.mark_cached({"logp": [3, 4]}, rows, rank=2)
    assert dock.cached_on("logp", rows) == [2, 2]
    b = dock.get("u", ["logp"], None, timeout=5)
    assert b.holders == {"logp": [2, 2]} and b.columns == {}


def test_rejected_put_keeps_data_and_a_stale_row_map_is_corrected(dock):
    rows = dock.add_groups(3, 2)                      # round robin: one group per warehouse
    dock.put({"a": torch.arange(6.)}, rows)
    dock.put({"a": [torch.ones(2)] * 6}, rows)        # sent without waiting ...
    with pytest.raises(DockError, match="already has it"):
        dock.flush()                                  # ... rejected by the controller: taken back
    # a client whose cached row -> warehouse map is wrong: the commit says "misplaced", the
    # write is taken back and redone at the right warehouses
    d2 = pickle.loads(pickle.dumps(dock))
    d2._wh_of = {r: 0 for r in rows}
    d2.put({"b": torch.arange(6.) * 2}, rows)
    b = dock.get("x", ["a", "b"], None, timeout=5)
    assert b["a"].tolist() == list(range(6)) and b["b"].tolist() == [2.0 * i for i in range(6)]
    assert [w["columns"]["b"] for w in dock.stats()["warehouses"]] == [2, 2, 2]
    assert [w["columns"]["a"] for w in dock.stats()["warehouses"]] == [2, 2, 2]


def test_a_get_is_one_round_trip_and_a_put_none(dock):
    dock = dock.with_placement("writer_node")         # every row on the caller's node
    rows = dock.add_groups(2, 2)
    n = dock.round_trips
    dock.put({"a": torch.arange(4.)}, rows)
    dock.mark_cached({"logp": [1, 1, 1, 1]}, rows, rank=0)
    assert dock.round_trips == n                      # nothing waited for yet
    dock.flush()
    n = dock.round_trips
    b = dock.get("c", ["a", "logp"], None, timeout=5)
    assert dock.round_trips == n + 1 and b["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and b.holders["logp"] == [0] * 4
    # a new step and its first groups: one round trip
    n = dock.round_trips
    rows = dock.reset(1, groups=(2, 2))
    assert dock.round_trips == n + 1 and rows == [0, 1, 2, 3] and dock.stats()["step"] == 1
    # a reader that claims right after an unsettled put still sees the rows (claims wait for commits)
    dock.put({"s": torch.ones(4)}, rows)
    assert dock.get("d", ["s"], None, timeout=5)["s"].tolist() == [1.0] * 4
    # a reset sent ahead is answered while the caller works; the matching reset only collects it
    dock.flush()
    dock.reset_ahead(2, groups=(1, 2))
    n = dock.round_trips
    assert dock.reset(2, groups=(1, 2)) == [0, 1] and dock.round_trips == n + 1 and dock.stats()["step"] == 2
    dock.reset_ahead(3, groups=(1, 2))
    assert dock.reset(4, groups=(2, 2)) == [0, 1, 2, 3] and dock.stats()["step"] == 4  # not the one sent


def test_deferred_writes_and_marks_ride_on_the_next_call(dock):
    # on the caller's node: "write my outputs, hand me my next inputs" is one round trip
    home = dock.with_placement("writer_node")
    rows = home.add_groups(2, 2)
    n = home.round_trips
    home.put({"a": torch.arange(4.)}, rows, defer=True)
    home.mark_cached({"logp": [2, 2, 2, 2]}, rows, rank=1, defer=True)
    other = pickle.loads(pickle.dumps(dock))                       # another client: its stats
    assert home.round_trips == n and other.stats()["ready"] == {}  # do not flush home's writes
    b = home.get("c", ["a", "logp"], None, timeout=5)
    assert home.round_trips == n + 1
    assert b["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and b.holders["logp"] == [1] * 4
    # rows on every node: the other warehouses' writes go out as one call each, before the claim
    rows = dock.reset(next(_steps), groups=(3, 2))
    dock.put({"b": torch.arange(4.)}, rows[:4], defer=True)
    dock.put({"b": torch.arange(4., 6.)}, rows[4:], defer=True)
    assert dock.get("c", ["b"], None, timeout=5)["b"].tolist() == list(range(6))
    # a refused deferred write raises at the call that carried it, and nothing is claimed
    dock.put({"b": [torch.ones(1)] * 6}, rows, defer=True)      # a list column: "b" is stacked
    with pytest.raises(DockError, match="already has it"):
        dock.get("d", ["b"], None, timeout=5)
    assert dock.get("d", ["b"], None, timeout=5)["b"].tolist() == list(range(6))
    # flush sends what was held
    dock.put({"e": torch.ones(6)}, rows, defer=True)
    dock.flush()
    assert dock.stats()["ready"]["e"] == 6
    # a refused deferred mark raises at the call that carried it, named as a deferred one
    dock.mark_cached({"z": None}, [10_000], rank=0, defer=True)
    with pytest.raises(DockError, match="a deferred mark_cached or drop_rows failed: .*never allocated"):
        dock.flush()
    # a held drop: another client's claim waits for it (the dropped rows are never written), and
    # the dropping client's next call carries it
    rows = dock.reset(next(_steps), groups=(3, 2))
    dock.put({"f": torch.ones(4)}, rows[:4])
    dock.drop_rows(rows[4:], defer=True)
    other = pickle.loads(pickle.dumps(dock))
    with pytest.raises(DockTimeout):
        other.get("g", ["f"], None, timeout=0.5)
    assert dock.get("h", ["f"], None, timeout=5).rows == rows[:4]       # carries the drop
    assert other.get("g", ["f"], None, timeout=5).rows == rows[:4]
    assert dock.stats()["dropped_rows"] == 2
    # a reset discards held drops: the new step's rows are all live
    dock.drop_rows([0, 1], defer=True)
    rows = dock.reset(next(_steps), groups=(1, 2))
    dock.flush()
    assert dock.stats()["dropped_rows"] == 0


def test_large_reads_over_the_channel_arrive_intact_and_copy_gives_memory_of_its_own(dock):
    # A column of a batch read from one warehouse wraps the frame it arrived in (channel.py; the
    # frame-wrapping itself: tests/unit/test_dock_channel.py); copy=True gives a tensor of its own.
    dock = dock.with_placement("writer_node")
    rows = dock.reset(next(_steps), groups=(8, 4))
    x = torch.randn(32, 16384)  # [rows, L] 2 MiB: out of band
    dock.put({"x": x}, rows)
    b = dock.get("c", ["x"], None, timeout=10)
    assert torch.equal(b["x"], x)
    c = dock.get("d", ["x"], None, timeout=10, copy=True)
    assert torch.equal(c["x"], x) and c["x"].data_ptr() != b["x"].data_ptr()
    c["x"].add_(1)                                   # its own memory: writable, the other batch unchanged
    assert torch.equal(b["x"], x)


def test_every_call_goes_over_channels_and_a_client_that_cannot_open_one_is_told_what_to_open(dock):
    assert dock.transport == "direct" and not hasattr(dock, "with_transport")
    rows = dock.reset(next(_steps), groups=(3, 2))
    dock.put({"a": torch.arange(6.)}, rows)
    assert dock.get("c", ["a"], None, timeout=5)["a"].tolist() == list(range(6))
    stats = dock.stats()                                  # the warehouses' stats come over channels too
    assert dock.channels_open >= 3 and [w["index"] for w in stats["warehouses"]] == [0, 1, 2]
    # A client that cannot reach the warehouses' listeners (nothing listens on that port): the
    # call fails at once, naming the warehouse, its address and what to open; no Ray-call fallback.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    cut = RayDock(dock._warehouses, dock._node_ids, "round_robin",
                  [("127.0.0.1", dead)] * len(dock._warehouses), dock._keys)
    with pytest.raises(DockError, match=f"a dock client cannot open a channel to warehouse 0 at 127.0.0.1:{dead}"
                                        ".*allow TCP between the cluster's nodes"):
        cut.put({"a": torch.arange(6.)}, rows)
    assert cut.channels_open == 0


def test_threads_sharing_a_client_do_not_queue_behind_each_others_claims(dock):
    # A claim holds its connection until its rows are ready. Two threads of one client each get a
    # channel of their own, so the write that a waiting claim needs is not queued behind the claim
    # on the same connection (it would wait there until the claim timed out).
    d = dock.with_placement("writer_node")    # the rows go to this node's warehouse, where the claim waits
    d.reset(next(_steps))
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        claim = ex.submit(d.get, "c", ["a"], 2, timeout=20)
        time.sleep(0.5)                        # the claim is waiting at the warehouse
        rows = d.add_groups(1, 2)
        d.put({"a": torch.tensor([1.0, 2.0])}, rows)
        d.flush()
        assert claim.result(timeout=60)["a"].tolist() == [1.0, 2.0]
    assert d.channels_open >= 2


def test_a_killed_warehouse_is_named_at_the_call_that_waits_on_it(shared_dock):
    d = TransferDock.ray(nodes=[_node_with("node0")])
    client = pickle.loads(pickle.dumps(d))                  # a worker's copy, connected
    client.reset(1, groups=(1, 2))
    d.shutdown()
    with pytest.raises(DockError, match="channel to warehouse 0 at .*the warehouse actor died or the dock was shut down"):
        client.get("c", ["a"], None, timeout=30)


class _LoopbackCapture:
    """Every frame on the loopback interface while open (a raw AF_PACKET socket: root or
    CAP_NET_RAW), searched for ``markers`` packet by packet (the markers repeat through the sample
    tensors, so some copy lies whole inside one TCP segment)."""

    def __init__(self, markers):
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))   # ETH_P_ALL
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.markers, self.seen, self.bytes = markers, {m: 0 for m in markers}, 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop:
            try:
                pkt = self.sock.recv(1 << 17)
            except socket.timeout:
                continue
            self.bytes += len(pkt)
            for m in self.markers:
                self.seen[m] += m in pkt

    def close(self):
        self._stop = True
        self._thread.join()
        self.sock.close()


def test_dock_traffic_on_the_loopback_interface_shows_sample_bytes_only_when_encryption_is_off(dock):
    # The cluster's nodes share this host, so every byte between the driver's client and the
    # warehouses crosses the loopback interface: capture it during a put and a get of marked columns.
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3)).close()
    except (PermissionError, AttributeError, OSError):
        pytest.skip("capturing on the loopback interface needs root or CAP_NET_RAW "
                    "(tests/unit/test_dock_zmq.py checks the same through relays)")
    assert dock.encrypted and dock._keys.server_secret is None     # clients never get the warehouses' key
    # same_host_files=False: the clients take TCP, as from another node (on one host they would
    # use the warehouses' socket files, which never reach a network interface)
    sealed = TransferDock.ray(nodes=[_node_with("node0")], same_host_files=False)
    plain = TransferDock.ray(nodes=[_node_with("node0")], encryption=False, same_host_files=False)
    try:
        assert sealed.encrypted and not plain.encrypted
        for d, encrypted in ((sealed, True), (plain, False)):
            big_marker, small_marker = os.urandom(12).hex().encode(), os.urandom(10).hex().encode()
            big = torch.frombuffer(bytearray(big_marker * 8192), dtype=torch.uint8).view(8, -1)    # [8, 24 KiB]
            small = torch.frombuffer(bytearray(small_marker * 8), dtype=torch.uint8).view(8, -1)   # [8, 20]
            cap = _LoopbackCapture([big_marker, small_marker])
            try:
                rows = d.reset(next(_steps), groups=(2, 4))
                d.put({"big": big, "small": small}, rows)
                b = d.get("c", ["big", "small"], None, timeout=30)
                assert torch.equal(b["big"], big) and torch.equal(b["small"], small)
            finally:
                cap.close()
            assert cap.bytes > big.numel()
            for m in (big_marker, small_marker):
                assert (cap.seen[m] > 0) is (not encrypted), (m, encrypted, cap.seen)
    finally:
        plain.shutdown()
        sealed.shutdown()


@ray.remote(num_cpus=0, max_concurrency=2)
class Worker:
    """Writes and reads at the same time (two threads), so two actors give 2 writers + 2 readers."""

    def __init__(self, dock):
        self.dock = dock

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def produce(self, n_groups: int, g: int, placement: str) -> list[int]:
        d = self.dock.with_placement(placement)
        rows = d.add_groups(n_groups, g)
        d.put({"ids": [ids(r, 1 + r % 3) for r in rows]}, rows)
        d.flush()  # puts are sent without waiting; the caller inspects the warehouses next
        return rows

    def consume(self, rank: int, size: int) -> list[tuple[int, list[int]]]:
        b = self.dock.get("c", ["ids"], None, dp_rank=rank, dp_size=size, timeout=20)
        return [(r, t.tolist()) for r, t in zip(b.rows, b["ids"])]

    def write(self, n_groups: int, g: int) -> list[int]:
        out = []
        for _ in range(n_groups):
            rows = self.dock.add_groups(1, g)
            self.dock.put({"ids": [ids(r, 1 + r % 5) for r in rows]}, rows)
            out += rows
        self.dock.flush()
        return out

    def read(self, rank: int, size: int) -> list[tuple[int, list[int]]]:
        got = []
        while True:
            try:
                b = self.dock.get("r", ["ids"], 2, dp_rank=rank, dp_size=size, timeout=2)
            except DockTimeout:
                return got
            got += [(r, t.tolist()) for r, t in zip(b.rows, b["ids"])]


@pytest.fixture(scope="module")
def workers(shared_dock):
    """Two worker actors, pinned to node1 and node2, each holding a pickled copy of the handle."""
    ws = [Worker.options(resources={f"node{i}": 0.01}).remote(shared_dock) for i in (1, 2)]
    yield ws
    for w in ws:
        ray.kill(w)


def test_one_warehouse_per_node_and_placement(dock, workers):
    nodes = [_node_with(f"node{i}") for i in range(3)]
    st = dock.stats()
    assert sorted(w["node_id"] for w in st["warehouses"]) == sorted(nodes)      # one per node
    assert dock.warehouse_nodes == [w["node_id"] for w in st["warehouses"]]
    assert ray.get([w.node.remote() for w in workers]) == nodes[1:]
    # round robin by group: 6 groups of 2 over 3 warehouses
    rows = ray.get(workers[0].produce.remote(3, 2, "round_robin"))
    rows += ray.get(workers[1].produce.remote(3, 2, "round_robin"))
    st = dock.stats()
    assert st["rows_per_warehouse"] == [4, 4, 4]
    assert [w["columns"]["ids"] for w in st["warehouses"]] == [4, 4, 4]
    # writer_node: the rows of a writer on node2 stay in node2's warehouse
    more = ray.get(workers[1].produce.remote(2, 2, "writer_node"))
    st = dock.stats()
    wh2 = dock.warehouse_nodes.index(nodes[2])
    assert [w["columns"]["ids"] for w in st["warehouses"]] == [4 + 4 * (i == wh2) for i in range(3)]
    # consumers on node1 and node2 read rows from all three nodes, exactly
    got = ray.get([workers[0].consume.remote(0, 2), workers[1].consume.remote(1, 2)])
    flat = sorted(x for g in got for x in g)
    assert [r for r, _ in flat] == sorted(rows + more)
    assert all(v == ids(r, 1 + r % 3).tolist() for r, v in flat)
    # the non-head warehouses reached the head's controller (commits, claims) over direct channels
    head = dock.warehouse_nodes[0]
    st = dock.stats()
    assert all(w["head_channels"] >= 1 for w in st["warehouses"] if w["node_id"] != head), st["warehouses"]


def test_concurrent_writer_and_reader_actors_share_one_picklable_handle(dock, workers):
    assert isinstance(pickle.loads(pickle.dumps(dock)), RayDock)
    r_refs = [w.read.remote(i, 2) for i, w in enumerate(workers)]
    w_rows = ray.get([w.write.remote(6, 2) for w in workers])
    got = [x for rs in ray.get(r_refs) for x in rs]
    assert sorted(r for rs in w_rows for r in rs) == list(range(24))
    assert sorted(r for r, _ in got) == list(range(24))             # each row exactly once
    for r, v in got:
        assert v == ids(r, 1 + r % 5).tolist()
    # a copy of the handle cannot shut the dock down; the creator can
    pickle.loads(pickle.dumps(dock)).shutdown()
    assert dock.stats()["rows"] == 24
