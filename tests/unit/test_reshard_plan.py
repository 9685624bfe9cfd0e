"""Pure tests of parameter specs and the reshard plan (no processes)."""
from __future__ import annotations

import time

import pytest
import torch

from rlrecipes.models.sharding import reshard_bytes_summary
from rlrecipes.core.parallel import ParallelLayout
from rlrecipes.core.resharder import (ReshardError, local_shape, plan_reshard,
                                      shard_for)
from rlrecipes.models import PRESETS, SMOKE, hf_config, smoke_dims
from rlrecipes.models.sharding import (fused_expert_key, is_expert, kind_of, param_specs, split_layers, stage_of,
                                       tp_dim_of)

FAMILIES = ("qwen2", "qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def hf_state_dicts():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return {f: AutoModelForCausalLM.from_config(hf_config(SMOKE[f])).state_dict() for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_specs_match_hf_state_dict(family, hf_state_dicts):
    sd = {k: v for k, v in hf_state_dicts[family].items() if "rotary_emb" not in k}
    specs = param_specs(SMOKE[family])
    assert [s.name for s in specs] == list(sd)  # every name, HF order
    for s in specs:
        assert s.shape == tuple(sd[s.name].shape), s.name
    # the same specs from the state-dict meta and from the HF config
    from_sd = param_specs(hf_state_dicts[family])
    assert [(s.name, s.shape, s.kind, s.tp_dim) for s in from_sd] == [(s.name, s.shape, s.kind, s.tp_dim) for s in specs]
    from_cfg = param_specs(hf_config(SMOKE[family]))
    assert from_cfg == specs


def test_sharding_rules():
    assert tp_dim_of("model.layers.0.self_attn.q_proj.weight") == 0
    assert tp_dim_of("model.layers.0.self_attn.q_proj.bias") == 0
    assert tp_dim_of("model.layers.0.self_attn.o_proj.weight") == 1
    assert tp_dim_of("model.layers.3.mlp.shared_experts.down_proj.weight") == 1
    assert tp_dim_of("model.layers.0.self_attn.kv_b_proj.weight") == 0
    assert tp_dim_of("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") is None
    assert tp_dim_of("model.layers.3.mlp.gate.weight") is None
    assert tp_dim_of("model.embed_tokens.weight") == 0 and kind_of("model.embed_tokens.weight") == "vocab"
    assert tp_dim_of("lm_head.weight") == 0
    assert kind_of("model.layers.0.self_attn.q_a_layernorm.weight") == "replicated"
    assert kind_of("model.layers.3.mlp.gate.e_score_correction_bias") == "replicated"
    assert is_expert("model.layers.3.mlp.experts.gate_up_proj")
    assert is_expert("model.layers.3.mlp.experts.7.up_proj.weight")
    assert not is_expert("model.layers.3.mlp.shared_experts.up_proj.weight")
    assert tp_dim_of("model.layers.3.mlp.experts.down_proj") is None
    assert fused_expert_key("model.layers.3.mlp.experts.17.up_proj.weight") == (
        "model.layers.3.mlp.experts.gate_up_proj", 17, "up")
    with pytest.raises(ValueError, match="no sharding rule"):
        kind_of("model.layers.0.mlp.mystery_proj.weight")


def test_pipeline_stages():
    specs = param_specs(SMOKE["deepseek_v3"], pp_layers=[1, 2])
    st = {s.name: s.pp_stage for s in specs}
    assert st["model.embed_tokens.weight"] == 0 and st["lm_head.weight"] == 1 and st["model.norm.weight"] == 1
    assert st["model.layers.0.mlp.gate_proj.weight"] == 0 and st["model.layers.1.mlp.experts.down_proj"] == 1
    assert split_layers(61, 8) == [8, 8, 8, 8, 8, 7, 7, 7]
    assert stage_of("model.layers.60.mlp.gate.weight", [7, 7, 8, 8, 8, 8, 8, 7]) == 7
    with pytest.raises(ValueError, match="sum to"):
        param_specs(SMOKE["qwen2"], pp_layers=[1, 2])


def _simulate(plan, full):
    """Execute the plan in-process: every rank's result from its own shard + pieces from the sources."""
    train, rollout = plan.train, plan.rollout
    shards = [{s.name: shard_for(s, full[s.name], train, r) for s in plan.specs} for r in range(train.world)]
    for r in range(train.world):
        for i, s in enumerate(plan.specs):
            got = torch.full(local_shape(s, rollout), float("nan"))
            ra, _ = (0, 0) if s.split_dim is None else _rng(s, rollout, r)
            for j, a, b in plan.local[r]:
                if j == i:
                    src = shards[r][s.name]
                    ta = 0 if s.split_dim is None else _rng(s, train, r)[0]
                    _put(got, s, a - ra, b - a, src, a - ta)
            for p in plan.recv[r]:
                if p.spec == i:
                    src = shards[p.src][s.name]
                    assert src is not None, f"{s.name}: rank {p.src} does not hold it"
                    ta = 0 if s.split_dim is None else _rng(s, train, p.src)[0]
                    _put(got, s, p.start - ra, p.stop - p.start, src, p.start - ta)
            assert torch.equal(got, shard_for(s, full[s.name], rollout, r)), (s.name, r)


def _rng(s, layout, r):
    from rlrecipes.core.resharder import _interval

    return _interval(s, layout, r)


def _put(dst, s, off, n, src, soff):
    if s.split_dim is None:
        dst.copy_(src)
    else:
        dst.narrow(s.split_dim, off, n).copy_(src.narrow(s.split_dim, soff, n))


PAIRS = [
    ("qwen2", ParallelLayout.of(2, dp=2), ParallelLayout.of(1, dp=4)),                       # TP down
    ("qwen2", ParallelLayout.of(1, dp=4), ParallelLayout.of(2, dp=2)),                       # TP up
    ("qwen2", ParallelLayout.of(2, pp=2, dp=2), ParallelLayout.of(2, dp=4)),                 # PP down
    ("qwen3_moe", ParallelLayout.of(2, dp=2, ep=2), ParallelLayout.of(1, dp=4, ep=4)),       # EP up
    ("qwen3_moe", ParallelLayout.of(1, dp=8, ep=8), ParallelLayout.of(2, dp=4, ep=2)),       # EP down + TP up
    ("deepseek_v3", ParallelLayout.of(2, pp=2, dp=2, ep=4), ParallelLayout.of(4, dp=2, ep=8)),
    ("deepseek_v3", ParallelLayout.of(4, dp=2, ep=2), ParallelLayout.of(1, dp=8, ep=1)),
]


@pytest.mark.parametrize("family,train,rollout", PAIRS)
def test_plan_moves_exactly_the_missing_slices(family, train, rollout):
    dims = SMOKE[family]
    pp_layers = split_layers(dims.num_layers, train.pp) if train.pp > 1 else None
    specs = param_specs(dims, pp_layers)
    g = torch.Generator().manual_seed(1)
    full = {s.name: torch.randn(s.shape, generator=g) for s in specs}
    plan = plan_reshard(train, rollout, specs, dtype_bytes=4)
    _simulate(plan, full)
    # the plan never sends to itself, receives only what it lacks, and sends == receives overall
    for r in range(train.world):
        assert all(p.src != r for p in plan.recv[r])
    assert sum(plan.send_bytes(r) for r in range(train.world)) == sum(plan.recv_bytes(r) for r in range(train.world))
    # per-class aggregation agrees with the enumerated plan
    summ = reshard_bytes_summary(train, rollout, dims, pp_layers, dtype_bytes=4)
    assert summ["min_recv_bytes_per_rank"] == [plan.min_bytes(r) for r in range(train.world)]


def test_tp_down_bytes():
    dims = SMOKE["qwen2"]
    specs = param_specs(dims)
    plan = plan_reshard(ParallelLayout.of(2), ParallelLayout.of(1, dp=2), specs, dtype_bytes=2)
    split = sum(s.numel for s in specs if s.tp_dim is not None)
    assert plan.min_bytes(0) == plan.min_bytes(1) == split // 2 * 2
    same = plan_reshard(ParallelLayout.of(2), ParallelLayout.of(2), specs)
    assert same.min_bytes(0) == 0 and not same.recv[0]


@pytest.mark.parametrize("train,rollout,family,match", [
    (ParallelLayout.of(2, dp=2), ParallelLayout.of(2, dp=1), "qwen2", "world sizes differ"),
    (ParallelLayout.of(1, dp=4), ParallelLayout.of(4, dp=1), "qwen2", "2 (kv )?heads .* rollout tp=4"),
    (ParallelLayout.of(2, pp=2), ParallelLayout.of(2, pp=2), "qwen2", "rollout layout must have pp=1"),
    (ParallelLayout.of(1, dp=4, ep=4), ParallelLayout.of(4, dp=1), "qwen3_moe", "heads .* rollout tp=4"),
    (ParallelLayout.of(2, pp=2), ParallelLayout.of(1, dp=4), "qwen2", "only reach stage 0"),
])
def test_impossible_pairs(train, rollout, family, match):
    with pytest.raises(ReshardError, match=match):
        plan_reshard(train, rollout, param_specs(SMOKE[family]))


def test_impossible_experts_and_ep():
    specs = param_specs(smoke_dims("qwen3_moe", num_experts=6, experts_per_token=2))
    with pytest.raises(ReshardError, match="6 experts .* rollout ep=4"):
        plan_reshard(ParallelLayout.of(2, dp=2, ep=2), ParallelLayout.of(1, dp=4, ep=4), specs)
    with pytest.raises(ReshardError, match="train layout: EP divides DP\\*TP: layout: EP3 does not divide DP2 x TP2 = 4; "
                                           "set layout.ep to one of 1, 2, 4"):
        plan_reshard(ParallelLayout.of(2, dp=2, ep=3), ParallelLayout.of(1, dp=4, ep=4), specs)
    with pytest.raises(ReshardError, match="pp_layers has 3 entries for PP2"):
        plan_reshard(ParallelLayout.of(1, pp=2, pp_layers=(1, 1, 1)), ParallelLayout.of(1, dp=2), specs)


def test_deepseek_671b_summary_on_256_ranks_is_fast():
    dims = PRESETS["deepseek-v3-671b"]
    train = ParallelLayout.of(4, pp=8, ep=8, dp=8, pp_layers=(7, 7, 8, 8, 8, 8, 8, 7))
    rollout = ParallelLayout.of(2, dp=128, ep=128)
    t0 = time.perf_counter()
    s = reshard_bytes_summary(train, rollout, dims)
    assert time.perf_counter() - t0 < 10
    assert s["world"] == 256 and s["param_classes"] < 200  # vs 967 specs
    # every rank needs its rollout shard; what it lacks is at most that
    assert 0 < s["max_min_recv_bytes"] <= s["max_rollout_shard_bytes"] < s["naive_gather_bytes_per_rank"]
    # experts: 2 per rank in rollout; a rank's 32 train experts of one stage cover its 2 only on
    # its own stage, so most expert bytes move; sanity bound against the expert total
    expert_bytes = dims.expert_params() * 2
    assert s["max_rollout_shard_bytes"] >= expert_bytes // 128
    with pytest.raises(ReshardError, match="256 experts .* rollout ep=512|world sizes differ"):
        reshard_bytes_summary(train, ParallelLayout.of(1, dp=512, ep=512), dims)


def test_one_rank_reshard_hands_the_train_shards_over_without_copies(tmp_path):
    """World 1: every rollout shard is the train tensor itself (a view, no collective), cast when
    the rollout dtype differs; a missing or misshapen shard is refused before anything moves."""
    import torch.distributed as dist

    from rlrecipes.core.resharder import Resharder

    dims = SMOKE["qwen2"]
    specs = param_specs(dims)
    plan = plan_reshard(ParallelLayout.of(1, 1, 1, 1), ParallelLayout.of(1, 1, 1, 1), specs)
    shards = {s.name: torch.randn(s.shape) for s in specs}
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        out = [kv for bucket in Resharder(plan, bucket_mb=1).reshard(shards) for kv in bucket]
        assert [n for n, _ in out] == [s.name for s in specs]
        assert all(t.data_ptr() == shards[n].data_ptr() for n, t in out)  # views, not copies
        half = dict(kv for bucket in Resharder(plan, dtype=torch.bfloat16).reshard(shards) for kv in bucket)
        assert all(t.dtype == torch.bfloat16 and torch.equal(t, shards[n].to(torch.bfloat16)) for n, t in half.items())
        bad = dict(shards)
        bad[specs[0].name] = torch.zeros(3)
        with pytest.raises(ReshardError, match="local shard has shape"):
            list(Resharder(plan).reshard(bad))
        del bad[specs[0].name]
        with pytest.raises(ReshardError, match="missing"):
            list(Resharder(plan).reshard(bad))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family,train,rollout,identity", [
    ("qwen2", ParallelLayout.of(1, dp=4), ParallelLayout.of(1, dp=4), True),            # DP only: each rank already holds it all
    ("qwen3_moe", ParallelLayout.of(2, dp=2, ep=2), ParallelLayout.of(2, dp=2, ep=2), True),
    ("qwen2", ParallelLayout.of(1, dp=4), ParallelLayout.of(2, dp=2), False),           # TP up: a rank keeps half of what it holds
    ("qwen2", ParallelLayout.of(2, dp=2), ParallelLayout.of(1, dp=4), False),           # TP down: a rank receives
    ("qwen2", ParallelLayout.of(1, pp=2, dp=2), ParallelLayout.of(1, dp=4), False),     # PP: other stages' weights arrive
    ("qwen3_moe", ParallelLayout.of(2, dp=2, ep=2), ParallelLayout.of(2, dp=2, ep=1), False),
])
def test_identity_plan_moves_nothing_and_keeps_the_shard_size(family, train, rollout, identity):
    dims = SMOKE[family]
    specs = param_specs(dims, split_layers(dims.num_layers, train.pp) if train.pp > 1 else None)
    plan = plan_reshard(train, rollout, specs)
    assert plan.identity is identity
    if identity:
        assert all(plan.min_bytes(r) == 0 for r in range(plan.world))
    assert plan_reshard(train, ParallelLayout.of(rollout.tp, dp=rollout.dp, ep=rollout.ep), specs,
                        placement="disaggregated").identity is False
