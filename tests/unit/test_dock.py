"""TransferDock, local backend: readiness, consumption, groups, balancing, timeouts, threads."""
from __future__ import annotations

import pickle
import random
import threading
import time

import pytest
import torch

from rlrecipes.core.dock import (Batch, DockError, DockTimeout, TransferDock, partition_kk,
                                 partition_lpt, partition_sticky)
from rlrecipes.core.dock.balance import max_load


def ids(row: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64) + 1000 * row  # [n]


@pytest.fixture
def dock():
    d = TransferDock.local()
    d.reset(0)
    return d


def test_put_get_roundtrip_unpadded_and_stacked(dock):
    rows = dock.add_groups(2, 2)
    assert rows == [0, 1, 2, 3]
    lens = [3, 5, 1, 4]
    dock.put({"ids": [ids(r, n) for r, n in zip(rows, lens)],
              "scores": torch.tensor([0.5, 1.5, 2.5, 3.5])}, rows)
    b = dock.get("c", ["ids", "scores"], None, timeout=1)
    assert b.rows == rows
    assert [t.shape[0] for t in b.columns["ids"]] == lens          # stored unpadded
    for r, t in zip(rows, b["ids"]):
        assert torch.equal(t, ids(r, lens[r]))
    assert isinstance(b["scores"], torch.Tensor) and b["scores"].shape == (4,)
    assert torch.equal(b["scores"], torch.tensor([0.5, 1.5, 2.5, 3.5]))


def test_bf16_and_multi_dim_rows(dock):
    rows = dock.add_groups(1, 3)
    x = [torch.randn(n, 2).to(torch.bfloat16) for n in (1, 2, 3)]
    dock.put({"x": x}, rows)
    b = dock.get("c", ["x"], None, timeout=1)
    assert all(torch.equal(a, e) and a.dtype == torch.bfloat16 for a, e in zip(b["x"], x))


def test_put_copies_so_producer_writes_do_not_leak(dock):
    rows = dock.add_groups(1, 2)
    t = torch.zeros(2, 4)
    dock.put({"v": t}, rows)
    t.add_(7)
    assert dock.get("c", ["v"], None, timeout=1)["v"].sum().item() == 0


def test_readiness_needs_all_columns_and_consumers_are_independent(dock):
    rows = dock.add_groups(1, 4)
    dock.put({"a": torch.ones(4)}, rows)
    dock.put({"b": torch.ones(2)}, rows[:2])
    b = dock.get("x", ["a", "b"], 2, timeout=1)
    assert b.rows == [0, 1]
    with pytest.raises(DockTimeout):               # rows 2, 3 lack b
        dock.get("x", ["a", "b"], 1, timeout=0.05)
    # another consumer still sees every row; the first one does not see rows again
    assert dock.get("y", ["a"], None, timeout=1).rows == rows
    assert dock.all_consumed("y") and not dock.all_consumed("x")
    dock.put({"b": torch.ones(2)}, rows[2:])
    assert dock.get("x", ["a", "b"], 5, timeout=1).rows == [2, 3]   # fewer than count: all that is left
    assert dock.all_consumed("x")


def test_streaming_count_takes_each_row_once_across_dp_ranks(dock):
    rows = dock.add_groups(4, 2)
    dock.put({"a": torch.arange(8.)}, rows)
    got = [dock.get("x", ["a"], 3, dp_rank=i % 2, dp_size=2, timeout=1).rows for i in range(3)]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_whole_groups_only_returns_complete_groups(dock):
    rows = dock.add_groups(3, 3)                   # groups {0,1,2} {3,4,5} {6,7,8}
    dock.put({"s": torch.ones(5)}, rows[:5])       # group 1 incomplete
    with pytest.raises(DockTimeout):               # 6 rows = 2 complete groups: only 1 is
        dock.get("adv", ["s"], 6, whole_groups=True, timeout=0.05)
    b = dock.get("adv", ["s"], 3, whole_groups=True, timeout=1)
    assert b.rows == [0, 1, 2]
    with pytest.raises(DockTimeout):
        dock.get("adv", ["s"], 3, whole_groups=True, timeout=0.05)
    dock.put({"s": torch.ones(4)}, rows[5:])
    assert dock.get("adv", ["s"], 6, whole_groups=True, timeout=1).rows == [3, 4, 5, 6, 7, 8]


