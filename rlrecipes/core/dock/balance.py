"""Balancing rows over data-parallel ranks by token count (LPT with equal counts, Karmarkar-Karp).
Pure functions, deterministic: ties go by item index."""
from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import numpy as np


def _check(k: int) -> None:
    if k < 1:
        raise ValueError(f"partition into {k} bins: need k >= 1")


def _heaviest_first(weights: Sequence[float], items: Sequence[int]) -> list[int]:
    """``items`` (ascending) by weight descending, ties by index: a reverse sort is stable."""
    return sorted(items, key=weights.__getitem__, reverse=True)


def _uniform(weights: Sequence[float]) -> bool:
    """All weights one whole number >= 0 whose sums are exact floats (equal token counts)."""
    w = list(weights)
    return bool(w) and w.count(w[0]) == len(w) and float(w[0]).is_integer() and 0 <= w[0] * len(w) < 2 ** 53


def partition_lpt(weights: Sequence[float], k: int, equal_count: bool = True) -> list[list[int]]:
    """Greedy LPT: items by weight descending (ties by index) to the lightest bin (ties: fewer
    items, then the lower bin index).

    With ``equal_count`` every bin gets ``floor(n/k)`` or ``ceil(n/k)`` items. Returns item indices
    per bin, each sorted ascending. O(n log n): the bins sit in a heap keyed like the choice; a bin
    that can take no more items leaves it for good (bins only fill up).
    """
    _check(k)
    n = len(weights)
    return _lpt_into(_heaviest_first(weights, range(n)), weights, [[] for _ in range(k)], [0.0] * k, equal_count, n)


def _lpt_into(order, weights, bins: list[list[int]], sums: list[float], equal_count: bool, n: int):
    """LPT of the items in ``order`` (heaviest first) into ``bins`` that may already hold items (with
    loads ``sums``); ``n``: the number of items in all, for the equal-count quota. The bins, sorted."""
    q, rem = divmod(n, len(bins))  # with equal_count: `rem` bins hold q + 1 items, the others q
    n_big = sum(len(b) > q for b in bins)
    heap = [(s, len(b), j) for j, (s, b) in enumerate(zip(sums, bins))]
    heapq.heapify(heap)
    for i in order:
        total, count, b = heap[0]
        while equal_count and count >= q and not (count == q and n_big < rem):
            heapq.heappop(heap)  # full for good
            total, count, b = heap[0]
        bins[b].append(i)
        n_big += equal_count and count == q
        heapq.heapreplace(heap, (total + weights[i], count + 1, b))
    return [sorted(b) for b in bins]


def partition_sticky(weights: Sequence[float], k: int, home: Sequence[int],
                     equal_count: bool = True) -> list[list[int]]:
    """A balanced partition that keeps items in their ``home`` bin (-1: none) where it can.

    Each bin first keeps its home items, heaviest first, while its load stays within the mean
    (and, with ``equal_count``, its count within ``floor(n/k)``); everything else is placed by LPT
    (:func:`partition_lpt`'s rule). When the homes are already balanced nothing moves. The caller
    compares the result's heaviest bin with a plain partition's (:func:`max_load`): keeping items
    home must not cost balance."""
    _check(k)
    n, q = len(weights), len(weights) // k
    share = sum(weights) / k * (1 + 1e-9)
    uniform = equal_count and _uniform(weights)
    bins: list[list[int]] = [[] for _ in range(k)]
    sums = [0.0] * k
    h = np.asarray(home, np.int64)
    if h.size != n:
        raise ValueError(f"{h.size} homes for {n} items")
    by_home = np.argsort(h, kind="stable")  # items by home bin, ascending within one
    cut = np.searchsorted(h[by_home], np.arange(k + 1)).tolist()  # bin b's: by_home[cut[b]:cut[b + 1]]
    left = by_home[:cut[0]].tolist() + by_home[cut[k]:].tolist()  # no home bin
    for b in range(k):
        items = by_home[cut[b]:cut[b + 1]].tolist()  # ascending
        if uniform:  # each of the first q home items fits the share (sums exact): keep them
            bins[b], sums[b] = items[:q], min(q, len(items)) * float(weights[0])
            left += items[q:]
            continue
        for i in _heaviest_first(weights, items):
            if (not equal_count or len(bins[b]) < q) and sums[b] + weights[i] <= share:
                bins[b].append(i)
                sums[b] += weights[i]
            else:
                left.append(i)
    return _lpt_into(_heaviest_first(weights, sorted(left)), weights, bins, sums, equal_count, n)


def max_load(weights: Sequence[float], bins: Sequence[Sequence[int]]) -> float:
    return max((sum(map(weights.__getitem__, b)) for b in bins), default=0.0)


def partition_claim(weights: Sequence[float], k: int, home: Sequence[int],
                    equal_count: bool = True) -> list[list[int]]:
    """A claim's partition: :func:`partition_sticky`'s unless its heaviest bin is heavier than a
    plain partition's (:func:`partition_lpt`, or :func:`partition_kk` without ``equal_count``).
    With equal counts and equal weights every partition has the same heaviest bin: sticky wins."""
    stay = partition_sticky(weights, k, home, equal_count)
    if equal_count and _uniform(weights):
        return stay
    plain = partition_lpt(weights, k) if equal_count else partition_kk(weights, k)
    return stay if max_load(weights, stay) <= max_load(weights, plain) else plain


def partition_kk(weights: Sequence[float], k: int) -> list[list[int]]:
    """Karmarkar-Karp largest differencing method for k-way partitioning (no count constraint)."""
    _check(k)
    tie = itertools.count()
    heap = []  # (-spread, tiebreak, [(sum, items), ...] sorted by sum descending)
    for i in _heaviest_first(weights, range(len(weights))):
        part = [(float(weights[i]), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-part[0][0], next(tie), part))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # Largest of a with smallest of b, and so on.
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda p: (-p[0], min(p[1], default=-1)))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    return [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(k)]
