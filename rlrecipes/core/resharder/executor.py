"""The :class:`Resharder`: the strategies over ``torch.distributed``, yielding rollout shards bucket by
bucket."""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Mapping

import torch

from rlrecipes.core.param_spec import ParamSpec

from .layout import AUTO, CROSS_STRATEGIES, Layout, Piece, ReshardError, STRATEGIES, _interval, _row_numel, _split_len, local_shape, shard_for
from .plan import ReshardPlan, plan_reshard, reshard_bytes_summary
from .transfer import HostSwap, ReshardStats, _aligned, _bytes_as, _dist, _groups_for, _nbytes, _pack


class Resharder:
    """Moves weights from the train layout to the rollout layout: on the same ranks (colocated), or
    from the train ranks to disjoint rollout ranks of one world (disaggregated plan).

    Args:
        plan: from :func:`plan_reshard`.
        strategy: one of :data:`STRATEGIES` or ``"auto"``: experts -- and TP-split parameters whose
            rollout TP is a multiple of the train TP -- via the ``alltoallv_experts`` path (owner to
            owner, exactly the plan minimum); the rest (TP down, replicated) via
            ``tp_allgather_pp_alltoall`` when train pp > 1, else ``allgather_swap``.
            ``alltoallv_experts`` moves the non-expert parameters like ``allgather_swap``.
            A disaggregated plan (:class:`ReshardPlan` with ``placement="disaggregated"``) takes
            ``cross_alltoallv`` (what ``auto`` picks there): per bucket one all-to-all-v over the
            whole group, every slice straight from a train holder to its rollout rank.
        bucket_mb: bucket size; a bucket is the set of parameters whose transient buffers on one rank
            add up to at most this (a single larger tensor forms its own bucket).
        group: the process group spanning the ``plan.world`` ranks (None: the default group,
            whose size must equal the world). Subgroups are created by all ranks of the default group.
            A disaggregated plan also takes a process-group object not registered with
            torch.distributed (e.g. a ``ProcessGroupGloo`` built over the run's store joining a
            train world and a rollout world); its own ``rank()`` / ``size()`` then give the ranks.
        dtype: dtype of the weights (torch.dtype or name -> dtype); None: inferred from the local
            shards and checked to agree across ranks (rollout-only ranks of a disaggregated plan,
            which pass no shards, learn it from the train ranks; a per-name mapping must be
            passed on every rank).
        device: where the received rollout shards are allocated; None: the device of the local
            shards (CPU when there are none -- pass it on rollout-only ranks of accelerators).
    """

    def __init__(self, plan: ReshardPlan, strategy: str = AUTO, bucket_mb: float = 256.0, group=None,
                 dtype: torch.dtype | Mapping[str, torch.dtype] | None = None,
                 device: torch.device | str | None = None):
        allowed = STRATEGIES + CROSS_STRATEGIES + (AUTO,)
        if strategy not in allowed:
            raise ReshardError(f"unknown reshard strategy {strategy!r}; choose one of {', '.join(allowed)}")
        cross = getattr(plan, "disaggregated", False)
        if cross and strategy not in CROSS_STRATEGIES + (AUTO,):
            raise ReshardError(f"strategy {strategy!r} reshards on one set of ranks, but the plan is disaggregated "
                               f"(train ranks {_span(plan.train_ranks)}, rollout ranks {_span(plan.rollout_ranks)}); "
                               f"use 'auto' or 'cross_alltoallv'")
        if not cross and strategy in CROSS_STRATEGIES:
            raise ReshardError(f"strategy {strategy!r} moves weights between disjoint train and rollout ranks, but "
                               f"the plan is colocated; build it with plan_reshard(..., placement='disaggregated') "
                               f"or use 'auto'")
        if bucket_mb <= 0:
            raise ReshardError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.plan, self.strategy, self.group = plan, strategy, group
        self._device = torch.device(device) if device is not None else None
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        self.dtype = dtype
        self.stats = ReshardStats()
        self._swap = HostSwap()

    # ---- swap -----------------------------------------------------------------------------
    def swap_out(self, params, grads: bool = False, optimizer=None) -> int:
        """Copy training params (and grads / optimizer state) to host and release their device storage."""
        return self._swap.swap_out(params, grads=grads, optimizer=optimizer)

    def swap_in(self) -> int:
        """Bring swapped tensors back (bit-exact) before the next update."""
        return self._swap.swap_in()

    @property
    def swapped_device_bytes(self) -> int:
        return self._swap.device_nbytes()

    # ---- helpers ----------------------------------------------------------------------------
    def _method(self, spec: ParamSpec) -> str:
        st = self.strategy
        if self.plan.disaggregated:
            return "cross_alltoallv"
        if st == AUTO:
            t, r = self.plan.train, self.plan.rollout
            # experts, and TP-split params whose rollout slice lies inside one train shard (TP up or
            # equal): straight from the owner, exactly the plan minimum, nothing gathered
            if spec.kind == "expert" or (spec.tp_dim is not None and r.chunks(spec) % t.chunks(spec) == 0):
                return "alltoallv_experts"
            return "tp_allgather_pp_alltoall" if t.pp > 1 else "allgather_swap"
        if st == "alltoallv_experts" and spec.kind != "expert":
            return "allgather_swap"
        return st

    def _dtype_of(self, name: str) -> torch.dtype:
        return self.dtype[name] if isinstance(self.dtype, Mapping) else self.dtype

    def _cast(self, t: torch.Tensor, i: int) -> torch.Tensor:
        dtype = self._dtype_of(self.plan.specs[i].name)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def _check_inputs(self, local: Mapping[str, torch.Tensor]) -> None:
        """Validate the local shards and agree on the outcome across ranks before moving data."""
        dist = _dist()
        plan, me = self.plan, self.rank
        err = ""
        dtypes = {t.dtype for t in local.values()}
        if self.dtype is None:
            if len(dtypes) > 1:
                err = f"rank {me}: local shards mix dtypes {sorted(map(str, dtypes))}; pass dtype={{name: dtype}}"
            elif dtypes:
                self.dtype = next(iter(dtypes))
        train_rank = me in plan.train_ranks
        if not train_rank and local:
            err = err or (f"rank {me} is a rollout-only rank of the disaggregated plan (train ranks "
                          f"{_span(plan.train_ranks)}) but got {len(local)} local shards; pass {{}}")
        for s in plan.specs:
            if not train_rank or plan.train.stage_of(s) != plan.train.coords(me)["pp"]:
                continue
            t = local.get(s.name)
            want = local_shape(s, plan.train)
            if t is None:
                err = err or f"rank {me}: local shard of {s.name} missing (train {plan.train.describe()})"
            elif tuple(t.shape) != want:
                err = err or f"rank {me}: {s.name} local shard has shape {list(t.shape)}, expected {list(want)}"
        if plan.world == 1:  # nobody to agree with
            if err:
                raise ReshardError(err)
            return
        if plan.disaggregated:
            # rollout-only ranks hold no shards: an unknown dtype (0) takes the train ranks' one
            code = 0 if self.dtype is None else _DTYPE_CODES.get(self.dtype, -1) \
                if isinstance(self.dtype, torch.dtype) else _MAPPING_CODE
            flag = torch.tensor([1 if err else 0, code, -code if code else -2 ** 40, 1 if code == 0 else 0],
                                dtype=torch.int64, device=self._comm_device(local))
            self._all_reduce_max(flag)
            flag = flag.cpu()
            known = int(flag[1])
            if flag[0] or (known and known != -flag[2]) or (flag[3] and known in (0, _MAPPING_CODE, -1)):
                raise ReshardError(err or "another rank rejected its local shards, or the ranks disagree on the dtype "
                                   "(pass the same dtype= on every rank, train and rollout)")
            if self.dtype is None:
                self.dtype = _CODE_DTYPES[known]
            return
        code = _DTYPE_CODES.get(self.dtype, -1) if isinstance(self.dtype, torch.dtype) else -2
        flag = torch.tensor([1 if err else 0, code, -code], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag[0] or flag[1] != -flag[2]:
            raise ReshardError(err or "another rank rejected its local shards, or the ranks disagree on the dtype "
                               "(pass dtype= explicitly)")

    def _all_reduce_max(self, t: torch.Tensor) -> None:
        dist = _dist()
        if self._raw:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self.group.allreduce([t], opts).wait()
        else:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits) -> None:
        dist = _dist()
        if self._raw:
            self.group.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()).wait()
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def _comm_device(self, local: Mapping[str, torch.Tensor]) -> torch.device:
        if self._device is not None:
            return self._device
        return next(iter(local.values())).device if local else torch.device("cpu")

    def _buckets(self, idx: list[int], cost) -> list[list[int]]:
        out, cur, acc = [], [], 0
        for i in idx:
            c = cost(i)
            if cur and acc + c > self.bucket_bytes:
                out.append(cur)
                cur, acc = [], 0
            cur.append(i)
            acc += c
        if cur:
            out.append(cur)
        return out

    def _esize(self, i: int) -> int:
        return torch.empty((), dtype=self._dtype_of(self.plan.specs[i].name)).element_size()

    # ---- entry point ------------------------------------------------------------------------
    def reshard(self, local_shards: Mapping[str, torch.Tensor]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield this rank's rollout shards, bucket by bucket, as ``[(name, tensor), ...]``.

        ``local_shards`` maps name -> this rank's train-layout shard (parameters of other pipeline
        stages absent). The consumer copies each bucket's tensors into its own weights before asking
        for the next (both rollout engines do): on a one-rank plan they are the training shards
        themselves (views; cast when the dtypes differ), elsewhere fresh buffers. Every rank must
        drain the iterator.
        """
        dist = _dist()
        self._raw = self.plan.disaggregated and _unregistered(self.group)
        if not self._raw and not dist.is_initialized():
            raise ReshardError("torch.distributed is not initialised")
        ws = self.group.size() if self._raw else dist.get_world_size(self.group)
        if ws != self.plan.world:
            raise ReshardError(f"process group has {ws} ranks, plan world is {self.plan.world}"
                               + (f" (train {self.plan.train.world} + rollout {self.plan.rollout.world} ranks)"
                                  if self.plan.disaggregated else ""))
        self.rank = self.group.rank() if self._raw else dist.get_rank(self.group)
        # a disaggregated plan needs no subgroups (one all-to-all-v over the whole group)
        self._pg = None if self.plan.disaggregated else _groups_for(self.plan.train, self.group)
        self._check_inputs(local_shards)
        self.device = self._comm_device(local_shards)
        self.stats = ReshardStats()
        if self.plan.world == 1:
            # one rank: each rollout shard is the whole tensor, which is the train shard itself. No
            # buffer, no collective: the train tensors go out as views (cast when the rollout dtype
            # differs), in bucket-sized groups, and the consumer copies them into its own weights
            idx = list(range(len(self.plan.specs)))
            for bucket in self._buckets(idx, lambda i: local_shards[self.plan.specs[i].name].nbytes):
                yield [(self.plan.specs[i].name, self._cast(local_shards[self.plan.specs[i].name], i)) for i in bucket]
            return
        by_method: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(self.plan.specs):
            by_method[self._method(s)].append(i)
        # fixed order so every rank runs the same collectives
        for m in ("alltoallv_experts", "allgather_naive", "allgather_swap", "tp_allgather_pp_alltoall",
                  "cross_alltoallv"):
            if by_method.get(m):
                st = self.stats
                sent0, recv0, st._phase_peak = st.sent_bytes, st.recv_bytes, st.live_bytes
                yield from getattr(self, "_run_" + m)(by_method[m], local_shards)
                st.phases[m] = {"sent": st.sent_bytes - sent0, "recv": st.recv_bytes - recv0, "peak": st._phase_peak}

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
        # leaves behind until the bucket is consumed, so the peak (one bucket of slices plus one
        # gather buffer) stays within bucket_mb.
        def cost(i: int) -> int:
            s = self.plan.specs[i]
            return (s.numel + math.prod(local_shape(s, self.plan.rollout))) * self._esize(i)

        for bucket in self._buckets(idx, cost):
            out = []
            for i in bucket:
                buf = self._gather(i, local, pp_bcast=True)
                t = self._extract(i, buf, self.rank)
                self.stats.alloc(_nbytes(t))
                out.append((self.plan.specs[i].name, t))
                self._free_buf(i, buf, local)
                del buf
            self.stats.buckets += 1
            yield out
            self.stats.free(sum(_nbytes(t) for _, t in out))
            del out

    # ---- tp_allgather_pp_alltoall -------------------------------------------------------------
    def _pp_rounds(self, per_stage: list[list[int]]) -> list[list[list[int]]]:
        """Rounds of the PP all-to-all: ``rounds[k][stage]`` = that stage's parameters in round k.

        Every stage contributes to every round, and a round is budgeted by what it keeps alive on
        any rank until it is consumed: on a rank of the parameter's stage its own rollout slice plus
        the slices it sends to its PP peers, on every other rank the slice it receives. Costs are
        maxima over ranks, so every rank computes the same rounds (the TP/EP gathers inside a stage
        stay in one order across PP groups). Parameters are gathered one at a time and the gather
        buffer is budgeted too, so the peak stays within one bucket (a single larger parameter
        forms its own round).
        """
        t, W, S = self.plan.train, self.plan.train.world, self.plan.train.stage_size

        def send_cost(i: int) -> int:
            return max(sum(self._roll_nbytes(i, st * S + loc) for st in range(t.pp)) for loc in range(S))

        def recv_cost(i: int) -> int:
            return max(self._roll_nbytes(i, r) for r in range(W))

        def gather_cost(i: int) -> int:  # the TP/EP all-gather buffer, when it is not the output itself
            sp = self.plan.specs[i]
            return sp.numel * self._esize(i) if t.chunks(sp) > 1 and not self._gathered_is_rollout(i) else 0

        queues = [list(lst) for lst in per_stage]
        heads = [0] * t.pp
        rounds: list[list[list[int]]] = []
        while any(h < len(q) for h, q in zip(heads, queues)):
            # per stage's ranks: S = own + sent slices (alive all round), R = received slices (with S
            # at the all-to-all), G = the largest gather buffer (with S while gathering)
            S_, R_, G_ = [0] * t.pp, [0] * t.pp, [0] * t.pp
            chosen, empty, grew = [[] for _ in range(t.pp)], True, True
            while grew:
                grew = False
                for st in range(t.pp):
                    if heads[st] >= len(queues[st]):
                        continue
                    i = queues[st][heads[st]]
                    S2, R2, G2 = list(S_), list(R_), list(G_)
                    S2[st] += send_cost(i)
                    G2[st] = max(G2[st], gather_cost(i))
                    rc = recv_cost(i)
                    for r in range(t.pp):
                        if r != st:
                            R2[r] += rc
                    if not empty and any(a + max(b, c) > self.bucket_bytes for a, b, c in zip(S2, R2, G2)):
                        continue
                    S_, R_, G_ = S2, R2, G2
                    chosen[st].append(i)
                    heads[st] += 1
                    empty, grew = False, True
            rounds.append(chosen)
        return rounds

    def _gathered_is_rollout(self, i: int) -> bool:
        """The rollout keeps this parameter whole and the train layout splits it along dim 0: the
        gathered chunks buffer ``[k, *chunk]`` already is the rollout tensor (no copy needed)."""
        s = self.plan.specs[i]
        return self.plan.rollout.chunks(s) == 1 and self.plan.train.chunks(s) > 1 and s.split_dim == 0

    def _run_tp_allgather_pp_alltoall(self, idx, local):
        dist = _dist()
        plan, t, me = self.plan, self.plan.train, self.rank
        if t.pp == 1:
            yield from self._run_allgather_swap(idx, local)
            return
        per_stage = [[i for i in idx if t.stage_of(plan.specs[i]) == s] for s in range(t.pp)]
        pg, peers = self._pg["pp"][me]
        my_stage = t.coords(me)["pp"]
        for chosen in self._pp_rounds(per_stage):
            mine = chosen[my_stage]
            # the packed send buffer (peer-major), sized from the plan before anything is gathered
            in_splits, where = [], {}
            off = 0
            for s, peer in enumerate(peers):
                start = off
                if s != my_stage:
                    for i in mine:
                        nb = self._roll_nbytes(i, peer)
                        where[(i, peer)] = (off, nb)
                        off += nb
                in_splits.append(off - start)
            sendbuf = torch.empty(off, dtype=torch.uint8, device=self.device)
            self.stats.alloc(_nbytes(sendbuf))
            out = []
            for i in mine:  # one gathered parameter at a time: own slice kept, peers' slices packed
                buf = self._gather(i, local, pp_bcast=False)  # TP / EP all-gather inside the stage
                whole = self._gathered_is_rollout(i)
                own = buf.view(local_shape(plan.specs[i], plan.rollout)) if whole else self._extract(i, buf, me)
                if not whole:
                    self.stats.alloc(_nbytes(own))
                out.append((plan.specs[i].name, own))
                for s, peer in enumerate(peers):
                    if s != my_stage:
                        o, nb = where[(i, peer)]
                        self._extract(i, buf, peer, into=sendbuf[o:o + nb])
                if not whole:  # (whole: the buffer lives on as this rank's output)
                    self._free_buf(i, buf, local)
                del buf
            own_bytes = sum(_nbytes(x) for _, x in out)
            out_splits, recv_layout = [], []
            for s, peer in enumerate(peers):
                theirs = chosen[s] if s != my_stage else []
                for i in theirs:
                    recv_layout.append((i, self._roll_nbytes(i, me)))
                out_splits.append(sum(nb for i, nb in recv_layout[len(recv_layout) - len(theirs):]))
            recvbuf = torch.empty(sum(out_splits), dtype=torch.uint8, device=self.device)
            self.stats.alloc(_nbytes(recvbuf))
            dist.all_to_all_single(recvbuf, sendbuf, out_splits, in_splits, group=pg)
            self.stats.collectives += 1
            self.stats.sent_bytes += _nbytes(sendbuf)
            self.stats.recv_bytes += _nbytes(recvbuf)
            self.stats.free(_nbytes(sendbuf))
            del sendbuf
            off = 0
            for i, nb in recv_layout:
                s = plan.specs[i]
                out.append((s.name, _bytes_as(recvbuf[off:off + nb], self._dtype_of(s.name), local_shape(s, plan.rollout))))
                off += nb
            self.stats.buckets += 1
            yield out  # received tensors are views of recvbuf: it is the bucket's output memory
            self.stats.free(_nbytes(recvbuf) + own_bytes)
            del out, recvbuf

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


_DTYPE_CODES = {dt: n + 1 for n, dt in enumerate(
    [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64])}
_CODE_DTYPES = {n: dt for dt, n in _DTYPE_CODES.items()}
_MAPPING_CODE = 100


def _unregistered(group) -> bool:
    """A process-group object torch.distributed does not know (not part of its default world)."""
    if group is None:
        return False
    dist = _dist()
    if not dist.is_initialized():
        return True
    try:
        dist.get_rank(group)  # (get_world_size does not check registration)
    except (ValueError, RuntimeError):
        return True
    return False


def _span(ranks: range) -> str:
    return f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start)


def reshard_to_dict(resharder: Resharder, local_shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convenience: drain :meth:`Resharder.reshard` into one dict (name -> rollout shard)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in resharder.reshard(local_shards):
        out.update(bucket)
    return out


__all__ = ["AUTO", "CROSS_STRATEGIES", "HostSwap", "Layout", "Piece", "ReshardError", "ReshardPlan", "ReshardStats", "Resharder",
           "STRATEGIES", "local_shape", "plan_reshard", "reshard_bytes_summary", "reshard_to_dict", "shard_for"]