def test_count_none_waits_for_everything_then_balances_by_tokens(dock):
    rows = dock.add_groups(8, 1)
    lens = [100, 1, 50, 50, 2, 98, 3, 97]
    dock.put({"ids": [ids(r, n) for r, n in zip(rows[:7], lens[:7])]}, rows[:7])
    with pytest.raises(DockTimeout) as e:
        dock.get("train", ["ids"], None, dp_rank=0, dp_size=2, timeout=0.05)
    msg = str(e.value)
    assert "'train'" in msg and "['ids']" in msg and "7 rows ready" in msg and "8 live rows" in msg
    dock.put({"ids": [ids(7, 97)]}, rows[7:])
    b1 = dock.get("train", ["ids"], None, dp_rank=1, dp_size=2, timeout=1)
    b0 = dock.get("train", ["ids"], None, dp_rank=0, dp_size=2, timeout=1)
    assert sorted(b0.rows + b1.rows) == rows and not set(b0.rows) & set(b1.rows)
    assert b0.partition == b1.partition == [b0.rows, b1.rows]
    t0, t1 = (sum(lens[r] for r in b.rows) for b in (b0, b1))
    assert abs(t0 - t1) <= 2 and len(b0) == len(b1) == 4           # 201 vs 200
    # The partition is deterministic: a fresh dock with the same puts gives the same bins.
    d2 = TransferDock.local()
    d2.add_groups(8, 1)
    d2.put({"ids": [ids(r, n) for r, n in zip(rows, lens)]}, rows)
    assert d2.get("train", ["ids"], None, dp_rank=0, dp_size=2, timeout=1).rows == b0.rows


def test_count_none_whole_groups_partitions_groups(dock):
    rows = dock.add_groups(4, 2)
    lens = [10, 10, 1, 1, 5, 5, 6, 4]
    dock.put({"ids": [ids(r, n) for r, n in zip(rows, lens)]}, rows)
    bins = [dock.get("adv", ["ids"], None, dp_rank=r, dp_size=2, whole_groups=True, timeout=1).rows
            for r in range(2)]
    for b in bins:
        assert all((x ^ 1) in b for x in b)       # groups are pairs {2g, 2g+1}
    # group tokens 20, 2, 10, 10; equal group counts per rank -> {20, 2} | {10, 10}
    assert sorted(sum(lens[x] for x in b) for b in bins) == [20, 22]


def test_count_none_second_round_after_more_groups(dock):
    rows = dock.add_groups(2, 1)
    dock.put({"a": torch.ones(2)}, rows)
    assert dock.get("x", ["a"], None, dp_rank=0, dp_size=2, timeout=1).rows == [0]
    more = dock.add_groups(2, 1)                  # DAPO generates more mid-step
    dock.put({"a": torch.ones(2)}, more)
    # rank 0 asks again: a new round over rows 2, 3; rank 1 still gets its round-0 bin first
    assert dock.get("x", ["a"], None, dp_rank=0, dp_size=2, timeout=1).rows == [2]
    assert dock.get("x", ["a"], None, dp_rank=1, dp_size=2, timeout=1).rows == [1]
    assert dock.get("x", ["a"], None, dp_rank=1, dp_size=2, timeout=1).rows == [3]
    with pytest.raises(DockError, match="dp_size 4 differs"):
        dock.get("x", ["a"], None, dp_rank=0, dp_size=4, timeout=0.05)


def test_more_ranks_than_rows_gives_empty_bins(dock):
    rows = dock.add_groups(1, 1)
    dock.put({"a": [torch.ones(3)]}, rows)
    bs = [dock.get("x", ["a"], None, dp_rank=r, dp_size=3, timeout=1) for r in range(3)]
    assert [len(b) for b in bs] == [1, 0, 0] and bs[1].columns["a"] == []
    dock.reset(1)
    rows = dock.add_groups(1, 1)
    dock.put({"s": torch.ones(1, 2)}, rows)
    bs = [dock.get("y", ["s"], None, dp_rank=r, dp_size=2, timeout=1) for r in range(2)]
    assert bs[1]["s"].shape == (0,) and bs[1]["s"].dtype == torch.float32


