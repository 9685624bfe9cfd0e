"""The ``alltoallv_experts`` strategy of :class:`~.executor.Resharder` (owner to owner, one all-to-all-v
per bucket over the whole group) and the send packing / receive ordering it shares with
``cross_alltoallv``."""
from __future__ import annotations

import math
from collections import defaultdict

import torch

from .layout import _interval, local_shape
from .transfer import _bytes_as, _dist, _nbytes, _pack


class ExpertStrategies:
    """Mixin of :class:`~.executor.Resharder`: every slice straight from its train owner to its
    rollout owner. :meth:`_pack_sends` / :meth:`_recv_order` also serve ``cross_alltoallv``
    (:class:`~.strategies_cross.CrossStrategies`)."""

    # ---- alltoallv_experts ------------------------------------------------------------------
    def _pack_sends(self, bucket, sends, local, W: int, me: int) -> tuple[torch.Tensor, list[int]]:
        """A bucket's outgoing pieces in one byte buffer, destination-major, then (spec, start): the
        receiver unpacks in the same order (:meth:`_recv_order`). Returns the buffer and its splits."""
        plan = self.plan
        per_dst = defaultdict(list)
        for i in bucket:
            for p in sends.get(i, ()):
                per_dst[p.dst].append(p)
        in_splits = []
        for dst in range(W):
            per_dst[dst].sort(key=lambda p: (p.spec, p.start))
            in_splits.append(sum(p.numel * self._esize(p.spec) for p in per_dst[dst]))
        sendbuf = torch.empty(sum(in_splits), dtype=torch.uint8, device=self.device)
        off = 0
        for dst in range(W):
            for p in per_dst[dst]:  # copied straight into the packed buffer
                s = plan.specs[p.spec]
                nb = p.numel * self._esize(p.spec)
                piece = local[s.name]
                if s.split_dim is not None:
                    ta, _ = _interval(s, plan.train, me)
                    piece = piece.narrow(s.split_dim, p.start - ta, p.stop - p.start)
                _pack(sendbuf[off:off + nb], piece)
                off += nb
        return sendbuf, in_splits

    def _recv_order(self, bucket, recvs, W: int) -> tuple[list[int], list]:
        """The byte split per source and the pieces in the order they arrive."""
        per_src = defaultdict(list)
        for i in bucket:
            for p in recvs.get(i, ()):
                per_src[p.src].append(p)
        out_splits, order = [], []
        for src in range(W):
            lst = sorted(per_src.get(src, ()), key=lambda p: (p.spec, p.start))
            order += lst
            out_splits.append(sum(p.numel * self._esize(p.spec) for p in lst))
        return out_splits, order

    def _run_alltoallv_experts(self, idx, local):
        """Send every slice from its train owner straight to its rollout owner (one all-to-all-v per
        bucket over the whole group); nobody materialises more than its own rollout shard."""
        dist = _dist()
        plan, me, W = self.plan, self.rank, self.plan.train.world
        roll_bytes = lambda i: math.prod(local_shape(plan.specs[i], plan.rollout)) * self._esize(i)  # noqa: E731
        cost = lambda i: 2 * max(roll_bytes(i), math.prod(local_shape(plan.specs[i], plan.train)) * self._esize(i))  # noqa: E731
        sends = defaultdict(list)
        for p in plan.send[me]:
            sends[p.spec].append(p)
        recvs = defaultdict(list)
        for p in plan.recv[me]:
            recvs[p.spec].append(p)
        locs = defaultdict(list)
        for i, a, b in plan.local[me]:
            locs[i].append((a, b))
        for bucket in self._buckets(idx, cost):
            bset = set(bucket)
            sendbuf, in_splits = self._pack_sends(bucket, sends, local, W, me)
            out_splits, order = self._recv_order(bucket, recvs, W)
            recvbuf = torch.empty(sum(out_splits), dtype=torch.uint8, device=self.device)
            self.stats.alloc(_nbytes(sendbuf) + _nbytes(recvbuf))
            dist.all_to_all_single(recvbuf, sendbuf, out_splits, in_splits, group=self.group)
            self.stats.collectives += 1
            self.stats.sent_bytes += _nbytes(sendbuf)
            self.stats.recv_bytes += _nbytes(recvbuf)
            self.stats.free(_nbytes(sendbuf))
            del sendbuf
            outs = {}
            for i in bucket:
                s = plan.specs[i]
                o = torch.empty(local_shape(s, plan.rollout), dtype=self._dtype_of(s.name), device=self.device)
                self.stats.alloc(_nbytes(o))
                ra, _ = _interval(s, plan.rollout, me)
                for a, b in locs.get(i, ()):
                    ta, _ = _interval(s, plan.train, me)
                    if s.split_dim is None:
                        o.copy_(local[s.name])
                    else:
                        o.narrow(s.split_dim, a - ra, b - a).copy_(local[s.name].narrow(s.split_dim, a - ta, b - a))
                outs[i] = o
            off = 0
            for p in order:
                s = plan.specs[p.spec]
                nb = p.numel * self._esize(p.spec)
                shape = list(s.shape)
                if s.split_dim is not None:
                    shape[s.split_dim] = p.stop - p.start
                chunk = _bytes_as(recvbuf[off:off + nb], self._dtype_of(s.name), shape)
                o = outs[p.spec]
                if s.split_dim is None:
                    o.copy_(chunk)
                else:
                    ra, _ = _interval(s, plan.rollout, me)
                    o.narrow(s.split_dim, p.start - ra, p.stop - p.start).copy_(chunk)
                off += nb
            self.stats.free(_nbytes(recvbuf))
            del recvbuf
            assert bset == set(outs)
            out = [(plan.specs[i].name, outs[i]) for i in bucket]
            self.stats.buckets += 1
            yield out
            self.stats.free(sum(_nbytes(t) for _, t in out))
            del out, outs
