"""The pure reshard plan: per rank, the slices kept, received and sent, with bytes; and byte summaries
for real model sizes."""
from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rlrecipes.core.param_spec import ParamSpec

from ..parallel import ParallelLayout
from .layout import Piece, _interval, _row_numel, _split_len, _validate, local_shape


class ReshardPlan:
    """Who keeps, receives and sends which slice, for every rank (pure; no processes).

    Two placements:

    * ``colocated`` (default): train and rollout layouts over the same ``train.world`` ranks; a
      rank keeps the overlap of its train and rollout shards and receives the rest.
    * ``disaggregated``: train and rollout on disjoint ranks of one world of ``T + R`` ranks
      (``T = train.world``, ``R = rollout.world``): train ranks are global ranks ``[0, T)``,
      rollout ranks ``[T, T + R)`` (rollout-layout rank ``j`` is global rank ``T + j``). Train
      ranks keep and receive nothing; rollout ranks receive every slice from a train rank holding
      it, the sources spread over the train replicas (DP / EP blocks / the stage's ranks for
      replicated tensors) so the send load balances (greedy, least bytes first).

    Attributes:
        train, rollout: the two layouts.
        placement: ``"colocated"`` or ``"disaggregated"``.
        world: ranks of the process group (``train.world``, or ``train.world + rollout.world``).
        train_ranks / rollout_ranks: global ranks of each side (the same range when colocated).
        specs: parameter specs (index = position).
        dtype_bytes: bytes per element used for the byte figures.
        local[r]: list of (spec index, start, stop) that rank r copies from its own train shard.
        recv[r] / send[r]: lists of :class:`Piece` (``src`` / ``dst`` are global ranks).
    """

    def __init__(self, train: ParallelLayout, rollout: ParallelLayout, specs: Sequence[ParamSpec], dtype_bytes: int = 2,
                 placement: str = "colocated"):
        _validate(train, rollout, specs, placement)
        self.train, self.rollout, self.specs, self.dtype_bytes = train, rollout, list(specs), dtype_bytes
        self.placement = placement
        self.index = {s.name: i for i, s in enumerate(self.specs)}
        T = train.world
        if self.disaggregated:
            self.world = T + rollout.world
            self.train_ranks, self.rollout_ranks = range(T), range(T, T + rollout.world)
        else:
            self.world = T
            self.train_ranks = self.rollout_ranks = range(T)
        W = self.world
        self.local: list[list[tuple[int, int, int]]] = [[] for _ in range(W)]
        self.recv: list[list[Piece]] = [[] for _ in range(W)]
        self.send: list[list[Piece]] = [[] for _ in range(W)]
        if self.disaggregated:
            self._plan_cross()
            return
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

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"

    @functools.cached_property
    def identity(self) -> bool:
        """Every rank's rollout shard is exactly its train shard (colocated; nothing to receive and
        the shard sizes agree, e.g. TP1 -> TP1 at any DP): resharding moves no bytes and needs no
        buffer, so the executor hands the train shards over as they are."""
        if self.disaggregated:
            return False
        if any(self.recv[r] for r in range(self.world)):
            return False
        return all(local_shape(s, self.train) == local_shape(s, self.rollout) for s in self.specs)

    def rollout_rank(self, rank: int) -> int | None:
        """Rollout-layout rank of global ``rank`` (None: a train-only rank)."""
        if rank in self.rollout_ranks:
            return rank - self.rollout_ranks.start
        return None

    def holders(self, spec: ParamSpec, chunk: int) -> list[int]:
        """Train ranks (global) holding ``chunk`` of ``spec`` in the train layout."""
        t = self.train
        base, S = t.stage_of(spec) * t.stage_size, t.stage_size
        if spec.kind == "expert":
            return [base + b * t.ep + chunk for b in range(S // t.ep)]
        if spec.tp_dim is not None:
            return [base + d * t.tp + chunk for d in range(S // t.tp)]
        return [base + loc for loc in range(S)]

    def _plan_cross(self) -> None:
        """Disaggregated: every rollout slice from a train holder, least-loaded holder first (ties:
        rotated by the rollout rank, so equal pieces spread round-robin over the replicas)."""
        train, rollout = self.train, self.rollout
        off = self.rollout_ranks.start
        load = [0] * self.world
        for i, s in enumerate(self.specs):
            L, row = _split_len(s), _row_numel(s)
            nt = L // train.chunks(s)
            hold = {}
            for j in range(rollout.world):
                x, y = _interval(s, rollout, j)
                while x < y:
                    c = x // nt
                    z = min(y, (c + 1) * nt)
                    hs = hold.get(c) or hold.setdefault(c, self.holders(s, c))
                    n = len(hs)
                    k = min(range(n), key=lambda k: (load[hs[k]], (k - j) % n))
                    p = Piece(i, hs[k], off + j, x, z, (z - x) * row)
                    load[hs[k]] += p.numel
                    self.recv[off + j].append(p)
                    self.send[hs[k]].append(p)
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
        """Bytes of ``rank``'s rollout shard (0 on a train-only rank)."""
        j = self.rollout_rank(rank)
        if j is None:
            return 0
        return sum(_row_numel(s) * (b - a) for s in self.specs for a, b in [_interval(s, self.rollout, j)]) \
            * self.dtype_bytes

    def spec_min_numel(self, rank: int) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for p in self.recv[rank]:
            out[p.spec] += p.numel
        return out

    def summary(self) -> dict[str, Any]:
        W = self.world
        recv = [self.recv_bytes(r) for r in range(W)]
        send = [self.send_bytes(r) for r in range(W)]
        return {"train": self.train.describe(), "rollout": self.rollout.describe(), "world": W,
                "placement": self.placement,
                "params": len(self.specs), "recv_bytes": recv, "send_bytes": send,
                "max_recv_bytes": max(recv), "max_send_bytes": max(send), "total_bytes": sum(recv)}


def plan_reshard(train: ParallelLayout, rollout: ParallelLayout, specs: Sequence[ParamSpec], dtype_bytes: int = 2,
                 placement: str = "colocated") -> ReshardPlan:
    """Validate the pair and compute the per-rank keep / receive / send lists (pure).

    ``placement="disaggregated"``: train on global ranks ``[0, T)``, rollout on ``[T, T + R)``
    (see :class:`ReshardPlan`)."""
    return ReshardPlan(train, rollout, specs, dtype_bytes, placement)


def reshard_bytes_summary(train: ParallelLayout, rollout: ParallelLayout, specs: Sequence[ParamSpec],
                          dtype_bytes: int = 2, placement: str = "colocated") -> dict[str, Any]:
    """Per-rank reshard volume for real model sizes without enumerating transfers.

    ``specs`` come from the model family (``rlrecipes.models.reshard_bytes_summary`` builds them
    from dims). Parameters are aggregated into classes (kind, split length, chunk counts, row size,
    stage); each class is evaluated once per rank. Returns max / per-rank minimum received bytes,
    the rollout shard size, and what ``allgather_naive`` would materialise per rank (the whole model).

    ``placement="disaggregated"``: the per-rank lists span the ``T + R`` global ranks (train
    first); a rollout rank's minimum is its whole rollout shard, a train rank's 0; the train
    ranks' send load is given as ``send_bytes_per_rank`` with the sends spread evenly over the
    holders of each slice (the enumerated plan's greedy stays within one slice of it).
    """
    _validate(train, rollout, specs, placement)
    classes: dict[tuple, list] = {}
    for s in specs:
        key = (s.kind, s.split_dim is None, _split_len(s), _row_numel(s), train.chunks(s), rollout.chunks(s),
               train.stage_of(s))
        if key in classes:
            classes[key][1] += 1
        else:
            classes[key] = [s, 1]
    cross = placement == "disaggregated"
    T, R = train.world, rollout.world
    W = T + R if cross else T
    need = [0] * W
    roll = [0] * W
    send = [0.0] * W
    for s, count in classes.values():
        stage, row = train.stage_of(s), _row_numel(s)
        if cross:
            kt = train.chunks(s)
            nt = _split_len(s) // kt
            req = [0] * kt  # rows of each train chunk requested over all rollout ranks
            for j in range(R):
                a, b = _interval(s, rollout, j)
                need[T + j] += (b - a) * row * count
                roll[T + j] += (b - a) * row * count
                for c in range(a // nt, (b - 1) // nt + 1):
                    req[c] += min(b, (c + 1) * nt) - max(a, c * nt)
            S = train.stage_size
            holders = S // train.ep if s.kind == "expert" else train.replicas if s.tp_dim is not None else S
            for loc in range(S):
                t = stage * S + loc
                send[t] += req[train.chunk_index(s, t)] * row * count / holders
            continue
        for r in range(W):
            a, b = _interval(s, rollout, r)
            got = 0
            if train.coords(r)["pp"] == stage:
                ta, tb = _interval(s, train, r)
                got = max(0, min(b, tb) - max(a, ta))
            need[r] += (b - a - got) * row * count
            roll[r] += (b - a) * row * count
    total = sum(s.numel for s in specs)
    out = {
        "train": train.describe(), "rollout": rollout.describe(), "world": W, "params": len(specs),
        "param_classes": len(classes), "dtype_bytes": dtype_bytes,
        "min_recv_bytes_per_rank": [n * dtype_bytes for n in need],
        "max_min_recv_bytes": max(need) * dtype_bytes,
        "total_min_recv_bytes": sum(need) * dtype_bytes,
        "max_rollout_shard_bytes": max(roll) * dtype_bytes,
        "naive_gather_bytes_per_rank": total * dtype_bytes,
    }
    if cross:
        out.update(placement=placement, train_ranks=[0, T], rollout_ranks=[T, T + R],
                   send_bytes_per_rank=[round(x * dtype_bytes) for x in send],
                   max_send_bytes=round(max(send) * dtype_bytes))
    return out
