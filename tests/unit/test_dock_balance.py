"""The balancing fast paths (equal weights, vectorised units / homes / parts) against a plain
reference: the straightforward algorithms, kept here, must give exactly the same partitions."""
import heapq
import itertools
import random

import numpy as np
import pytest

from rlrecipes.core.dock.balance import (max_load, partition_claim, partition_kk, partition_lpt,
                                         partition_sticky)
from rlrecipes.core.dock.metadata import _Meta


# -- reference: the plain algorithms ------------------------------------------------------------

def _by_weight(w, items):
    return sorted(items, key=lambda i: (-w[i], i))


def ref_lpt_into(items, w, bins, sums, equal_count, n):
    k = len(bins)
    q, rem = divmod(n, k)
    n_big = sum(len(b) > q for b in bins)
    heap = [(sums[b], len(bins[b]), b) for b in range(k)]
    heapq.heapify(heap)
    for i in _by_weight(w, items):
        while True:
            total, count, b = heapq.heappop(heap)
            if not equal_count or count < q or (count == q and n_big < rem):
                break
        bins[b].append(i)
        n_big += equal_count and count == q
        sums[b] = total + w[i]
        heapq.heappush(heap, (sums[b], count + 1, b))
    return [sorted(b) for b in bins]


def ref_lpt(w, k, equal_count=True):
    return ref_lpt_into(range(len(w)), w, [[] for _ in range(k)], [0.0] * k, equal_count, len(w))


def ref_sticky(w, k, home, equal_count=True):
    n, q = len(w), len(w) // k
    share = sum(w) / k * (1 + 1e-9)
    bins, sums, kept = [[] for _ in range(k)], [0.0] * k, set()
    for b in range(k):
        for i in _by_weight(w, [i for i, h in enumerate(home) if h == b]):
            if (not equal_count or len(bins[b]) < q) and sums[b] + w[i] <= share:
                bins[b].append(i)
                sums[b] += w[i]
                kept.add(i)
    return ref_lpt_into([i for i in range(n) if i not in kept], w, bins, sums, equal_count, n)


def ref_kk(w, k):
    if not w:
        return [[] for _ in range(k)]
    tie, heap = itertools.count(), []
    for i in _by_weight(w, range(len(w))):
        heapq.heappush(heap, (-float(w[i]), next(tie), [(float(w[i]), [i])] + [(0.0, [])] * (k - 1)))
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        merged = sorted(((a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)),
                        key=lambda p: (-p[0], min(p[1], default=-1)))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    return [sorted(items) for _, items in heap[0][2]]


def ref_claim(w, k, home, equal_count):
    plain = ref_lpt(w, k) if equal_count else ref_kk(w, k)
    stay = ref_sticky(w, k, home, equal_count)
    load = lambda bins: max((sum(w[i] for i in b) for b in bins), default=0.0)  # noqa: E731
    return stay if load(stay) <= load(plain) else plain


