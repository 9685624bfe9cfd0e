"""What slice of a parameter each rank of a layout (:class:`~rlrecipes.core.parallel.ParallelLayout`)
holds, and the checks that refuse an impossible train/rollout pair before any process communicates."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from rlrecipes.core.param_spec import ParamSpec
from rlrecipes.core.parallel import LayoutError, ParallelLayout


STRATEGIES = ("allgather_naive", "allgather_swap", "alltoallv_experts", "tp_allgather_pp_alltoall")
#: strategies for disaggregated placement (train and rollout on disjoint ranks of one world)
CROSS_STRATEGIES = ("cross_alltoallv",)
AUTO = "auto"
PLACEMENTS = ("colocated", "disaggregated")


class ReshardError(ValueError):
    """A train/rollout layout pair (or its inputs) that cannot be resharded."""


def _split_len(spec: ParamSpec) -> int:
    return spec.shape[spec.split_dim] if spec.split_dim is not None else spec.shape[0] if spec.shape else 1


def _row_numel(spec: ParamSpec) -> int:
    """Elements per index of the split dim (the whole tensor counts as one 'row' when not split)."""
    L = _split_len(spec)
    return spec.numel // L if L else 0


def _interval(spec: ParamSpec, layout: ParallelLayout, rank: int) -> tuple[int, int]:
    """[start, stop) along the split dim that ``rank`` holds (the whole tensor when not split)."""
    L, k = _split_len(spec), layout.chunks(spec)
    c = layout.chunk_index(spec, rank)
    n = L // k
    return c * n, (c + 1) * n


def shard_for(spec: ParamSpec, full: torch.Tensor, layout: ParallelLayout, rank: int) -> torch.Tensor | None:
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


def local_shape(spec: ParamSpec, layout: ParallelLayout) -> tuple[int, ...]:
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


def _validate(train: ParallelLayout, rollout: ParallelLayout, specs: Sequence[ParamSpec],
              placement: str = "colocated") -> None:
    if placement not in PLACEMENTS:
        raise ReshardError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    for which, lay in (("train", train), ("rollout", rollout)):
        try:
            lay.check()  # the layout rules (core/parallel.py): DP whole, EP divides a stage, the layer split
        except LayoutError as e:
            raise ReshardError(f"{which} layout: {e}") from None
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
                           f"param_specs(..., pp_layers=<{train.pp} stages>) or set the layout's pp_layers")
