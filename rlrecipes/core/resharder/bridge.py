"""The bridge group: one point-to-point group over every process of a disaggregated run.

With disaggregated placement the train roles and the rollout each have their own torch.distributed
world (so every engine keeps seeing "the world" as its own ranks). The two sets are joined by one
extra gloo group spanning all ``T + R`` processes, built here from the run's rendezvous store; it is
not registered with torch.distributed, and :class:`~.executor.Resharder` (``cross_alltoallv``) moves
each new policy version over it along the disaggregated :class:`~.plan.ReshardPlan`.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def bridge_group(store, rank: int, world: int, timeout: timedelta):
    """The gloo group over every process of the run (train ranks first, then rollout ranks)."""
    return dist.ProcessGroupGloo(dist.PrefixStore("bridge/", store), rank, world, timeout)
