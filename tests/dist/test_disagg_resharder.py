"""Disaggregated resharding over gloo: train ranks [0, T) -> disjoint rollout ranks [T, T + R).

One spawn per world size runs every pair; each rollout rank's received shards must equal the
slice of the full reference weights bit for bit; train ranks yield nothing.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dist_harness import free_port, run_ranks

from rlrecipes.core.parallel import ParallelLayout
from rlrecipes.core.resharder import Resharder, ReshardError, local_shape, plan_reshard, shard_for
from rlrecipes.models import SMOKE
from rlrecipes.models.sharding import param_specs, split_layers

pytestmark = pytest.mark.dist

# (family, train, rollout) per world size T + R
PAIRS = {
    2: [
        ("qwen2", ParallelLayout.of(1), ParallelLayout.of(1)),                                   # DP1 rank 0 -> rank 1
        ("qwen3_moe", ParallelLayout.of(1), ParallelLayout.of(1)),
    ],
    3: [
        ("qwen2", ParallelLayout.of(2), ParallelLayout.of(1)),                                   # TP2 on 0-1 -> TP1 on 2
        ("qwen2", ParallelLayout.of(1, dp=2), ParallelLayout.of(1)),                             # two replicas share the sends
        ("deepseek_v3", ParallelLayout.of(2, ep=2), ParallelLayout.of(1)),                       # MLA + experts, TP/EP down
    ],
    4: [
        ("qwen2", ParallelLayout.of(1, pp=2), ParallelLayout.of(2)),                             # PP2 on 0-1 -> TP2 on 2-3
        ("qwen3_moe", ParallelLayout.of(2, ep=2), ParallelLayout.of(1, dp=2, ep=2)),             # experts owner -> owner
        ("qwen2", ParallelLayout.of(2), ParallelLayout.of(1, dp=2)),                             # TP down, rollout DP2
    ],
}


def _body(rank, tmp, world, port2):
    """On each of ``world`` gloo ranks (tests/dist/dist_harness.py)."""
    for family, train, rollout in PAIRS[world]:
        for dtype in ((torch.float32, torch.bfloat16) if family != "qwen3_moe" else (torch.float32,)):
            dims = SMOKE[family]
            pp_layers = split_layers(dims.num_layers, train.pp) if train.pp > 1 else None
            specs = param_specs(dims, pp_layers)
            g = torch.Generator().manual_seed(7)
            full = {s.name: torch.randn(s.shape, generator=g).to(dtype) for s in specs}
            plan = plan_reshard(train, rollout, specs, dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                                placement="disaggregated")
            assert plan.world == world
            local = {}
            if rank in plan.train_ranks:
                for s in specs:
                    t = shard_for(s, full[s.name], train, rank)
                    if t is not None:
                        local[s.name] = t.clone()
            for bucket_mb in (0.02, 64):
                tag = f"{family} {train.describe()} -> {rollout.describe()} [{dtype}, {bucket_mb} MB] rank {rank}"
                rs = Resharder(plan, "auto", bucket_mb=bucket_mb)
                out, seen = {}, 0
                for bucket in rs.reshard(local):
                    seen += 1
                    for name, t in bucket:
                        assert name not in out, f"{tag}: {name} twice"
                        out[name] = t.clone()
                assert rs.stats.phases.keys() == {"cross_alltoallv"}, tag
                j = plan.rollout_rank(rank)
                if j is None:
                    assert seen == 0 and not out, tag
                    assert rs.stats.recv_bytes == 0 and rs.stats.sent_bytes == plan.send_bytes(rank), tag
                    continue
                assert seen == rs.stats.buckets and (seen > 1) == (bucket_mb < 1), (tag, seen)
                assert set(out) == {s.name for s in specs}, tag
                for s in specs:
                    want = shard_for(s, full[s.name], rollout, j)
                    got = out[s.name]
                    assert got.dtype == dtype and tuple(got.shape) == local_shape(s, rollout), f"{tag}: {s.name}"
                    assert torch.equal(got, want), f"{tag}: {s.name} differs"
                # exactly the rollout shard arrives, nothing more
                assert rs.stats.recv_bytes == plan.min_bytes(rank) == plan.rollout_bytes(rank), tag
                assert rs.stats.sent_bytes == 0, tag
                # transient memory stays within about one bucket (or the largest single parameter)
                biggest = max(math.prod(local_shape(s, rollout)) for s in specs) * plan.dtype_bytes
                assert rs.stats.peak_transient_bytes <= max(bucket_mb * 2 ** 20, 2 * biggest), tag
    # over a process-group object torch.distributed does not know (the workflow's bridge group
    # joining a train world and a rollout world): same result
    from datetime import timedelta

    from rlrecipes.core.resharder.bridge import bridge_group

    store = dist.TCPStore("127.0.0.1", port2, world, rank == 0, timeout=timedelta(seconds=60))
    bridge = bridge_group(store, rank, world, timedelta(seconds=60))
    family, train, rollout = PAIRS[world][0]
    dims = SMOKE[family]
    specs = param_specs(dims, split_layers(dims.num_layers, train.pp) if train.pp > 1 else None)
    g = torch.Generator().manual_seed(9)
    full = {s.name: torch.randn(s.shape, generator=g) for s in specs}
    plan = plan_reshard(train, rollout, specs, dtype_bytes=4, placement="disaggregated")
    local = {s.name: shard_for(s, full[s.name], train, rank).clone() for s in specs
             if rank in plan.train_ranks and shard_for(s, full[s.name], train, rank) is not None}
    rs = Resharder(plan, "auto", bucket_mb=0.05, group=bridge)
    got = {n: t.clone() for b in rs.reshard(local) for n, t in b}
    j = plan.rollout_rank(rank)
    assert (j is None) == (not got)
    if j is not None:
        assert all(torch.equal(got[s.name], shard_for(s, full[s.name], rollout, j)) for s in specs)
    # bad input: a rollout rank passing shards, every rank raises before data moves
    family, train, rollout = PAIRS[world][-1]  # pp = 1
    specs = param_specs(SMOKE[family])
    plan = plan_reshard(train, rollout, specs, dtype_bytes=4, placement="disaggregated")
    full = {s.name: torch.zeros(s.shape) for s in specs}
    local = {s.name: shard_for(s, full[s.name], train, min(rank, train.world - 1)).clone() for s in specs}
    try:
        for _ in Resharder(plan, "auto").reshard(local):
            pass
        raise AssertionError("a rollout rank's shards were accepted")
    except ReshardError as e:
        assert ("pass {}" in str(e)) == (rank >= train.world), str(e)
    dist.barrier()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_disaggregated_resharder_exact(world):
    run_ranks(_body, world, world, free_port())


def test_strategy_and_placement_must_agree():
    specs = param_specs(SMOKE["qwen2"])
    cross = plan_reshard(ParallelLayout.of(2), ParallelLayout.of(1), specs, placement="disaggregated")
    with pytest.raises(ReshardError, match="plan is disaggregated .* use 'auto' or 'cross_alltoallv'"):
        Resharder(cross, "allgather_swap")
    with pytest.raises(ReshardError, match="plan is colocated"):
        Resharder(plan_reshard(ParallelLayout.of(2), ParallelLayout.of(1, dp=2), specs), "cross_alltoallv")