def test_drop_rows_and_dynamic_sampling(dock):
    rows = dock.add_groups(2, 2)
    dock.put({"s": torch.tensor([1., 1., 0., 1.])}, rows)
    dock.drop_rows([0, 1])                        # group 0 had equal scores: filtered
    more = dock.add_groups(1, 2)
    assert more == [4, 5]                         # ids are never reused within a step
    dock.put({"s": torch.tensor([0., 1.])}, more)
    b = dock.get("adv", ["s"], None, whole_groups=True, timeout=1)
    assert b.rows == [2, 3, 4, 5]
    assert dock.all_consumed("adv")
    st = dock.stats()
    assert st["live_rows"] == 4 and st["dropped_rows"] == 2 and st["groups"] == 3
    with pytest.raises(DockError, match="dropped"):
        dock.put({"s": torch.ones(1)}, [0])


def test_reset_clears_and_starts_new_step(dock):
    rows = dock.add_groups(1, 2)
    dock.put({"a": torch.ones(2)}, rows)
    dock.reset(1)
    assert dock.stats()["rows"] == 0 and dock.stats()["step"] == 1
    assert dock.add_groups(1, 2) == [0, 1]
    with pytest.raises(DockTimeout, match="step 1"):
        dock.get("x", ["a"], 1, timeout=0.05)


def test_clear_errors(dock):
    dock.add_groups(1, 2)
    with pytest.raises(DockError, match="never allocated"):
        dock.put({"a": torch.ones(1)}, [5])
    with pytest.raises(DockError, match="first dim"):
        dock.put({"a": torch.ones(3)}, [0, 1])
    with pytest.raises(DockError, match="2 rows"):
        dock.put({"a": [torch.ones(1)]}, [0, 1])
    dock.put({"a": torch.ones(2)}, [0, 1])
    with pytest.raises(DockError, match="already has it as stacked float32"):
        dock.put({"a": [torch.ones(1), torch.ones(2)]}, [0, 1])
    with pytest.raises(DockError, match="dp_rank 2"):
        dock.get("x", ["a"], 1, dp_rank=2, dp_size=2)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(dock)


def test_mark_cached_records_holder_only(dock):
    rows = dock.add_groups(1, 4)
    dock.mark_cached({"logp": [5, 6]}, rows[:2], rank=0)
    with pytest.raises(DockError, match="3 lengths for 2 rows"):
        dock.mark_cached({"logp": [5, 6, 7]}, rows[:2], rank=0)
    dock.mark_cached(["logp"], rows[2:], rank=3)
    dock.put({"s": torch.ones(4)}, rows)
    assert dock.cached_on("logp", rows) == [0, 0, 3, 3]
    assert dock.cached_on("s", rows) == [None] * 4
    b = dock.get("upd", ["logp", "s"], None, timeout=1)
    assert "logp" not in b.columns and b.holders == {"logp": [0, 0, 3, 3]}
    assert dock.stats()["warehouses"][0]["columns"] == {"s": 4}    # no data for cached columns


