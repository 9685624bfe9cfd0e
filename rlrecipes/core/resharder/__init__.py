"""Resharding of trained weights from the train layout to the rollout layout (docs/resharder.md).

Three layers, each usable alone (modules: ``layout.py``, ``plan.py``, ``transfer.py``, ``executor.py``;
the strategies in ``strategies_allgather.py``, ``strategies_pp.py``, ``strategies_experts.py``,
``strategies_cross.py``, mixins of :class:`Resharder`):

1. :func:`plan_reshard` -- a *pure* plan. From the train and rollout layouts (each a
   :class:`rlrecipes.core.parallel.ParallelLayout`, the role's layout plan checked; the rollout's
   pp = 1; SP ranks count as more weight replicas) and the parameter specs
   (:mod:`rlrecipes.models.sharding`) it computes, for every rank, which slices it keeps locally,
   receives (from whom) and sends (to whom), with bytes. Every impossible pair raises
   :class:`ReshardError` here, before any process communicates. :func:`reshard_bytes_summary`
   gives per-rank byte figures for real model sizes (DeepSeek-V3 on 256 ranks) by aggregating
   parameters into classes instead of enumerating transfers.
2. :class:`Resharder` -- executors over ``torch.distributed`` (gloo / nccl / hccl): the strategies
   in :data:`STRATEGIES` plus ``auto``. ``Resharder.reshard(local_shards)`` yields the rollout
   shards bucket by bucket, so a rollout engine loads them as they arrive.
   Disaggregated placement (asynchronous RL, train and rollout on disjoint devices):
   ``plan_reshard(train, rollout, specs, placement="disaggregated")`` puts the train layout on
   global ranks ``[0, T)`` and the rollout layout on ``[T, T + R)`` of one world; train ranks keep
   nothing, rollout ranks receive every slice from a train holder (sources balanced over the
   replicas). Its executor is ``cross_alltoallv`` (:data:`CROSS_STRATEGIES`, what ``auto``
   picks): every rank calls ``reshard``; train ranks pass their shards and yield nothing, rollout
   ranks pass ``{}`` and yield their rollout shards bucket by bucket.
3. ``Resharder.swap_out`` / ``swap_in`` -- move training weights, grads and optimizer state to host
   memory and release their device storage (``untyped_storage().resize_(0)``), then bring them back
   bit-exactly before the next update.

Rank order and sharding follow ``docs/conventions.md``:
``rank = pp_rank * (dp * sp * tp) + replica * tp + tp_rank``, ``ep_rank = (replica * tp + tp_rank) % ep``,
TP shards are equal contiguous chunks along ``tp_dim``, experts are chunks of dim 0 over EP.
"""
from __future__ import annotations

from .layout import (AUTO, CROSS_STRATEGIES, PLACEMENTS, Piece, ReshardError, STRATEGIES, _interval,  # noqa: F401
                     local_shape, shard_for)
from .plan import ReshardPlan, plan_reshard, reshard_bytes_summary  # noqa: F401
from .transfer import HostSwap, ReshardStats  # noqa: F401
from .executor import Resharder, reshard_to_dict  # noqa: F401

__all__ = ["AUTO", "CROSS_STRATEGIES", "HostSwap", "PLACEMENTS", "Piece", "ReshardError", "ReshardPlan",
           "ReshardStats", "Resharder", "STRATEGIES", "_interval", "local_shape", "plan_reshard", "reshard_bytes_summary",
           "reshard_to_dict", "shard_for"]
