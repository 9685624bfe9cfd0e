"""Balancing rows over data-parallel ranks by token count (LPT with equal counts, Karmarkar-Karp)."""
from __future__ import annotations

import heapq
import itertools

from typing import Sequence


# ----------------------------------------------------------------------------------------------
# Balancing: pure functions, deterministic.
# ----------------------------------------------------------------------------------------------

def partition_lpt(weights: Sequence[float], k: int, equal_count: bool = True) -> list[list[int]]:
    """Greedy LPT: items by weight descending (ties by index) to the lightest bin (ties: fewer
    items, then the lower bin index).

    With ``equal_count`` every bin gets ``floor(n/k)`` or ``ceil(n/k)`` items. Returns item indices
    per bin, each sorted ascending. O(n log n): the bins sit in a heap keyed like the choice; a bin
    that can take no more items leaves it for good (bins only fill up).
    """
    if k < 1:
        raise ValueError(f"partition into {k} bins: need k >= 1")
    bins: list[list[int]] = [[] for _ in range(k)]
    _lpt_into(range(len(weights)), weights, bins, [0.0] * k, equal_count, len(weights))
    return [sorted(b) for b in bins]


def _lpt_into(items, weights, bins: list[list[int]], sums: list[float], equal_count: bool, n: int) -> None:
    """LPT of ``items`` into ``bins`` that may already hold items (with loads ``sums``); ``n``: the
    number of items in all, for the equal-count quota."""
    k = len(bins)
    q, rem = divmod(n, k)  # with equal_count: `rem` bins hold q + 1 items, the others q
    n_big = sum(len(b) > q for b in bins)
    heap = [(sums[b], len(bins[b]), b) for b in range(k)]
    heapq.heapify(heap)
    for i in sorted(items, key=lambda i: (-weights[i], i)):
        while True:
            total, count, b = heapq.heappop(heap)
            if not equal_count or count < q or (count == q and n_big < rem):
                break
        bins[b].append(i)
        if equal_count and count + 1 == q + 1:
            n_big += 1
        sums[b] = total + weights[i]
        heapq.heappush(heap, (sums[b], count + 1, b))


def partition_sticky(weights: Sequence[float], k: int, home: Sequence[int],
                     equal_count: bool = True) -> list[list[int]]:
    """A balanced partition that keeps items in their ``home`` bin (-1: none) where it can.

    Each bin first keeps its home items, heaviest first, while its load stays within the mean
    (and, with ``equal_count``, its count within ``floor(n/k)``); everything else is placed by LPT
    (:func:`partition_lpt`'s rule). When the homes are already balanced nothing moves. The caller
    compares the result's heaviest bin with a plain partition's (:func:`max_load`): keeping items
    home must not cost balance."""
    if k < 1:
        raise ValueError(f"partition into {k} bins: need k >= 1")
    n = len(weights)
    q = n // k
    share = sum(weights) / k * (1 + 1e-9)
    bins: list[list[int]] = [[] for _ in range(k)]
    sums = [0.0] * k
    mine: list[list[int]] = [[] for _ in range(k)]
    for i, h in enumerate(home):
        if 0 <= h < k:
            mine[h].append(i)
    kept = set()
    for b in range(k):
        for i in sorted(mine[b], key=lambda i: (-weights[i], i)):
            if (not equal_count or len(bins[b]) < q) and sums[b] + weights[i] <= share:
                bins[b].append(i)
                sums[b] += weights[i]
                kept.add(i)
    _lpt_into([i for i in range(n) if i not in kept], weights, bins, sums, equal_count, n)
    return [sorted(b) for b in bins]


def max_load(weights: Sequence[float], bins: Sequence[Sequence[int]]) -> float:
    return max((sum(weights[i] for i in b) for b in bins), default=0.0)


def partition_kk(weights: Sequence[float], k: int) -> list[list[int]]:
    """Karmarkar-Karp largest differencing method for k-way partitioning (no count constraint)."""
    if k < 1:
        raise ValueError(f"partition into {k} bins: need k >= 1")
    if not weights:
        return [[] for _ in range(k)]
    tie = itertools.count()
    heap = []  # (-spread, tiebreak, [(sum, items), ...] sorted by sum descending)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        part = [(float(weights[i]), [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(weights[i]), next(tie), part))
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # Largest of a with smallest of b, and so on.
        merged = [(a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda p: (-p[0], min(p[1], default=-1)))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(tie), merged))
    return [sorted(items) for _, items in heap[0][2]]