def ref_round(m: _Meta, columns, k, whole_groups, taken):
    """A count=None round's (partition, holders), computed row by row from the metadata."""
    rows = [r for r in range(m.n_rows) if not m.dropped[r] and not taken[r]]
    if whole_groups:
        units = []
        for gid in sorted({int(m.group_of[r]) for r in rows}):
            first, size = m.groups[gid]
            members = [x for x in range(first, first + size) if not m.dropped[x]]
            if members and all(x in rows for x in members):
                units.append(members)
    else:
        units = [[r] for r in rows]
    var = [c for c in m.lengths if c not in m.kinds or not m.kinds[c][1]]
    use = [c for c in columns if c in var] or var
    tok = [max(1, sum(int(m.lengths[c][r]) for c in use)) for r in range(m.n_rows)]
    w = [float(sum(tok[r] for r in u)) for u in units]
    cached = [c for c in columns if c in m.holder and (m.holder[c] >= 0).any()]
    if cached and units:
        held = m.holder[max(cached, key=lambda c: int(m.lengths[c].sum()))]
        home = [int(held[u[0]]) if len({int(held[r]) for r in u}) == 1 and 0 <= held[u[0]] < k else -1
                for u in units]
    else:
        home = [i * k // len(units) for i in range(len(units))]
    part = [sorted(x for i in b for x in units[i]) for b in ref_claim(w, k, home, m.equal_count)]
    holders = {c: [[int(m.holder[c][x]) for x in p] for p in part]
               for c in columns if c in m.holder and all(m.holder[c][r] >= 0 for r in rows)}
    return part, holders


# -- the partitioners ---------------------------------------------------------------------------

def _weights(rng, n):
    kind = rng.randrange(5)
    if kind == 0:
        return [float(rng.choice([1, 7, 1024]))] * n                 # equal token counts
    if kind == 1:
        return [rng.choice([0, 3, -2])] * n                           # equal ints, zeros, negative
    if kind == 2:
        return [rng.choice([0.5, 0.1, 2.0 ** 60])] * n                # equal, not exact sums
    if kind == 3:
        return [float(rng.choice([4, 5])) for _ in range(n)]          # many ties
    return [float(rng.randint(1, 4096)) for _ in range(n)]


def test_partitioners_match_the_reference():
    rng = random.Random(0)
    for _ in range(1000):
        n, k = rng.randint(0, 40), rng.randint(1, 12)                 # n % k != 0 and k > n included
        w = _weights(rng, n)
        home = [rng.choice([-1, k, rng.randrange(k), i * k // max(n, 1), i * k // max(n, 1)])
                for i in range(n)]
        for equal_count in (True, False):
            assert partition_lpt(w, k, equal_count) == ref_lpt(w, k, equal_count)
            assert partition_sticky(w, k, home, equal_count) == ref_sticky(w, k, home, equal_count)
            assert partition_claim(w, k, home, equal_count) == ref_claim(w, k, home, equal_count)
        assert partition_kk(w, k) == ref_kk(w, k)
        assert max_load(w, partition_lpt(w, k)) == max_load(w, ref_lpt(w, k))


def test_equal_weights_keep_the_first_homes_and_balance_only_the_rest():
    w, home = [8.0] * 10, [0] * 6 + [1] * 3 + [-1]                   # q = 3 with k = 3
    assert partition_sticky(w, 3, home) == [[0, 1, 2, 9], [6, 7, 8], [3, 4, 5]]
    assert partition_claim(w, 3, np.asarray(home)) == partition_sticky(w, 3, home)
    with pytest.raises(ValueError, match="need k >= 1"):
        partition_claim(w, 0, home)


# -- the claim ----------------------------------------------------------------------------------

def _random_meta(rng):
    m = _Meta(n_warehouses=rng.choice([1, 1, 3]), equal_count=rng.random() < 0.75)
    for _ in range(rng.randint(1, 2)):
        m.add_groups(rng.randint(0, 8), rng.randint(1, 5), rng.choice([None, None, 0]))
    k = rng.choice([1, 2, 3, 4, 8, 12])
    if m.n_rows and rng.random() < 0.3:
        m.drop_rows(rng.sample(range(m.n_rows), rng.randint(1, m.n_rows)))
    live = [r for r in range(m.n_rows) if not m.dropped[r]]
    L = rng.choice([1, 16, 1024])
    mode = rng.choice(["equal", "varied", "cached", "cached"])
    if mode == "cached":                                              # holders: blocks, strays, outside 0..k-1
        for r in live:
            h = rng.choice([r * k // m.n_rows, r * k // m.n_rows, rng.randrange(k), k])
            m.mark_ready({"c": ("", True, [L if rng.random() < 0.8 else rng.randint(1, 64)])}, [r], holder=h)
        cols = ["c", "s"] if rng.random() < 0.5 else ["c"]
        m.mark_ready({"s": ("float32", True, [1] * len(live))}, live)
    else:
        lens = [L] * len(live) if mode == "equal" else [rng.randint(1, 64) for _ in live]
        m.mark_ready({"x": ("int64", rng.random() < 0.3, lens)}, live)
        cols = ["x"]
    return m, k, cols


def test_claims_match_the_reference():
    rng = random.Random(1)
    rounds = 0
    for _ in range(400):
        m, k, cols = _random_meta(rng)
        if rng.random() < 0.3:                                        # a streamed claim first: partial groups
            m.try_claim("c", cols, rng.randint(1, 4), 0, 1, rng.random() < 0.5)
        whole = rng.random() < 0.5
        taken = m._consumer("c").taken.copy()
        got = [m.try_claim("c", cols, None, r, k, whole) for r in range(k)]
        if got[0] is None:
            assert all(g is None for g in got)
            continue
        rounds += 1
        part, holders = ref_round(m, cols, k, whole, taken)
        assert got == part and m.last_partition == part and m.last_holders == holders
        assert all(type(x) is int for p in got for x in p)
        claimed = m.where(cols, got[0])
        assert sorted(x for xs in claimed.by_warehouse.values() for x in xs) == got[0]
        assert all(int(m.warehouse[x]) == wh for wh, xs in claimed.by_warehouse.items() for x in xs)
    assert rounds > 250
