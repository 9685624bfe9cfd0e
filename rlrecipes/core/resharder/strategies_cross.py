"""The ``cross_alltoallv`` strategy of :class:`~.executor.Resharder`: a disaggregated plan, train ranks
to disjoint rollout ranks, one all-to-all-v over the whole group per bucket."""
from __future__ import annotations

from collections import defaultdict

import torch

from .layout import _interval, local_shape
from .transfer import _bytes_as, _nbytes


class CrossStrategies:
    """Mixin of :class:`~.executor.Resharder`: the disaggregated transfer. Packs and orders pieces
    with the helpers of :class:`~.strategies_experts.ExpertStrategies`."""

    # ---- cross_alltoallv (disaggregated) -----------------------------------------------------
    def _cross_costs(self) -> dict[int, int]:
        """Per parameter, the most bytes it keeps alive on any one rank during its bucket: a train
        rank's packed sends; a rollout rank's received bytes, plus an output tensor when its slice
        arrives in several pieces (a single piece is viewed in place in the receive buffer).
        The same on every rank, so every rank cuts the same buckets."""
        plan = self.plan
        cost: dict[int, int] = defaultdict(int)
        for r in plan.train_ranks:
            per: dict[int, int] = defaultdict(int)
            for p in plan.send[r]:
                per[p.spec] += p.numel
            for i, n in per.items():
                cost[i] = max(cost[i], n * self._esize(i))
        for r in plan.rollout_ranks:
            per, pieces = defaultdict(int), defaultdict(int)
            for p in plan.recv[r]:
                per[p.spec] += p.numel
                pieces[p.spec] += 1
            for i, n in per.items():
                cost[i] = max(cost[i], n * self._esize(i) * (2 if pieces[i] > 1 else 1))
        return cost

    def _run_cross_alltoallv(self, idx, local):
        """Train ranks -> disjoint rollout ranks: per bucket one all-to-all-v over the whole group;
        a train rank packs the slices it serves (sources balanced by the plan), a rollout rank
        unpacks its own rollout shard. Train ranks yield nothing; nobody holds more than about one
        bucket beyond its own weights."""
        plan, me, W = self.plan, self.rank, self.plan.world
        costs = self._cross_costs()
        sends, recvs = defaultdict(list), defaultdict(list)
        for p in plan.send[me]:
            sends[p.spec].append(p)
        for p in plan.recv[me]:
            recvs[p.spec].append(p)
        j = plan.rollout_rank(me)
        for bucket in self._buckets(idx, lambda i: costs[i]):
            sendbuf, in_splits = self._pack_sends(bucket, sends, local, W, me)
            self.stats.alloc(_nbytes(sendbuf))
            out_splits, order = self._recv_order(bucket, recvs, W)
            recvbuf = torch.empty(sum(out_splits), dtype=torch.uint8, device=self.device)
            self.stats.alloc(_nbytes(recvbuf))
            self._all_to_all(recvbuf, sendbuf, out_splits, in_splits)
            self.stats.collectives += 1
            self.stats.sent_bytes += _nbytes(sendbuf)
            self.stats.recv_bytes += _nbytes(recvbuf)
            self.stats.free(_nbytes(sendbuf))
            del sendbuf
            if j is None:  # a train-only rank: it served its slices, it gets no rollout shard
                self.stats.free(_nbytes(recvbuf))
                continue
            outs, own = {}, 0
            off = 0
            for p in order:
                s = plan.specs[p.spec]
                nb = p.numel * self._esize(p.spec)
                dt = self._dtype_of(s.name)
                rshape = local_shape(s, plan.rollout)
                if len(recvs[p.spec]) == 1:  # the whole rollout slice in one piece: a view, no copy
                    outs[p.spec] = _bytes_as(recvbuf[off:off + nb], dt, rshape)
                else:
                    o = outs.get(p.spec)
                    if o is None:
                        o = outs[p.spec] = torch.empty(rshape, dtype=dt, device=self.device)
                        self.stats.alloc(_nbytes(o))
                        own += _nbytes(o)
                    shape = list(s.shape)
                    shape[s.split_dim] = p.stop - p.start
                    ra, _ = _interval(s, plan.rollout, j)
                    o.narrow(s.split_dim, p.start - ra, p.stop - p.start).copy_(
                        _bytes_as(recvbuf[off:off + nb], dt, shape))
                off += nb
            out = [(plan.specs[i].name, outs[i]) for i in bucket]
            self.stats.buckets += 1
            yield out  # single-piece tensors are views of recvbuf: it is part of the bucket's output memory
            self.stats.free(_nbytes(recvbuf) + own)
            del out, outs, recvbuf
