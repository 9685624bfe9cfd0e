"""Balancing rows over data-parallel ranks by token count (LPT with equal counts, Karmarkar-Karp)."""
from __future__ import annotations

import heapq
import itertools

from typing import Sequence


# ----------------------------------------------------------------------------------------------
# Balancing: pure functions, deterministic.
# ----------------------------------------------------------------------------------------------

def partition_lpt(weights: Sequence[float], k: int, equal_count: bool = True) -> list[list[int]]:
    """Greedy LPT: items by weight descending (ties by index) to the lightest bin.

    With ``equal_count`` every bin gets ``floor(n/k)`` or ``ceil(n/k)`` items. Returns item indices
    per bin, each sorted ascending.
    """
    if k < 1:
        raise ValueError(f"partition into {k} bins: need k >= 1")
    n = len(weights)
    q, rem = divmod(n, k)  # with equal_count: `rem` bins hold q + 1 items, the others q
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    sums = [0.0] * k
    bins: list[list[int]] = [[] for _ in range(k)]
    n_big = 0
    for i in order:
        best = None
        for b in range(k):
            if equal_count and not (len(bins[b]) < q or (len(bins[b]) == q and n_big < rem)):
                continue
            if best is None or sums[b] < sums[best] or (sums[b] == sums[best] and len(bins[b]) < len(bins[best])):
                best = b
        assert best is not None
        bins[best].append(i)
        sums[best] += weights[i]
        if equal_count and len(bins[best]) == q + 1:
            n_big += 1
    return [sorted(b) for b in bins]


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
