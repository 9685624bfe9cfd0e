"""Resharder executors over gloo process groups of 2, 4 and 8 ranks.

One spawn per world size runs every layout pair x strategy, so the suite stays fast.
Exactness: each rank's rollout shard equals the slice of the full reference weights (torch.equal).
"""
from __future__ import annotations

import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlrecipes.core.parallel import ParallelLayout
from rlrecipes.core.resharder import (STRATEGIES, Resharder, ReshardError, local_shape, plan_reshard,
                                      reshard_to_dict, shard_for)
from rlrecipes.models import SMOKE
from rlrecipes.models.sharding import param_specs, split_layers

pytestmark = pytest.mark.dist

# (family, train, rollout) per world size: TP up/down, EP up/down, PP>1 -> PP=1, over the three families
PAIRS = {
    2: [
        ("qwen2", ParallelLayout.of(2), ParallelLayout.of(1, dp=2)),                                   # TP down
        ("qwen2", ParallelLayout.of(1, dp=2), ParallelLayout.of(2)),                                   # TP up
        ("qwen2", ParallelLayout.of(1, pp=2), ParallelLayout.of(2)),                                   # PP down
        ("qwen3_moe", ParallelLayout.of(1, dp=2, ep=2), ParallelLayout.of(2, ep=1)),                   # EP down, TP up
        ("deepseek_v3", ParallelLayout.of(2, ep=2), ParallelLayout.of(1, dp=2, ep=1)),                 # MLA, TP down, EP down
        ("qwen2", ParallelLayout.of(1, dp=2), ParallelLayout.of(1, dp=2)),                             # identity: DP only
        ("qwen3_moe", ParallelLayout.of(2, ep=2), ParallelLayout.of(2, ep=2)),                         # identity: TP + EP
    ],
    4: [
        ("qwen2", ParallelLayout.of(2, pp=2), ParallelLayout.of(1, dp=4)),                             # TP + PP down
        ("qwen3_moe", ParallelLayout.of(2, dp=2, ep=2), ParallelLayout.of(1, dp=4, ep=4)),             # EP up, TP down
        ("qwen3_moe", ParallelLayout.of(1, dp=4, ep=4), ParallelLayout.of(2, dp=2, ep=2)),             # EP down, TP up
        ("deepseek_v3", ParallelLayout.of(2, pp=2, ep=2), ParallelLayout.of(2, dp=2, ep=4)),           # PP down, EP up
    ],
    8: [
        ("qwen2", ParallelLayout.of(2, pp=2, dp=2), ParallelLayout.of(2, dp=4)),                       # PP down
        ("qwen3_moe", ParallelLayout.of(2, pp=2, dp=2, ep=4), ParallelLayout.of(1, dp=8, ep=8)),       # PP + TP down, EP up
        ("deepseek_v3", ParallelLayout.of(4, dp=2, ep=2), ParallelLayout.of(2, dp=4, ep=8)),           # TP down, EP up
        ("deepseek_v3", ParallelLayout.of(2, pp=2, dp=2, ep=4), ParallelLayout.of(1, dp=8, ep=2)),     # PP, TP, EP down
    ],
}
ALL = STRATEGIES + ("auto",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(specs, dtype=torch.float32):
    g = torch.Generator().manual_seed(1234)
    return {s.name: torch.randn(s.shape, generator=g).to(dtype) for s in specs}


def _case(family, train, rollout, rank, dtype=torch.float32):
    dims = SMOKE[family]
    pp_layers = split_layers(dims.num_layers, train.pp) if train.pp > 1 else None
    specs = param_specs(dims, pp_layers)
    full = _reference(specs, dtype)
    plan = plan_reshard(train, rollout, specs, dtype_bytes=torch.empty((), dtype=dtype).element_size())
    local = {}
    for s in specs:
        t = shard_for(s, full[s.name], train, rank)
        if t is not None:
            local[s.name] = t.clone()
    return specs, full, plan, local


def _worker(rank, world, port, errq):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for family, train, rollout in PAIRS[world]:
            for dtype in ((torch.float32, torch.bfloat16) if family == "deepseek_v3" else (torch.float32,)):
                specs, full, plan, local = _case(family, train, rollout, rank, dtype)
                for strategy in ALL:
                    tag = f"{family} {train.describe()} -> {rollout.describe()} [{strategy}, {dtype}] rank {rank}"
                    # tiny buckets so every strategy runs several buckets
                    rs = Resharder(plan, strategy, bucket_mb=0.05)
                    seen = 0
                    out = {}
                    for bucket in rs.reshard(local):
                        seen += 1
                        for name, t in bucket:
                            assert name not in out, f"{tag}: {name} yielded twice"
                            out[name] = t
                    assert seen == rs.stats.buckets and seen > 1, tag
                    assert set(out) == {s.name for s in specs}, f"{tag}: missing {set(s.name for s in specs) - set(out)}"
                    for s in specs:
                        want = shard_for(s, full[s.name], rollout, rank)
                        got = out[s.name]
                        assert got.dtype == dtype and tuple(got.shape) == local_shape(s, rollout), f"{tag}: {s.name}"
                        assert torch.equal(got, want), f"{tag}: {s.name} differs"
                        # outputs alias the training weights only on an identity plan (views, no
                        # buffer: the consumer copies a bucket before asking for the next)
                        if s.name in local:
                            aliased = got.untyped_storage().data_ptr() == local[s.name].untyped_storage().data_ptr()
                            assert aliased == plan.identity, f"{tag}: {s.name} aliased={aliased}"
                    if plan.identity:
                        assert rs.stats.recv_bytes == rs.stats.sent_bytes == rs.stats.collectives == 0, tag
                    # traffic: the all-to-all-v path moves exactly the plan minimum
                    if strategy == "alltoallv_experts" and family == "qwen3_moe" and train.pp == 1:
                        exp = {i for i, s in enumerate(specs) if s.kind == "expert"}
                        want_b = sum(p.numel for p in plan.recv[rank] if p.spec in exp) * plan.dtype_bytes
                        dense_allgather = rs.stats.recv_bytes - want_b
                        assert dense_allgather >= 0, tag
                    # auto moves TP-up / expert params owner -> owner: exactly the minimum when nothing is TP-down
                    if strategy == "auto" and train.pp == 1 and all(
                            rollout.chunks(s) % train.chunks(s) == 0 for s in specs if s.split_dim is not None):
                        assert rs.stats.recv_bytes == plan.min_bytes(rank), (tag, rs.stats.recv_bytes)
                    # no strategy can receive less than what this rank lacks
                    assert rs.stats.recv_bytes >= plan.min_bytes(rank), tag
        # a pure all-to-all-v run on an expert-only plan receives exactly the plan minimum
        specs, full, plan, local = _case("qwen3_moe", *PAIRS[world][-1][1:], rank) if world == 8 else \
            _case("qwen3_moe", ParallelLayout.of(1, dp=world, ep=world), ParallelLayout.of(2, dp=world // 2, ep=1), rank)
        ex = [s for s in specs if s.kind == "expert"]
        eplan = plan_reshard(plan.train, plan.rollout, ex, dtype_bytes=4)
        rs = Resharder(eplan, "alltoallv_experts", bucket_mb=1)
        reshard_to_dict(rs, {s.name: local[s.name] for s in ex if s.name in local})
        assert rs.stats.recv_bytes == eplan.min_bytes(rank), (rs.stats.recv_bytes, eplan.min_bytes(rank))
        assert rs.stats.sent_bytes == eplan.send_bytes(rank)

        # swap round trip: params + grads + optimizer state, storage really released, bit-exact back
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        tensors = list(model.parameters()) + [p.grad for p in model.parameters()] + \
            [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
        before = [t.detach().clone() for t in tensors]
        rs = Resharder(plan, "allgather_swap")
        released = rs.swap_out(model, grads=True, optimizer=opt)
        assert released >= sum(t.numel() * t.element_size() for t in tensors)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors) and rs.swapped_device_bytes == 0
        rs.swap_in()
        for t, b in zip(tensors, before):
            assert t.untyped_storage().nbytes() > 0 and torch.equal(t, b)
        opt.step()  # the optimizer works on the restored state

        # bad local shards: every rank raises (agreed before any data moves), nobody hangs
        bad = dict(local)
        if rank == 0:
            bad.pop(next(iter(bad)))
        try:
            reshard_to_dict(Resharder(plan, "auto"), bad)
            raise AssertionError("bad local shards were accepted")
        except ReshardError as e:
            assert ("missing" in str(e)) == (rank == 0), str(e)
        dist.barrier()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_resharder_exact(world):
    port = _free_port()
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    try:
        mp.spawn(_worker, args=(world, port, errq), nprocs=world, join=True)
    except Exception as e:  # report the first rank's assertion, not just "process exited"
        msgs = []
        while not errq.empty():
            msgs.append("rank %d:\n%s" % errq.get())
        pytest.fail("\n".join(msgs) or str(e))


def test_impossible_pair_raises_before_communication():
    """The plan rejects the pair with no process group at all (nothing was initialised)."""
    assert not dist.is_initialized()
    specs = param_specs(SMOKE["qwen2"])
    with pytest.raises(ReshardError, match="heads .* rollout tp=4"):
        Resharder(plan_reshard(ParallelLayout.of(1, dp=4), ParallelLayout.of(4), specs), "auto")
    with pytest.raises(ReshardError, match="unknown reshard strategy"):
        Resharder(plan_reshard(ParallelLayout.of(2), ParallelLayout.of(2), specs), "broadcast")
