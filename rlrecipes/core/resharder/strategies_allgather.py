"""The gather building block (TP / EP all-gather, PP broadcast, rollout-slice extraction) and the
``allgather_naive`` / ``allgather_swap`` strategies of :class:`~.executor.Resharder`."""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .layout import _interval, _row_numel, _split_len, local_shape
from .transfer import _aligned, _dist, _nbytes, _pack


class AllgatherStrategies:
    """Mixin of :class:`~.executor.Resharder`: gather each parameter whole, then cut the rollout
    slices out of it. The gather helpers also serve ``tp_allgather_pp_alltoall``
    (:class:`~.strategies_pp.PipelineStrategies`)."""

    # ---- gather building block -----------------------------------------------------------------
    def _gather(self, i: int, local: Mapping[str, torch.Tensor], pp_bcast: bool) -> torch.Tensor | None:
        """Chunks buffer [k, *chunk_shape] of the full param on ranks of its stage (and, with
        ``pp_bcast``, on every rank via a broadcast over the PP group). None where absent."""
        dist = _dist()
        plan, me = self.plan, self.rank
        s = plan.specs[i]
        t = plan.train
        stage, mine = t.stage_of(s), t.coords(me)["pp"]
        k = t.chunks(s)
        cshape = local_shape(s, t)
        dtype = self._dtype_of(s.name)
        buf = None
        if mine == stage:
            shard = local[s.name]
            if k == 1:
                buf = shard.unsqueeze(0)  # [1, *shape], no copy
            else:
                buf = torch.empty((k, *cshape), dtype=dtype, device=self.device)  # [k, *chunk]
                self.stats.alloc(_nbytes(buf))
                pg, ranks = self._pg["ep" if s.kind == "expert" else "tp"][me]
                dist.all_gather(list(buf.unbind(0)), shard.contiguous(), group=pg)
                self.stats.collectives += 1
                cb = _nbytes(shard)
                self.stats.sent_bytes += (k - 1) * cb
                self.stats.recv_bytes += (k - 1) * cb
        if pp_bcast and t.pp > 1:
            pg, ranks = self._pg["pp"][me]
            root = ranks[stage]
            if buf is None:
                buf = torch.empty((k, *cshape), dtype=dtype, device=self.device)
                self.stats.alloc(_nbytes(buf))
                self.stats.recv_bytes += _nbytes(buf)
            else:
                self.stats.sent_bytes += (t.pp - 1) * _nbytes(buf)
            if not buf.is_contiguous():
                buf = buf.contiguous()
            groot = dist.get_global_rank(self.group, root) if self.group is not None else root
            dist.broadcast(buf, src=groot, group=pg)
            self.stats.collectives += 1
        return buf

    def _gather_bucket(self, bucket: list[int], local: Mapping[str, torch.Tensor]) -> tuple[dict[int, torch.Tensor], int]:
        """The ``[k, *chunk]`` buffers of a bucket's parameters (one pipeline stage) with one all-gather
        per group kind (TP, EP) rather than one per parameter: every rank packs its shards into its
        own row of one ``[k, bytes]`` buffer, the all-gather fills the other rows, and each
        parameter's buffer is a view of its columns. Returns the buffers and the bytes allocated."""
        dist = _dist()
        plan, me, t = self.plan, self.rank, self.plan.train
        out: dict[int, torch.Tensor] = {}
        by_kind: dict[str, list[int]] = {}
        for i in bucket:
            s = plan.specs[i]
            if t.chunks(s) == 1:
                out[i] = local[s.name].unsqueeze(0)  # replicated: [1, *shape], no copy
            else:
                by_kind.setdefault("ep" if s.kind == "expert" else "tp", []).append(i)
        held = 0
        for kind in ("tp", "ep"):  # the same order on every rank
            ids = by_kind.get(kind)
            if not ids:
                continue
            pg, ranks = self._pg[kind][me]
            k = len(ranks)
            nbytes = [math.prod(local_shape(plan.specs[i], t)) * self._esize(i) for i in ids]
            offs = [0]
            for nb in nbytes:  # 16-byte aligned columns: each views as its dtype in place
                offs.append(offs[-1] + -(-nb // 16) * 16)
            buf = torch.empty((k, offs[-1]), dtype=torch.uint8, device=self.device)
            held += _nbytes(buf)
            self.stats.alloc(_nbytes(buf))
            row = buf[t.chunk_index(plan.specs[ids[0]], me)]
            for i, o, nb in zip(ids, offs, nbytes):
                name = plan.specs[i].name
                _pack(row[o:o + nb], local[name].to(self._dtype_of(name)))
            dist.all_gather(list(buf.unbind(0)), row, group=pg)
            self.stats.collectives += 1
            self.stats.sent_bytes += (k - 1) * sum(nbytes)
            self.stats.recv_bytes += (k - 1) * sum(nbytes)
            for i, o, nb in zip(ids, offs, nbytes):
                s = plan.specs[i]
                out[i] = buf[:, o:o + nb].view(self._dtype_of(s.name)).view(k, *local_shape(s, t))
        return out, held

    def _roll_nbytes(self, i: int, rank: int) -> int:
        s = self.plan.specs[i]
        a, b = _interval(s, self.plan.rollout, rank)
        return (b - a) * _row_numel(s) * self._esize(i)

    def _extract(self, i: int, buf: torch.Tensor, rank: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rollout slice of param i for ``rank`` out of a chunks buffer [k, *chunk], as a fresh tensor
        (or written into the uint8 buffer ``into``)."""
        s = self.plan.specs[i]
        shape = local_shape(s, self.plan.rollout)
        if into is not None and not _aligned(into, buf.dtype):
            _pack(into, self._extract(i, buf, rank))
            return into
        out = torch.empty(shape, dtype=buf.dtype, device=buf.device) if into is None \
            else into.view(buf.dtype).view(shape)
        if s.split_dim is None:
            return out.copy_(buf[0])
        a, b = _interval(s, self.plan.rollout, rank)
        k, d = buf.shape[0], s.split_dim
        n = _split_len(s) // k
        for c in range(a // n, (b - 1) // n + 1):
            lo, hi = max(a, c * n), min(b, (c + 1) * n)
            out.narrow(d, lo - a, hi - lo).copy_(buf[c].narrow(d, lo - c * n, hi - lo))
        return out

    def _free_buf(self, i: int, buf: torch.Tensor | None, local) -> None:
        if buf is None:
            return
        shard = local.get(self.plan.specs[i].name)
        if shard is not None and buf.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr():
            return
        self.stats.free(_nbytes(buf))

    # ---- allgather_naive --------------------------------------------------------------------
    def _run_allgather_naive(self, idx, local):
        full = {}
        for i in idx:  # every full parameter on every rank
            full[i] = self._gather(i, local, pp_bcast=True)
        for bucket in self._buckets(idx, lambda i: self.plan.specs[i].numel * self._esize(i)):
            out = [(self.plan.specs[i].name, self._extract(i, full[i], self.rank)) for i in bucket]
            self.stats.buckets += 1
            yield out
        for i in idx:
            self._free_buf(i, full.pop(i), local)

    # ---- allgather_swap ---------------------------------------------------------------------
    def _run_allgather_swap(self, idx, local):
        # A bucket's budget counts the gather buffer of each parameter *and* the rollout slice it
        # leaves behind until the bucket is consumed, so the peak (a bucket's gather buffers and
        # slices) stays within bucket_mb.
        def cost(i: int) -> int:
            s = self.plan.specs[i]
            return (s.numel + math.prod(local_shape(s, self.plan.rollout))) * self._esize(i)

        fused = self.plan.train.pp == 1  # one collective per group kind and bucket, not per parameter
        for bucket in self._buckets(idx, cost):
            out = []
            bufs, held = self._gather_bucket(bucket, local) if fused else ({}, 0)
            for i in bucket:
                buf = bufs.pop(i) if fused else self._gather(i, local, pp_bcast=True)
                t = self._extract(i, buf, self.rank)
                self.stats.alloc(_nbytes(t))
                out.append((self.plan.specs[i].name, t))
                if not fused:  # a fused bucket's buffer is one allocation, freed below
                    self._free_buf(i, buf, local)
                del buf
            self.stats.free(held)
            self.stats.buckets += 1
            yield out
            self.stats.free(sum(_nbytes(t) for _, t in out))
            del out
