"""The ``tp_allgather_pp_alltoall`` strategy of :class:`~.executor.Resharder`: TP / EP all-gather
inside each pipeline stage, then one all-to-all-v over the PP group per round."""
from __future__ import annotations

import torch

from .layout import local_shape
from .transfer import _bytes_as, _dist, _nbytes


class PipelineStrategies:
    """Mixin of :class:`~.executor.Resharder`: the PP rounds and their all-to-all. Uses the gather
    helpers of :class:`~.strategies_allgather.AllgatherStrategies` (and ``allgather_swap`` when the
    train pp is 1)."""

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
