"""Pure tests of the disaggregated reshard plan: train ranks [0, T) -> rollout ranks [T, T + R)."""
from __future__ import annotations

import pytest
import torch

from rlrecipes.core.parallel import ParallelLayout
from rlrecipes.core.resharder import ReshardError, _interval, local_shape, plan_reshard, shard_for
from rlrecipes.core.resharder import reshard_bytes_summary as core_summary
from rlrecipes.models import PRESETS, SMOKE
from rlrecipes.models.sharding import param_specs, reshard_bytes_summary, split_layers

PAIRS = [
    ("qwen2", ParallelLayout.of(2), ParallelLayout.of(1)),                                   # TP2 -> one rollout rank
    ("qwen2", ParallelLayout.of(1, dp=2), ParallelLayout.of(1)),                             # two replicas share the sends
    ("qwen2", ParallelLayout.of(1, pp=2), ParallelLayout.of(2)),                             # PP2 -> TP2
    ("qwen2", ParallelLayout.of(2, pp=2, dp=2), ParallelLayout.of(1, dp=4)),
    ("qwen3_moe", ParallelLayout.of(2, dp=2, ep=2), ParallelLayout.of(1, dp=4, ep=4)),
    ("qwen3_moe", ParallelLayout.of(1, dp=8, ep=8), ParallelLayout.of(2, dp=2, ep=2)),
    ("deepseek_v3", ParallelLayout.of(2, pp=2, dp=2, ep=4), ParallelLayout.of(4, dp=2, ep=8)),
    ("deepseek_v3", ParallelLayout.of(4, dp=2, ep=2), ParallelLayout.of(1)),
]


def _setup(family, train, dtype_bytes=4):
    dims = SMOKE[family]
    pp_layers = split_layers(dims.num_layers, train.pp) if train.pp > 1 else None
    return dims, pp_layers, param_specs(dims, pp_layers)


@pytest.mark.parametrize("family,train,rollout", PAIRS)
def test_every_rollout_slice_arrives_once_from_a_holder(family, train, rollout):
    dims, pp_layers, specs = _setup(family, train)
    plan = plan_reshard(train, rollout, specs, dtype_bytes=4, placement="disaggregated")
    T, R = train.world, rollout.world
    assert plan.world == T + R and plan.train_ranks == range(T) and plan.rollout_ranks == range(T, T + R)
    assert all(not plan.local[r] for r in range(plan.world))
    g = torch.Generator().manual_seed(3)
    full = {s.name: torch.randn(s.shape, generator=g) for s in specs}
    for r in plan.train_ranks:
        assert not plan.recv[r] and plan.rollout_bytes(r) == 0 and plan.min_bytes(r) == 0
    for r in plan.rollout_ranks:
        assert not plan.send[r]
        j = plan.rollout_rank(r)
        for i, s in enumerate(specs):
            pieces = sorted((p for p in plan.recv[r] if p.spec == i), key=lambda p: p.start)
            a, b = _interval(s, rollout, j)
            if s.split_dim is None:  # replicated / unsplit: exactly one whole piece
                assert len(pieces) == 1
            else:  # contiguous cover of [a, b), no overlap, no gap
                assert pieces[0].start == a and pieces[-1].stop == b
                assert all(x.stop == y.start for x, y in zip(pieces, pieces[1:]))
            got = torch.full(local_shape(s, rollout), float("nan"))
            for p in pieces:
                assert p.src in plan.train_ranks and p.dst == r
                src = shard_for(s, full[s.name], train, p.src)
                assert src is not None, f"{s.name}: train rank {p.src} does not hold it"
                if s.split_dim is None:
                    got.copy_(src)
                else:
                    ta, _ = _interval(s, train, p.src)
                    got.narrow(s.split_dim, p.start - a, p.stop - p.start).copy_(
                        src.narrow(s.split_dim, p.start - ta, p.stop - p.start))
            assert torch.equal(got, shard_for(s, full[s.name], rollout, j)), (s.name, r)
        # the minimum a rollout rank must receive is its whole rollout shard, and that is what arrives
        assert plan.recv_bytes(r) == plan.min_bytes(r) == plan.rollout_bytes(r)
    assert sum(plan.send_bytes(r) for r in plan.train_ranks) == sum(plan.recv_bytes(r) for r in plan.rollout_ranks)
    # the class-aggregated summary agrees with the enumerated plan
    summ = reshard_bytes_summary(train, rollout, dims, pp_layers, dtype_bytes=4, placement="disaggregated")
    assert summ["min_recv_bytes_per_rank"] == [plan.min_bytes(r) for r in range(plan.world)]
    assert summ["max_min_recv_bytes"] == summ["max_rollout_shard_bytes"] == max(map(plan.rollout_bytes, plan.rollout_ranks))
    biggest = max(p.numel for r in plan.train_ranks for p in plan.send[r]) * 4
    for r in plan.train_ranks:  # the greedy stays within one slice of the even spread
        assert abs(plan.send_bytes(r) - summ["send_bytes_per_rank"][r]) <= biggest, r


