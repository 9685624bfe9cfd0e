"""Resharding of trained weights from the train layout to the rollout layout (DESIGN §3.2).

Three layers, each usable alone:

1. :class:`Layout` and :func:`plan_reshard` -- a *pure* plan. From the train layout
   ``(tp, pp, ep, dp)``, the rollout layout ``(tp, ep, dp)`` (pp = 1) and the parameter specs
   (:mod:`rlrecipes.models.sharding`) it computes, for every rank, which slices it keeps locally,
   receives (from whom) and sends (to whom), with bytes. Every impossible pair raises
   :class:`ReshardError` here, before any process communicates. :func:`reshard_bytes_summary`
   gives per-rank byte figures for real model sizes (DeepSeek-V3 on 256 ranks) by aggregating
   parameters into classes instead of enumerating transfers.
2. :class:`Resharder` -- executors over ``torch.distributed`` (gloo / nccl / hccl): the strategies
   in :data:`STRATEGIES` plus ``auto``. ``Resharder.reshard(local_shards)`` yields the rollout
   shards bucket by bucket, so a rollout engine loads them as they arrive.
3. ``Resharder.swap_out`` / ``swap_in`` -- move training weights, grads and optimizer state to host
   memory and release their device storage (``untyped_storage().resize_(0)``), then bring them back
   bit-exactly before the next update.

Rank order and sharding follow ``docs/conventions.md``:
``rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank``, ``ep_rank = (dp_rank * tp + tp_rank) % ep``,
TP shards are equal contiguous chunks along ``tp_dim``, experts are chunks of dim 0 over EP.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from rlrecipes.core.swap import SwappedStorages
from rlrecipes.core.param_spec import ParamSpec, stage_of_spec

STRATEGIES = ("allgather_naive", "allgather_swap", "alltoallv_experts", "tp_allgather_pp_alltoall")
AUTO = "auto"


class ReshardError(ValueError):
    """A train/rollout layout pair (or its inputs) that cannot be resharded."""


# =============================================================================================
# layouts
@dataclass(frozen=True)
class Layout:
    """A parallel layout over ``world = tp * pp * dp`` ranks (EP carved out of ``dp * tp``).

    Attributes:
        tp: tensor-parallel size.
        pp: pipeline-parallel size (rollout layouts use 1).
        ep: expert-parallel size; divides ``dp * tp``.
        dp: data-parallel size.
        pp_layers: layers per pipeline stage; None = the specs' own ``pp_stage`` is used.
    """

    tp: int
    pp: int = 1
    ep: int = 1
    dp: int = 1
    pp_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        for k in ("tp", "pp", "ep", "dp"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ReshardError(f"layout {k}={v!r}: must be a positive integer")
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(int(n) for n in self.pp_layers))
            if len(self.pp_layers) != self.pp:
                raise ReshardError(f"layout pp={self.pp} but pp_layers {list(self.pp_layers)} has "
                                   f"{len(self.pp_layers)} stages")
        if (self.dp * self.tp) % self.ep:
            raise ReshardError(f"layout {self}: ep={self.ep} must divide dp*tp={self.dp * self.tp}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage (dp * tp)."""
        return self.dp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """{'pp', 'dp', 'tp', 'ep'} coordinates of a rank (Megatron order: TP fastest, then DP, then PP)."""
        if not 0 <= rank < self.world:
            raise ReshardError(f"rank {rank} outside layout world {self.world}")
        loc = rank % self.stage_size
        return {"pp": rank // self.stage_size, "dp": loc // self.tp, "tp": loc % self.tp, "ep": loc % self.ep}

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return pp * self.stage_size + dp * self.tp + tp

    def stage_of(self, spec: ParamSpec) -> int:
        """Pipeline stage of a parameter in this layout."""
        if self.pp == 1:
            return 0
        if self.pp_layers is not None:
            return stage_of_spec(spec, self.pp_layers)
        return spec.pp_stage

    def chunks(self, spec: ParamSpec) -> int:
        """Number of chunks this layout cuts ``spec`` into along ``spec.split_dim``."""
        if spec.kind == "expert":
            return self.ep
        return self.tp if spec.tp_dim is not None else 1

    def chunk_index(self, spec: ParamSpec, rank: int) -> int:
        c = self.coords(rank)
        if spec.kind == "expert":
            return c["ep"]
        return c["tp"] if spec.tp_dim is not None else 0

    def describe(self) -> str:
        s = f"TP{self.tp}"
        if self.pp > 1:
            s += f" PP{self.pp}"
        if self.ep > 1:
            s += f" EP{self.ep}"
        return s + f" DP{self.dp}"


def _split_len(spec: ParamSpec) -> int:
    return spec.shape[spec.split_dim] if spec.split_dim is not None else spec.shape[0] if spec.shape else 1


def _row_numel(spec: ParamSpec) -> int:
    """Elements per index of the split dim (the whole tensor counts as one 'row' when not split)."""
    L = _split_len(spec)
    return spec.numel // L if L else 0


def _interval(spec: ParamSpec, layout: Layout, rank: int) -> tuple[int, int]:
    """[start, stop) along the split dim that ``rank`` holds (the whole tensor when not split)."""
    L, k = _split_len(spec), layout.chunks(spec)
    c = layout.chunk_index(spec, rank)
    n = L // k
    return c * n, (c + 1) * n


def shard_for(spec: ParamSpec, full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor | None:
    """The slice of the full tensor that ``rank`` holds in ``layout`` (None: not on its pipeline stage).

    A view of ``full``; clone it if the full tensor is going away.
    """
    if tuple(full.shape) != spec.shape:
        raise ReshardError(f"{spec.name}: full tensor has shape {list(full.shape)}, spec says {list(spec.shape)}")
    if layout.stage_of(spec) != layout.coords(rank)["pp"]:
        return None
    if spec.split_dim is None:
        return full
    a, b = _interval(spec, layout, rank)
    return full.narrow(spec.split_dim, a, b - a)


def local_shape(spec: ParamSpec, layout: Layout) -> tuple[int, ...]:
    shape = list(spec.shape)
    if spec.split_dim is not None:
        shape[spec.split_dim] //= layout.chunks(spec)
    return tuple(shape)


# =============================================================================================
# the plan
class Piece(NamedTuple):
    """One contiguous slice of parameter ``spec`` along its split dim moving ``src`` -> ``dst``."""

    spec: int  # index into plan.specs
    src: int
    dst: int
    start: int  # [start, stop) along the split dim, global indices
    stop: int
    numel: int


def _validate(train: Layout, rollout: Layout, specs: Sequence[ParamSpec]) -> None:
    if rollout.pp != 1:
        raise ReshardError(f"rollout layout must have pp=1, got pp={rollout.pp}")
    if train.world != rollout.world:
        raise ReshardError(f"world sizes differ: train {train.describe()} has {train.world} ranks, "
                           f"rollout {rollout.describe()} has {rollout.world}")
    if not specs:
        raise ReshardError("no parameter specs")
    names = set()
    max_stage = 0
    for s in specs:
        if s.name in names:
            raise ReshardError(f"duplicate parameter spec {s.name!r}")
        names.add(s.name)
        stage = train.stage_of(s)
        if not 0 <= stage < train.pp:
            raise ReshardError(f"{s.name}: pipeline stage {stage} outside train pp={train.pp}; "
                               f"build the specs with pp_layers for {train.pp} stages")
        max_stage = max(max_stage, stage)
        if s.split_dim is None:
            continue
        L = _split_len(s)
        for which, lay in (("train", train), ("rollout", rollout)):
            k = lay.chunks(s)
            par = "ep" if s.kind == "expert" else "tp"
            units = L // s.unit if s.unit and L % s.unit == 0 else L
            uname = s.unit_name if s.unit and L % s.unit == 0 else "rows"
            if units % k:
                raise ReshardError(f"{s.name}: {units} {uname} (dim {s.split_dim} of shape {list(s.shape)}) "
                                   f"cannot be split over {which} {par}={k}")
    if train.pp > 1 and max_stage != train.pp - 1:
        raise ReshardError(f"train pp={train.pp} but the specs only reach stage {max_stage}: build them with "
                           f"param_specs(..., pp_layers=<{train.pp} stages>) or set Layout.pp_layers")


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


# =============================================================================================
# process groups (created by every rank in the same order, cached)
_GROUPS: dict[tuple, Any] = {}


def _dist():
    import torch.distributed as dist

    return dist


def _groups_for(train: Layout, group) -> dict[str, dict[int, Any]]:
    """{'tp': {rank: pg}, 'ep': {...}, 'pp': {...}} for the train layout, built once per world.

    Every rank of the default group calls ``new_group`` for every subgroup in one fixed order,
    as torch.distributed requires; subgroups of size 1 are None.
    """
    dist = _dist()
    W = train.world
    glob = [dist.get_global_rank(group, i) if group is not None else i for i in range(W)]
    key = (id(dist.group.WORLD), train.tp, train.pp, train.ep, train.dp, tuple(glob))
    if key in _GROUPS:
        return _GROUPS[key]
    S = train.stage_size
    out: dict[str, dict[int, Any]] = {"tp": {}, "ep": {}, "pp": {}}
    families = {
        "tp": [[s * S + d * train.tp + t for t in range(train.tp)] for s in range(train.pp) for d in range(train.dp)],
        "ep": [[s * S + b * train.ep + e for e in range(train.ep)] for s in range(train.pp)
               for b in range(S // train.ep)],
        "pp": [[s * S + loc for s in range(train.pp)] for loc in range(S)],
    }
    for kind, lists in families.items():
        for ranks in lists:
            pg = None
            if len(ranks) > 1:
                pg = dist.new_group([glob[r] for r in ranks])
            for r in ranks:
                out[kind][r] = (pg, ranks)
    _GROUPS[key] = out
    return out


# =============================================================================================
# host swap
class HostSwap:
    """Swap training params (and optionally grads and optimizer state) to host and back.

    Collects the tensors, then delegates to :class:`rlrecipes.core.swap.SwappedStorages` (the same
    storage-level swap the native engines use): on accelerators the host buffers are pinned; on CPU
    host and "device" are the same RAM, but the storage is still really released
    (``untyped_storage().nbytes() == 0``) and restored bit-exactly.
    """

    def __init__(self):
        self._swapped: SwappedStorages | None = None

    @staticmethod
    def _collect(params, grads: bool, optimizer) -> list[torch.Tensor]:
        if isinstance(params, torch.nn.Module):
            tensors = list(params.parameters())
        elif isinstance(params, Mapping):
            tensors = list(params.values())
        else:
            tensors = list(params)
        out = list(tensors)
        if grads:
            out += [t.grad for t in tensors if getattr(t, "grad", None) is not None]
        if optimizer is not None:
            for st in optimizer.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def swap_out(self, params, grads: bool = False, optimizer=None) -> int:
        """Move to host and release; returns the bytes released."""
        if self._swapped is not None:
            raise RuntimeError("swap_out called twice without swap_in")
        tensors = self._collect(params, grads, optimizer)
        device = next((t.device for t in tensors), torch.device("cpu"))
        swapped = SwappedStorages(tensors, device)
        self._swapped = swapped if swapped.saved else None
        return swapped.nbytes

    @property
    def swapped(self) -> bool:
        return self._swapped is not None

    def device_nbytes(self) -> int:
        """Bytes the swapped storages occupy on the device now (0 after swap_out)."""
        return self._swapped.device_nbytes() if self._swapped is not None else 0

    def swap_in(self) -> int:
        """Restore every swapped storage in place (same tensors, same values); returns bytes restored."""
        if self._swapped is None:
            return 0
        n, self._swapped = self._swapped.restore(), None
        return n


# =============================================================================================
# executors
@dataclass
class ReshardStats:
    """Logical traffic and executor-tracked transient memory of the last ``reshard`` call on this rank.

    ``sent_bytes`` / ``recv_bytes`` count payload leaving / arriving at this rank (an all-gather of
    group g and chunk c: (g-1)*c each way; a broadcast: (g-1)*B sent by the root, B received by
    the others; all-to-all-v: the off-diagonal splits). ``peak_transient_bytes`` is the high-water
    mark of buffers the executor itself allocated (gather buffers, packed send/recv buffers and
    the rollout tensors not yet handed out).
    """

    sent_bytes: int = 0
    recv_bytes: int = 0
    live_bytes: int = 0
    peak_transient_bytes: int = 0
    buckets: int = 0
    collectives: int = 0
    phases: dict = field(default_factory=dict)  # method -> {"sent", "recv", "peak"} for the specs it moved
    _phase_peak: int = 0

    def alloc(self, n: int) -> None:
        self.live_bytes += n
        self.peak_transient_bytes = max(self.peak_transient_bytes, self.live_bytes)
        self._phase_peak = max(self._phase_peak, self.live_bytes)

    def free(self, n: int) -> None:
        self.live_bytes -= n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(raw: torch.Tensor, dtype: torch.dtype) -> bool:
    return raw.storage_offset() % torch.empty((), dtype=dtype).element_size() == 0


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """Read a 1-D uint8 slice as ``dtype`` with ``shape`` (a view; a copy when the offset is misaligned)."""
    if not _aligned(raw, dtype):
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def _pack(raw: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` into the 1-D uint8 slice ``raw`` (exactly its bytes)."""
    if _aligned(raw, src.dtype):
        raw.view(src.dtype).view(src.shape).copy_(src)
    else:
        raw.copy_(src.contiguous().reshape(-1).view(torch.uint8))


class Resharder:
    """Moves weights from the train layout to the rollout layout on the same ranks.

    Args:
        plan: from :func:`plan_reshard`.
        strategy: one of :data:`STRATEGIES` or ``"auto"``: experts -- and TP-split parameters whose
            rollout TP is a multiple of the train TP -- via the ``alltoallv_experts`` path (owner to
            owner, exactly the plan minimum); the rest (TP down, replicated) via
            ``tp_allgather_pp_alltoall`` when train pp > 1, else ``allgather_swap``.
            ``alltoallv_experts`` moves the non-expert parameters like ``allgather_swap``.
        bucket_mb: bucket size; a bucket is the set of parameters whose transient buffers on one rank
            add up to at most this (a single larger tensor forms its own bucket).
        group: the process group spanning the ``plan.train.world`` ranks (None: the default group,
            whose size must equal the world). Subgroups are created by all ranks of the default group.
        dtype: dtype of the weights (torch.dtype or name -> dtype); None: inferred from the local
            shards and checked to agree across ranks.
    """

    def __init__(self, plan: ReshardPlan, strategy: str = AUTO, bucket_mb: float = 256.0, group=None,
                 dtype: torch.dtype | Mapping[str, torch.dtype] | None = None):
        if strategy not in STRATEGIES + (AUTO,):
            raise ReshardError(f"unknown reshard strategy {strategy!r}; choose one of {', '.join(STRATEGIES + (AUTO,))}")
        if bucket_mb <= 0:
            raise ReshardError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.plan, self.strategy, self.group = plan, strategy, group
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
        for s in plan.specs:
            if plan.train.stage_of(s) != plan.train.coords(me)["pp"]:
                continue
            t = local.get(s.name)
            want = local_shape(s, plan.train)
            if t is None:
                err = err or f"rank {me}: local shard of {s.name} missing (train {plan.train.describe()})"
            elif tuple(t.shape) != want:
                err = err or f"rank {me}: {s.name} local shard has shape {list(t.shape)}, expected {list(want)}"
        code = _DTYPE_CODES.get(self.dtype, -1) if isinstance(self.dtype, torch.dtype) else -2
        flag = torch.tensor([1 if err else 0, code, -code], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag[0] or flag[1] != -flag[2]:
            raise ReshardError(err or "another rank rejected its local shards, or the ranks disagree on the dtype "
                               "(pass dtype= explicitly)")

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
        stages absent). Yielded tensors are fresh (never views of the training weights), so the
        training weights may be swapped out afterwards. Every rank must drain the iterator.
        """
        dist = _dist()
        if not dist.is_initialized():
            raise ReshardError("torch.distributed is not initialised")
        ws = dist.get_world_size(self.group)
        if ws != self.plan.train.world:
            raise ReshardError(f"process group has {ws} ranks, plan world is {self.plan.train.world}")
        self.rank = dist.get_rank(self.group)
        self._pg = _groups_for(self.plan.train, self.group)
        self._check_inputs(local_shards)
        self.device = next(iter(local_shards.values())).device if local_shards else torch.device("cpu")
        self.stats = ReshardStats()
        by_method: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(self.plan.specs):
            by_method[self._method(s)].append(i)
        # fixed order so every rank runs the same collectives
        for m in ("alltoallv_experts", "allgather_naive", "allgather_swap", "tp_allgather_pp_alltoall"):
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
    def _run_tp_allgather_pp_alltoall(self, idx, local):
        dist = _dist()
        plan, t, me = self.plan, self.plan.train, self.rank
        if t.pp == 1:
            yield from self._run_allgather_swap(idx, local)
            return
        per_stage = [[i for i in idx if t.stage_of(plan.specs[i]) == s] for s in range(t.pp)]
        cost = lambda i: plan.specs[i].numel * self._esize(i)  # noqa: E731
        buckets = [self._buckets(lst, cost) for lst in per_stage]
        rounds = max(len(b) for b in buckets)
        pg, peers = self._pg["pp"][me]
        my_stage = t.coords(me)["pp"]
        for k in range(rounds):
            mine = buckets[my_stage][k] if k < len(buckets[my_stage]) else []
            bufs = {i: self._gather(i, local, pp_bcast=False) for i in mine}  # TP / EP all-gather in the stage
            out = [(plan.specs[i].name, self._extract(i, bufs[i], me)) for i in mine]
            own_bytes = sum(_nbytes(t) for _, t in out)
            self.stats.alloc(own_bytes)
            # one all-to-all over the PP group: every peer gets its rollout slice of my bucket,
            # extracted straight into the packed send buffer
            in_splits = []
            for s, peer in enumerate(peers):
                in_splits.append(0 if s == my_stage else sum(self._roll_nbytes(i, peer) for i in mine))
            sendbuf = torch.empty(sum(in_splits), dtype=torch.uint8, device=self.device)
            self.stats.alloc(_nbytes(sendbuf))
            off = 0
            for s, peer in enumerate(peers):
                if s == my_stage:
                    continue
                for i in mine:
                    nb = self._roll_nbytes(i, peer)
                    self._extract(i, bufs[i], peer, into=sendbuf[off:off + nb])
                    off += nb
            for i in mine:
                self._free_buf(i, bufs.pop(i), local)
            out_splits, recv_layout = [], []
            for s, peer in enumerate(peers):
                theirs = buckets[s][k] if (s != my_stage and k < len(buckets[s])) else []
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
            # pack: destination-major, then (spec, start) order -- the receiver unpacks in the same order
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
                    ta, _ = _interval(s, plan.train, me)
                    piece = local[s.name].narrow(s.split_dim, p.start - ta, p.stop - p.start) \
                        if s.split_dim is not None else local[s.name]
                    _pack(sendbuf[off:off + nb], piece)
                    off += nb
            per_src = defaultdict(list)
            for i in bucket:
                for p in recvs.get(i, ()):
                    per_src[p.src].append(p)
            out_splits, order = [], []
            for src in range(W):
                lst = sorted(per_src.get(src, ()), key=lambda p: (p.spec, p.start))
                order += lst
                out_splits.append(sum(p.numel * self._esize(p.spec) for p in lst))
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


_DTYPE_CODES = {dt: n + 1 for n, dt in enumerate(
    [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64])}


def reshard_to_dict(resharder: Resharder, local_shards: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Convenience: drain :meth:`Resharder.reshard` into one dict (name -> rollout shard)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in resharder.reshard(local_shards):
        out.update(bucket)
    return out


__all__ = ["AUTO", "HostSwap", "Layout", "Piece", "ReshardError", "ReshardPlan", "ReshardStats", "Resharder",
           "STRATEGIES", "local_shape", "plan_reshard", "reshard_bytes_summary", "reshard_to_dict", "shard_for"]
