"""The :class:`Resharder`: constructor, ``reshard`` dispatch (and the one-rank path) and the plumbing the
strategies share (bucketing, dtypes, input checks, the group's collectives), over ``torch.distributed``,
yielding rollout shards bucket by bucket. The strategies themselves are mixins, one module per family:
``strategies_allgather.py``, ``strategies_pp.py``, ``strategies_experts.py``, ``strategies_cross.py``."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping

import torch

from rlrecipes.core.param_spec import ParamSpec

from .layout import AUTO, CROSS_STRATEGIES, Piece, ReshardError, STRATEGIES, local_shape, shard_for
from .plan import ReshardPlan, plan_reshard, reshard_bytes_summary
from .strategies_allgather import AllgatherStrategies
from .strategies_cross import CrossStrategies
from .strategies_experts import ExpertStrategies
from .strategies_pp import PipelineStrategies
from .transfer import HostSwap, ReshardStats, _dist, _groups_for


class Resharder(AllgatherStrategies, PipelineStrategies, ExpertStrategies, CrossStrategies):
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
        if plan.world == 1 or plan.identity:  # nobody to agree with: no data crosses ranks, so a
            # rank's bad shards fail that rank alone (no collective follows for the others to hang in)
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
        for the next (both rollout engines do): on a one-rank or identity plan they are the training shards
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
        if self.plan.identity:
            # every rank's rollout shard is its train shard (one rank included): no buffer, no
            # collective. The train tensors go out as views (cast when the rollout dtype
            # differs), in bucket-sized groups, and the consumer copies them into its own weights
            idx = list(range(len(self.plan.specs)))
            for bucket in self._buckets(idx, lambda i: local_shards[self.plan.specs[i].name].nbytes):
                self.stats.buckets += 1
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


__all__ = ["AUTO", "CROSS_STRATEGIES", "HostSwap", "Piece", "ReshardError", "ReshardPlan", "ReshardStats", "Resharder",
           "STRATEGIES", "local_shape", "plan_reshard", "reshard_bytes_summary", "reshard_to_dict", "shard_for"]
