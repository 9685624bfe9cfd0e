"""Weights from the train ranks to the rollout ranks when the two run in separate process worlds.

With disaggregated placement the train roles and the rollout each have their own torch.distributed
world (so every engine keeps seeing "the world" as its own ranks), and the two sets are joined by one
extra point-to-point group spanning all ``T + R`` processes (``bridge``). :class:`WeightBridge` moves
the weights across it exactly as the disaggregated :class:`~.plan.ReshardPlan` says: every rollout rank
receives each slice of its rollout shard once, from the train rank the plan picked (sources spread
over the train replicas), bucket by bucket, so a rollout rank holds at most one bucket of new weights
besides its engine's, and a train rank sends straight from its own shard (no gather, no full copy).

The bridge group is built from the run's rendezvous store (:func:`bridge_group`); its collectives are
the group object's own ``send`` / ``recv`` (it is not registered in torch's default world).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from .layout import _interval, _row_numel, local_shape
from .plan import ReshardPlan


def bridge_group(store, rank: int, world: int, timeout: timedelta):
    """The gloo group over every process of the run (train ranks first, then rollout ranks)."""
    return dist.ProcessGroupGloo(dist.PrefixStore("bridge/", store), rank, world, timeout)


class WeightBridge:
    """Train layout -> rollout layout across two worlds, over ``group`` (global ranks of ``plan``)."""

    def __init__(self, plan: ReshardPlan, group, rank: int, dtype: torch.dtype, bucket_mb: float = 256.0):
        if not plan.disaggregated:
            raise ValueError("WeightBridge needs a disaggregated ReshardPlan (train and rollout on disjoint ranks)")
        self.plan, self.group, self.rank, self.dtype = plan, group, rank, dtype
        self.bytes_moved = 0
        esize = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else torch.iinfo(dtype).bits // 8
        # buckets: consecutive specs whose rollout shards fit bucket_mb on every rollout rank
        limit = max(1, int(bucket_mb * 2 ** 20))
        self.buckets: list[list[int]] = []
        cur, size = [], 0
        for i, s in enumerate(plan.specs):
            n = max(_row_numel(s) * (b - a) for j in range(plan.rollout.world)
                    for a, b in [_interval(s, plan.rollout, j)]) * esize
            if cur and size + n > limit:
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += n
        if cur:
            self.buckets.append(cur)
        # every piece of a bucket in one order both sides agree on; a piece's tag is its position
        self._pieces = []
        for b in self.buckets:
            members = set(b)
            self._pieces.append(sorted((p for ps in plan.recv for p in ps if p.spec in members),
                                       key=lambda p: (p.spec, p.dst, p.start)))

    @property
    def is_sender(self) -> bool:
        return self.rank in self.plan.train_ranks

    def send(self, local_shards: Mapping[str, torch.Tensor]) -> int:
        """Train rank: send this rank's pieces of every bucket; returns the bytes sent."""
        specs, sent = self.plan.specs, 0
        for pieces in self._pieces:
            works, keep = [], []
            for tag, p in enumerate(pieces):
                if p.src != self.rank:
                    continue
                s = specs[p.spec]
                t = local_shards[s.name].detach()
                if s.split_dim is not None:
                    ta, _ = _interval(s, self.plan.train, self.rank)
                    t = t.narrow(s.split_dim, p.start - ta, p.stop - p.start)
                t = t.to("cpu", self.dtype).contiguous()
                keep.append(t)
                works.append(self.group.send([t], p.dst, tag))
                sent += t.numel() * t.element_size()
            for w in works:
                w.wait()
        self.bytes_moved += sent
        return sent

    def receive(self, device: torch.device | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Rollout rank: yields each bucket as ``[(HF name, rollout-layout tensor)]``."""
        plan, specs = self.plan, self.plan.specs
        j = self.rank - plan.rollout_ranks.start
        for bucket, pieces in zip(self.buckets, self._pieces):
            out = {i: torch.empty(local_shape(specs[i], plan.rollout), dtype=self.dtype) for i in bucket}
            works = []
            for tag, p in enumerate(pieces):
                if p.dst != self.rank:
                    continue
                s = specs[p.spec]
                if s.split_dim is None:
                    view = out[p.spec]
                else:
                    ra, _ = _interval(s, plan.rollout, j)
                    view = out[p.spec].narrow(s.split_dim, p.start - ra, p.stop - p.start)
                buf = view if view.is_contiguous() else torch.empty(view.shape, dtype=self.dtype)
                works.append((self.group.recv([buf], p.src, tag), view, buf))
            for w, view, buf in works:
                w.wait()
                if buf is not view:
                    view.copy_(buf)
                self.bytes_moved += buf.numel() * buf.element_size()
            yield [(specs[i].name, out[i].to(device) if device is not None else out[i]) for i in bucket]
