"""Reshard traffic of ``rlrecipes plan``: the weight bytes a device receives (and, disaggregated,
sends) when the trained weights move from the actor layout to the rollout layout each step."""
from __future__ import annotations

from ..models import ModelDims
from .checks import RoleLayout
from .memory import DTYPE_BYTES


def reshard_bytes(dims: ModelDims, train: RoleLayout, rollout: RoleLayout, placement: str = "colocated") -> float:
    """Bytes one device receives per step: its rollout shard minus what its train shard already holds
    (disaggregated: the whole rollout shard, the rollout device holds no train shard).

    Assumes nested, aligned shards (TP/EP sizes divide each other), the layout the resharder plans.
    """
    total, experts = dims.total_params(), dims.expert_params()
    dense = total - experts
    need = dense / rollout.tp + experts / rollout.ep
    if placement == "disaggregated":
        return need * DTYPE_BYTES
    held = dense / train.pp / max(train.tp, rollout.tp) + experts / train.pp / max(train.ep, rollout.ep)
    return max(0.0, need - held) * DTYPE_BYTES


def exact_reshard_bytes(dims: ModelDims, train: RoleLayout, rollout: RoleLayout,
                        placement: str = "colocated") -> tuple[float, str, float]:
    """Max bytes any device receives, from the resharder's own plan (aggregated by parameter class),
    the method, and (disaggregated) the most bytes a train device sends. Falls back to
    :func:`reshard_bytes` when the resharder rejects the pair."""
    from ..core.resharder import Layout, ReshardError
    from ..models.sharding import reshard_bytes_summary

    try:
        s = reshard_bytes_summary(
            Layout(train.tp, train.pp, train.ep, train.dp, tuple(train.pp_layers) if train.pp_layers else None),
            Layout(rollout.tp, 1, rollout.ep, rollout.dp), dims, train.pp_layers, dtype_bytes=DTYPE_BYTES,
            placement=placement)
    except ReshardError:
        recv = reshard_bytes(dims, train, rollout, placement)
        return recv, "estimate", recv * rollout.world / train.world if placement == "disaggregated" else 0.0
    return float(s["max_min_recv_bytes"]), "resharder plan", float(s.get("max_send_bytes", 0.0))


__all__ = ["exact_reshard_bytes", "reshard_bytes"]
