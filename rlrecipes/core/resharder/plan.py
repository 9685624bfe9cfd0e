"""The pure reshard plan: per rank, the slices kept, received and sent, with bytes; and byte summaries
for real model sizes."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rlrecipes.core.param_spec import ParamSpec

from .layout import Layout, Piece, _interval, _row_numel, _split_len, _validate


class ReshardPlan:
    """Who keeps, receives and sends which slice, for every rank (pure; no processes).

    Attributes:
        train, rollout: the two layouts.
        specs: parameter specs (index = position).
        dtype_bytes: bytes per element used for the byte figures.
        local[r]: list of (spec index, start, stop) that rank r copies from its own train shard.
        recv[r] / send[r]: lists of :class:`Piece`.
    """

    def __init__(self, train: Layout, rollout: Layout, specs: Sequence[ParamSpec], dtype_bytes: int = 2):
        _validate(train, rollout, specs)
        self.train, self.rollout, self.specs, self.dtype_bytes = train, rollout, list(specs), dtype_bytes
        self.index = {s.name: i for i, s in enumerate(self.specs)}
        W = train.world
        self.local: list[list[tuple[int, int, int]]] = [[] for _ in range(W)]
        self.recv: list[list[Piece]] = [[] for _ in range(W)]
        self.send: list[list[Piece]] = [[] for _ in range(W)]
        S = train.stage_size
        for i, s in enumerate(self.specs):
            stage, kt, L, row = train.stage_of(s), train.chunks(s), _split_len(s), _row_numel(s)
            nt = L // kt
            for r in range(W):
                a, b = _interval(s, rollout, r)
                loc = r % S
                todo = [(a, b)]
                if train.coords(r)["pp"] == stage:
                    ta, tb = _interval(s, train, r)
                    lo, hi = max(a, ta), min(b, tb)
                    if lo < hi:
                        self.local[r].append((i, lo, hi))
                        todo = [(a, lo), (hi, b)]
                for x, y in todo:
                    while x < y:  # split by train chunk boundaries
                        c = x // nt
                        z = min(y, (c + 1) * nt)
                        src = self._source(s, stage, c, loc)
                        p = Piece(i, src, r, x, z, (z - x) * row)
                        self.recv[r].append(p)
                        self.send[src].append(p)
                        x = z

    def _source(self, spec: ParamSpec, stage: int, chunk: int, loc: int) -> int:
        """The train holder of ``chunk`` on ``stage`` nearest the receiver's in-stage position ``loc``.

        TP / vocab: same DP replica; experts: same EP block; replicated: same position.
        Spreads the sends evenly over the replicas.
        """
        t = self.train
        base = stage * t.stage_size
        if spec.kind == "expert":
            return base + (loc // t.ep) * t.ep + chunk
        if spec.tp_dim is not None:
            return base + (loc // t.tp) * t.tp + chunk
        return base + loc

    # ---- byte figures ------------------------------------------------------------------------
    def recv_bytes(self, rank: int) -> int:
        return sum(p.numel for p in self.recv[rank]) * self.dtype_bytes

    def send_bytes(self, rank: int) -> int:
        return sum(p.numel for p in self.send[rank]) * self.dtype_bytes

    def min_bytes(self, rank: int) -> int:
        """What ``rank`` must receive because it does not hold it (this plan receives exactly that)."""
        return self.recv_bytes(rank)

    def rollout_bytes(self, rank: int) -> int:
        return sum(_row_numel(s) * (b - a) for s in self.specs for a, b in [_interval(s, self.rollout, rank)]) \
            * self.dtype_bytes

    def spec_min_numel(self, rank: int) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for p in self.recv[rank]:
            out[p.spec] += p.numel
        return out

    def summary(self) -> dict[str, Any]:
        W = self.train.world
        recv = [self.recv_bytes(r) for r in range(W)]
        send = [self.send_bytes(r) for r in range(W)]
        return {"train": self.train.describe(), "rollout": self.rollout.describe(), "world": W,
                "params": len(self.specs), "recv_bytes": recv, "send_bytes": send,
                "max_recv_bytes": max(recv), "max_send_bytes": max(send), "total_bytes": sum(recv)}


def plan_reshard(train: Layout, rollout: Layout, specs: Sequence[ParamSpec], dtype_bytes: int = 2) -> ReshardPlan:
    """Validate the pair and compute the per-rank keep / receive / send lists (pure)."""
    return ReshardPlan(train, rollout, specs, dtype_bytes)


def reshard_bytes_summary(train: Layout, rollout: Layout, specs: Sequence[ParamSpec],
                          dtype_bytes: int = 2) -> dict[str, Any]:
    """Per-rank reshard volume for real model sizes without enumerating transfers.

    ``specs`` come from the model family (``rlrecipes.models.reshard_bytes_summary`` builds them
    from dims). Parameters are aggregated into classes (kind, split length, chunk counts, row size,
    stage); each class is evaluated once per rank. Returns max / per-rank minimum received bytes,
    the rollout shard size, and what ``allgather_naive`` would materialise per rank (the whole model).
    """
    _validate(train, rollout, specs)
    classes: dict[tuple, list] = {}
    for s in specs:
        key = (s.kind, s.split_dim is None, _split_len(s), _row_numel(s), train.chunks(s), rollout.chunks(s),
               train.stage_of(s))
        if key in classes:
            classes[key][1] += 1
        else:
            classes[key] = [s, 1]
    W = train.world
    need = [0] * W
    roll = [0] * W
    for s, count in classes.values():
        stage, row = train.stage_of(s), _row_numel(s)
        for r in range(W):
            a, b = _interval(s, rollout, r)
            got = 0
            if train.coords(r)["pp"] == stage:
                ta, tb = _interval(s, train, r)
                got = max(0, min(b, tb) - max(a, ta))
            need[r] += (b - a - got) * row * count
            roll[r] += (b - a) * row * count
    total = sum(s.numel for s in specs)
    return {
        "train": train.describe(), "rollout": rollout.describe(), "world": W, "params": len(specs),
        "param_classes": len(classes), "dtype_bytes": dtype_bytes,
        "min_recv_bytes_per_rank": [n * dtype_bytes for n in need],
        "max_min_recv_bytes": max(need) * dtype_bytes,
        "total_min_recv_bytes": sum(need) * dtype_bytes,
        "max_rollout_shard_bytes": max(roll) * dtype_bytes,
        "naive_gather_bytes_per_rank": total * dtype_bytes,
    }