def test_partitioners_balance():
    rng = random.Random(0)
    w = [rng.randint(1, 4096) for _ in range(64)]
    for k in (2, 4, 8):
        for bins, eq in ((partition_lpt(w, k), True), (partition_lpt(w, k, False), False),
                         (partition_kk(w, k), False)):
            assert sorted(i for b in bins for i in b) == list(range(64))
            sums = [sum(w[i] for i in b) for b in bins]
            assert max(sums) - min(sums) <= max(w) // 4, (k, sums)
            if eq:
                assert {len(b) for b in bins} == {64 // k}
    assert [len(b) for b in partition_lpt([1] * 7, 3)] == [3, 2, 2]
    # Karmarkar-Karp beats greedy LPT on the textbook case (LPT 17/13, KK 16/14)
    w5 = [8, 7, 6, 5, 4]
    assert sorted(sum(w5[i] for i in b) for b in partition_kk(w5, 2)) == [14, 16]
    assert sorted(sum(w5[i] for i in b) for b in partition_lpt(w5, 2, False)) == [13, 17]


def test_sticky_partition_keeps_balanced_homes_and_moves_only_the_excess():
    w = [10.0] * 12
    home = [i // 4 for i in range(12)]                               # 3 ranks, 4 rows each
    assert partition_sticky(w, 3, home) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    # rank 0 holds 6 rows, rank 2 only 2: two rows move to rank 2, the rest stay
    home = [0] * 6 + [1] * 4 + [2] * 2
    bins = partition_sticky(w, 3, home)
    assert [len(b) for b in bins] == [4, 4, 4] and bins[1] == [6, 7, 8, 9]
    assert sum(home[i] != r for r, b in enumerate(bins) for i in b) == 2
    assert max_load(w, bins) == max_load(w, partition_lpt(w, 3)) == 40.0


def test_a_claim_of_cached_columns_keeps_rows_with_their_holder(dock):
    rows = dock.add_groups(4, 2)                                     # 8 rows
    for rank in range(2):                                            # rank r holds rows 4r..4r+3
        dock.mark_cached({"logp": [6] * 4}, rows[4 * rank:4 * rank + 4], rank)
    got = [dock.get("upd", ["logp"], None, dp_rank=r, dp_size=2, timeout=1) for r in range(2)]
    assert [b.rows for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]    # nothing to exchange
    assert got[1].partition_holders == {"logp": [[0] * 4, [1] * 4]}  # ... and every rank can tell
    assert got[0].holders == {"logp": [0] * 4}
    # uneven holders: the partition is as balanced as the plain one, and moves the fewest rows
    dock.reset(1)
    rows = dock.add_groups(4, 2)
    dock.mark_cached({"logp": [6] * 6}, rows[:6], 0)
    dock.mark_cached({"logp": [6] * 2}, rows[6:], 1)
    got = [dock.get("upd", ["logp"], None, dp_rank=r, dp_size=2, timeout=1) for r in range(2)]
    assert [len(b) for b in got] == [4, 4] and got[1].holders["logp"].count(0) == 2
    # stored rows of equal weight go out in contiguous blocks (one slice of a writer's chunk each)
    dock.reset(2)
    rows = dock.add_groups(4, 2)
    dock.put({"s": torch.ones(8)}, rows)
    assert [dock.get("x", ["s"], None, dp_rank=r, dp_size=2, timeout=1).rows for r in range(2)] == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    # ... unless blocks cost balance: then the plain LPT bins
    dock.reset(3)
    rows = dock.add_groups(4, 2)
    dock.put({"t": [torch.ones(n) for n in (9, 9, 1, 1, 9, 9, 1, 1)]}, rows)
    got = [dock.get("x", ["t"], None, dp_rank=r, dp_size=2, timeout=1) for r in range(2)]
    assert [sum(len(t) for t in b["t"]) for b in got] == [20, 20]   # blocks would be 38 / 2


def test_concurrent_thread_writers_and_readers():
    dock = TransferDock.local()
    n_writers, groups_each, g = 4, 6, 2
    results: dict[int, list[int]] = {}
    seen_data: list[tuple[int, torch.Tensor]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def writer(w):
        try:
            for _ in range(groups_each):
                rows = dock.add_groups(1, g)
                dock.put({"ids": [ids(r, 1 + r % 7) for r in rows]}, rows)
                time.sleep(0.001)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader(rank):
        try:
            mine = []
            while len(mine) < 100:
                try:
                    b = dock.get("r", ["ids"], 2, dp_rank=rank, dp_size=3, timeout=0.5)
                except DockTimeout:
                    break
                mine += b.rows
                with lock:
                    seen_data.extend(zip(b.rows, b["ids"]))
            results[rank] = mine
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n_writers)]
    threads += [threading.Thread(target=reader, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    total = n_writers * groups_each * g
    got = sorted(r for rs in results.values() for r in rs)
    assert got == list(range(total))              # every row exactly once, no loss, no dup
    for r, t in seen_data:
        assert torch.equal(t, ids(r, 1 + r % 7))
    assert dock.all_consumed("r")


def test_blocked_reader_wakes_when_writer_puts():
    dock = TransferDock.local()
    rows = dock.add_groups(1, 2)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("b", dock.get("x", ["a"], 2, timeout=10)))
    t.start()
    time.sleep(0.05)
    assert t.is_alive()
    dock.put({"a": torch.ones(2)}, rows)
    t.join(5)
    assert not t.is_alive() and out["b"].rows == rows


def test_reset_with_groups_starts_the_step_and_allocates_in_one_call(dock):
    rows = dock.add_groups(1, 2)
    dock.put({"a": torch.ones(2)}, rows)
    assert dock.reset(3, groups=(2, 2)) == [0, 1, 2, 3]    # the old rows are gone: numbering restarts
    st = dock.stats()
    assert st["step"] == 3 and st["rows"] == 4 and st["warehouses"][0]["bytes"] == 0
    assert dock.add_groups(1, 2) == [4, 5]                 # later rounds continue after them
    assert dock.reset(4) is None and dock.stats()["rows"] == 0


def test_reset_ahead_is_taken_by_the_matching_reset_only(dock):
    rows = dock.add_groups(1, 2)
    dock.put({"a": torch.ones(2)}, rows)
    dock.reset_ahead(5, groups=(1, 2))                     # in process: the reset happens now
    assert dock.stats()["step"] == 5 and dock.stats()["warehouses"][0]["bytes"] == 0
    assert dock.reset(5, groups=(1, 2)) == [0, 1]          # its answer; no second reset
    assert dock.add_groups(1, 2) == [2, 3]
    dock.reset_ahead(6, groups=(1, 2))
    assert dock.reset(7, groups=(2, 2)) == [0, 1, 2, 3]    # another step: a fresh reset, not the one sent
    assert dock.stats()["step"] == 7


@pytest.mark.parametrize("big", [False, True])
def test_wire_format_round_trips_every_column_kind(big, monkeypatch):
    """What a Ray call carries (packing.to_wire) comes back as the same rows: stacked and list
    columns, bf16 (stored as int16), scalars, no rows; small buffers as bytes, big ones as arrays."""
    import numpy as np
    from rlrecipes.core.dock import packing
    if big:
        monkeypatch.setattr(packing, "WIRE_BYTES_MAX", 0)
    cols = {
        "ids": torch.arange(12, dtype=torch.int64).view(3, 4),
        "ragged": [torch.ones(2), torch.zeros(5), torch.full((1,), 3.0)],
        "bf": torch.randn(3, 2, 2).to(torch.bfloat16),
        "score": torch.tensor([0.5, 1.0, -1.0]),
    }
    for name, value in cols.items():
        p = packing.pack_column(name, value, 3)
        w = packing.to_wire(p)
        assert isinstance(w[0], np.ndarray if big else bytes)
        back = packing.unpack(packing.from_wire(pickle.loads(pickle.dumps(w))), copy=True)
        if isinstance(value, list):
            assert all(torch.equal(a, b) for a, b in zip(back, value)) and len(back) == 3
        else:
            assert back.dtype == value.dtype and torch.equal(back, value)
    empty = packing.slice_packed(packing.pack_column("ids", cols["ids"], 3), [])
    assert packing.from_wire(packing.to_wire(empty)).shapes == []


def test_undo_of_a_rejected_write_keeps_a_write_stored_after_it():
    """A warehouse runs calls on several threads: a writer's put can be stored after its next,
    rejected put was stored. Taking the rejected one back must not erase the rows stored meanwhile."""
    from rlrecipes.core.dock.packing import _ColumnStore, pack_column, unpack
    store = _ColumnStore()
    rejected = store.write("a", [2, 3], pack_column("a", [torch.ones(2)] * 2, 2))
    store.write("a", [2, 3], pack_column("a", torch.tensor([5.0, 6.0]), 2))      # lands meanwhile
    store.undo(rejected)
    assert unpack(store.read("a", [2, 3]), copy=True).tolist() == [5.0, 6.0]
    # the ordinary order: the rejected write came last and goes back to what the rows held
    rejected = store.write("a", [2, 3], pack_column("a", [torch.ones(2)] * 2, 2))
    store.undo(rejected)
    assert unpack(store.read("a", [2, 3]), copy=True).tolist() == [5.0, 6.0]
    gone = store.write("b", [7], pack_column("b", torch.ones(1), 1))
    store.undo(gone)
    with pytest.raises(DockError, match="no data"):
        store.read("b", [7])


def test_a_warehouse_takes_only_typed_requests_and_checks_every_answer():
    """The transport carries only the requests of messages.py: anything else is refused by name,
    and an answer of a type the request's schema does not allow fails at the warehouse."""
    from rlrecipes.core.dock import messages as m
    from rlrecipes.core.dock.warehouse import _Warehouse
    wh = _Warehouse(0)
    for bad in (("control", ("step",)), "claim", {"method": "reset"}, None):
        with pytest.raises(DockError, match="takes only dock requests"):
            wh.handle(bad)

    @m.message
    class Unknown(m.Request):
        ANSWER = (int,)

    @m.message
    class UnknownToTheController(m.ControllerRequest):
        ANSWER = (int,)

    with pytest.raises(DockError, match="warehouse 0 takes no Unknown"):
        wh.handle(Unknown())
    with pytest.raises(DockError, match="controller takes no UnknownToTheController"):
        wh.handle(UnknownToTheController())
    assert wh.handle(m.CurrentStep()) == 0 and wh.handle(m.ControllerStats())["rows"] == 0
    wh._handlers[m.Clear] = lambda req: "cleared"          # a handler that breaks the schema
    with pytest.raises(DockError, match="Clear answered with str, not one of NoneType"):
        wh.handle(m.Clear(3))


def test_messages_pickle_by_their_fields_and_packed_columns_in_the_wire_format():
    from rlrecipes.core.dock import messages as m
    from rlrecipes.core.dock.packing import pack_column
    p = pack_column("ids", torch.arange(6, dtype=torch.int64).view(3, 2), 3)
    w = m.Write([4, 5, 6], {"ids": p}, {"ids": ("int64", True, [2, 2, 2])}, hops=1)
    back = pickle.loads(pickle.dumps(w, protocol=5))
    assert type(back) is m.Write and back.rows == [4, 5, 6] and back.hops == 1 and back.meta == w.meta
    got = back.columns["ids"]
    assert isinstance(got.flat.base, bytes) and got.shapes == [(2,)] * 3 and got.flat.tolist() == list(range(6))
    assert pickle.dumps(back, protocol=5) == pickle.dumps(w, protocol=5)   # bytes pass through unchanged
    assert pickle.loads(pickle.dumps(m.Stored())) == m.Stored()
    claimed = m.ClaimedHere(m.Applied([m.Stored(), m.Refused("no")]), m.TimedOut({"step": 1}), 2)
    again = pickle.loads(pickle.dumps(claimed))
    assert again == claimed and again.applied.failure == "no"
    # on a channel: nested tuples of plain values (no class named in the pickle), the same messages back
    req = m.ClaimRead(m.Claim("c", ["ids"], None, 0, 1, False, 5.0), m.Apply([w], [m.MarkReady({}, [1], 0)], [7]))
    wire = pickle.dumps(m.encode(req), protocol=5)
    assert b"ClaimRead" not in wire and b"messages" not in wire and b"packing" not in wire
    back = m.decode(pickle.loads(wire))
    assert back.claim == req.claim and back.carried.marks == req.carried.marks and back.carried.drops == [7]
    assert back.carried.writes[0].rows == [4, 5, 6] and back.carried.writes[0].columns["ids"].flat.tolist() == list(range(6))
    share = m.ClaimedHere(m.Applied([m.Moved(3, [1])]), m.Claimed(3, [4], {}, ["ids"], {0: [4]}, {}), 0, {"ids": p})
    got = m.decode(pickle.loads(pickle.dumps(m.encode(share), protocol=5)))
    assert got.applied == share.applied and got.claim == share.claim and got.share["ids"].shapes == [(2,)] * 3
    assert m.decode([1, 2]) == [1, 2] and m.decode(None) is None          # plain answers pass as they are
    with pytest.raises(DockError, match="unknown tag"):
        m.decode((10_000, "x"))


def test_the_removed_dock_transport_key_is_refused_by_name_except_the_transport_that_stayed():
    """resources.dock_transport selected Ray actor calls or channels; the dock has one transport now.
    `ray` is refused with the reason and the fix; `direct` (in every old run's config.yaml, so those
    still resume) is what happens anyway and is dropped."""
    from rlrecipes.recipe import RecipeError
    from rlrecipes.recipe.loading import load_recipe
    with pytest.raises(RecipeError, match="resources.dock_transport='ray': this key was removed; the TransferDock "
                                          "has one transport, ZeroMQ channels"):
        load_recipe("qwen25_7b", smoke=True, overrides=["resources.dock_transport=ray"])
    r = load_recipe("qwen25_7b", smoke=True, overrides=["resources.dock_transport=direct"])
    assert "dock_transport" not in r.resources.model_dump() and r.resources.dock_encryption
