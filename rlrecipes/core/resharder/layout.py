"""Train and rollout layouts, what slice of a parameter each rank holds, and the checks that refuse an
impossible pair before any process communicates."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlrecipes.core.param_spec import ParamSpec, stage_of_spec


STRATEGIES = ("allgather_naive", "allgather_swap", "alltoallv_experts", "tp_allgather_pp_alltoall")
#: strategies for disaggregated placement (train and rollout on disjoint ranks of one world)
CROSS_STRATEGIES = ("cross_alltoallv",)
AUTO = "auto"
PLACEMENTS = ("colocated", "disaggregated")


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


def _validate(train: Layout, rollout: Layout, specs: Sequence[ParamSpec], placement: str = "colocated") -> None:
    if placement not in PLACEMENTS:
        raise ReshardError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    if rollout.pp != 1:
        raise ReshardError(f"rollout layout must have pp=1, got pp={rollout.pp}")
    if placement == "colocated" and train.world != rollout.world:
        raise ReshardError(f"world sizes differ: train {train.describe()} has {train.world} ranks, "
                           f"rollout {rollout.describe()} has {rollout.world} (placement='disaggregated' puts "
                           f"them on disjoint ranks)")
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