@pytest.mark.parametrize("family,train,rollout", PAIRS)
def test_sources_balanced_over_replicas(family, train, rollout):
    """Every holder set (the replicas of one train chunk) shares its sends within one slice."""
    _, _, specs = _setup(family, train)
    plan = plan_reshard(train, rollout, specs, dtype_bytes=4, placement="disaggregated")
    sent = [plan.send_bytes(r) for r in plan.train_ranks]
    biggest = max(p.numel for r in plan.train_ranks for p in plan.send[r]) * 4
    # ranks of one pipeline stage that hold the same chunks (the DP replicas): equal load within a slice
    S = train.stage_size
    for stage in range(train.pp):
        for tp in range(train.tp):
            group = [sent[train.rank(stage, d, tp)] for d in range(train.dp)]
            if train.ep == 1:
                assert max(group) - min(group) <= biggest, (stage, tp, group)
        assert sum(sent[stage * S:(stage + 1) * S]) > 0
    if train.dp > 1 and train.ep == 1:
        assert all(s > 0 for s in sent)  # every replica serves some of the load


def test_dp2_to_one_rollout_rank_splits_sends_evenly():
    specs = param_specs(SMOKE["qwen2"])
    plan = plan_reshard(ParallelLayout.of(1, dp=2), ParallelLayout.of(1), specs, dtype_bytes=2, placement="disaggregated")
    total = sum(s.numel for s in specs) * 2
    assert plan.recv_bytes(2) == total and plan.send_bytes(0) + plan.send_bytes(1) == total
    biggest = max(s.numel for s in specs) * 2
    assert abs(plan.send_bytes(0) - plan.send_bytes(1)) <= biggest
    # colocated plans are unchanged: same ranks, world = train world
    co = plan_reshard(ParallelLayout.of(2), ParallelLayout.of(1, dp=2), specs)
    assert co.world == 2 and co.train_ranks == co.rollout_ranks == range(2) and co.placement == "colocated"


def test_disaggregated_errors():
    specs = param_specs(SMOKE["qwen2"])
    with pytest.raises(ReshardError, match="unknown placement"):
        plan_reshard(ParallelLayout.of(2), ParallelLayout.of(1), specs, placement="split")
    with pytest.raises(ReshardError, match="world sizes differ.*disaggregated"):
        plan_reshard(ParallelLayout.of(2), ParallelLayout.of(1), specs)
    with pytest.raises(ReshardError, match="rollout tp=4"):
        plan_reshard(ParallelLayout.of(2), ParallelLayout.of(4), specs, placement="disaggregated")
    with pytest.raises(ReshardError, match="pp=1"):
        plan_reshard(ParallelLayout.of(2), ParallelLayout.of(1, pp=2), specs, placement="disaggregated")


def test_deepseek_671b_disaggregated_summary():
    """DeepSeek-V3 on 256 train ranks + 128 rollout ranks: every rollout rank receives its whole
    shard; the train ranks' sends spread evenly."""
    dims = PRESETS["deepseek-v3-671b"]
    train = ParallelLayout.of(4, pp=8, ep=8, dp=8, pp_layers=(7, 7, 8, 8, 8, 8, 8, 7))
    rollout = ParallelLayout.of(2, dp=64, ep=128)
    s = core_summary(train, rollout, param_specs(dims, train.pp_layers), placement="disaggregated")
    assert s["world"] == 384 and s["rollout_ranks"] == [256, 384]
    assert s["min_recv_bytes_per_rank"][:256] == [0] * 256
    assert s["max_min_recv_bytes"] == s["max_rollout_shard_bytes"]
    assert sum(s["send_bytes_per_rank"]) == pytest.approx(s["total_min_recv_bytes"], rel=1e-9)
    assert s["send_bytes_per_rank"][256:] == [0] * 128 and min(s["send_bytes_per_rank"][:256]) > 0
