"""Reshard traffic of ``rlrecipes plan``: the weight bytes a device receives (and, disaggregated,
sends) when the trained weights move from the actor layout to the rollout layout each step.

With ``actor.lora`` only the adapter tensors move (the rollout loads the base once):
:func:`lora_reshard` runs the resharder's own plan over the adapters' specs (the names and shapes
PEFT creates, :func:`rlrecipes.models.lora_shapes.lora_shapes`), and :func:`full_reshard` gives
what a full-weight sync of the same layouts would move, for the ratio ``plan`` prints."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..models import ModelDims
from ..core.parallel import ParallelLayout
from .memory import DTYPE_BYTES, rollout_params_per_device


@dataclass
class ReshardVolume:
    """One per-step weight sync, in bytes."""

    received: float = 0.0
    """The most bytes any device receives (colocated: its rollout shard minus what its train shard holds)."""
    sent: float = 0.0
    """Disaggregated: the most bytes a train device sends (0 colocated)."""
    loaded: float = 0.0
    """The most bytes a rollout device loads into its engine (``update_weights``): its rollout shard."""
    method: str = "estimate"


def reshard_bytes(dims: ModelDims, train: ParallelLayout, rollout: ParallelLayout,
                  placement: str = "colocated") -> float:
    """Bytes one device receives per step: its rollout shard minus what its train shard already holds
    (disaggregated: the whole rollout shard, the rollout device holds no train shard).

    Assumes nested, aligned shards (TP/EP sizes divide each other), the layout the resharder plans.
    """
    total, experts = dims.total_params(), dims.expert_params()
    dense = total - experts
    need = rollout_params_per_device(dims, rollout)
    if placement == "disaggregated":
        return need * DTYPE_BYTES
    held = dense / train.pp / max(train.tp, rollout.tp) + experts / train.pp / max(train.ep, rollout.ep)
    return max(0.0, need - held) * DTYPE_BYTES


def _volume(s: dict) -> ReshardVolume:
    return ReshardVolume(float(s["max_min_recv_bytes"]), float(s.get("max_send_bytes", 0.0)),
                         float(s["max_rollout_shard_bytes"]), "resharder plan")


def full_reshard(dims: ModelDims, train: ParallelLayout, rollout: ParallelLayout,
                 placement: str = "colocated") -> ReshardVolume:
    """A full-weight sync: the resharder's own plan over every parameter (aggregated by parameter
    class); the analytic estimate of :func:`reshard_bytes` when the resharder rejects the pair."""
    from ..core.resharder import ReshardError
    from ..models.sharding import reshard_bytes_summary

    try:
        return _volume(reshard_bytes_summary(train, rollout, dims, train.pp_layers, dtype_bytes=DTYPE_BYTES,
                                             placement=placement))
    except ReshardError:
        recv = reshard_bytes(dims, train, rollout, placement)
        loaded = rollout_params_per_device(dims, rollout) * DTYPE_BYTES
        return ReshardVolume(recv, recv * rollout.world / train.world if placement == "disaggregated" else 0.0,
                             loaded, "estimate")


def exact_reshard_bytes(dims: ModelDims, train: ParallelLayout, rollout: ParallelLayout,
                        placement: str = "colocated") -> tuple[float, str, float]:
    """Max bytes any device receives, from the resharder's own plan (aggregated by parameter class),
    the method, and (disaggregated) the most bytes a train device sends. Falls back to
    :func:`reshard_bytes` when the resharder rejects the pair."""
    v = full_reshard(dims, train, rollout, placement)
    return v.received, v.method, v.sent


def lora_specs(dims: ModelDims, lora: Any) -> list:
    """The resharder's specs of the adapter tensors (replicated: synced whole). ``ValueError`` where
    PEFT refuses the targets, or the resharder has no rule for a tensor PEFT creates."""
    dropout = float(getattr(lora, "dropout", 0.0) or 0.0) > 0
    return list(_lora_specs(dims, int(lora.rank), tuple(lora.target_modules), dropout))


@functools.lru_cache(maxsize=64)  # plan's nearest-node search plans the same recipe many times
def _lora_specs(dims: ModelDims, rank: int, targets: tuple[str, ...], dropout: bool) -> tuple:
    from types import SimpleNamespace

    from ..models import param_specs
    from ..models.lora_shapes import lora_shapes

    lora = SimpleNamespace(rank=rank, target_modules=targets, dropout=0.1 if dropout else 0.0)
    return tuple(param_specs(dict(lora_shapes(dims, lora))))


def lora_reshard(dims: ModelDims, lora: Any, train: ParallelLayout, rollout: ParallelLayout,
                 placement: str = "colocated") -> ReshardVolume:
    """The per-step sync of a LoRA actor: the resharder's plan over the adapters' specs only (the
    engines sync exactly these: the train engine's ``local_shards()`` keeps the adapter tensors, and
    the rollout holds its base from the load). ``ValueError`` as :func:`lora_specs`."""
    from ..core.resharder import ReshardError
    from ..core.resharder import reshard_bytes_summary as summary

    specs = lora_specs(dims, lora)
    try:
        return _volume(summary(train, rollout, specs, DTYPE_BYTES, placement))
    except ReshardError:  # replicated tensors: every rollout device loads them whole
        whole = sum(s.numel for s in specs) * DTYPE_BYTES
        cross = placement == "disaggregated"
        return ReshardVolume(whole if cross else 0.0, whole * rollout.world / train.world if cross else 0.0, whole)


__all__ = ["ReshardVolume", "exact_reshard_bytes", "full_reshard", "lora_reshard", "lora_specs", "reshard_bytes"]
