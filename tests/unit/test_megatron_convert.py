"""HF <-> megatron-core conversion on full tensors (no megatron needed): exact round trips for the
three families, per-stage conversion, grouped q/k/v layout, clear errors. The megatron tier checks
the same names and shapes against the modules megatron-core builds (tests/megatron_tier)."""
import dataclasses

import pytest
import torch

from rlrecipes.engines.megatron.convert import (ConversionError, fuse_qkv, hf_to_megatron, megatron_to_hf,
                                                split_qkv, transformer_config)
from rlrecipes.engines.native.loader import build_model
from rlrecipes.models import SMOKE


@pytest.mark.parametrize("family", list(SMOKE))
def test_round_trip_is_exact(family):
    model, dims = build_model(SMOKE[family], seed=1)
    hf = model.state_dict()
    mg = hf_to_megatron(hf, dims)
    assert not any(k.startswith("model.") for k in mg)
    back = megatron_to_hf(mg, dims)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k
    assert sum(t.numel() for t in mg.values()) == sum(t.numel() for t in hf.values())


@pytest.mark.parametrize("family", list(SMOKE))
def test_pipeline_stages_partition_the_model(family):
    model, dims = build_model(SMOKE[family], seed=1)
    hf = model.state_dict()
    cut = dims.num_layers - 1
    first, last = hf_to_megatron(hf, dims, layers=(0, cut)), hf_to_megatron(hf, dims, layers=(cut, dims.num_layers))
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "output_layer.weight" in last and "embedding.word_embeddings.weight" not in last
    assert all(k.startswith("decoder.layers.0.") for k in last if k.startswith("decoder.layers."))  # local numbering
    joined = {**megatron_to_hf(first, dims, layers=(0, cut)), **megatron_to_hf(last, dims, layers=(cut, dims.num_layers))}
    assert set(joined) == set(hf) and all(torch.equal(joined[k], hf[k]) for k in hf)


def test_grouped_qkv_layout():
    dims = dataclasses.replace(SMOKE["qwen2"], num_heads=4, num_kv_heads=2, head_dim=2)
    q = torch.arange(8.0)[:, None].repeat(1, 3)          # heads 0..3, 2 rows each
    k, v = 100 + torch.arange(4.0)[:, None].repeat(1, 3), 200 + torch.arange(4.0)[:, None].repeat(1, 3)
    qkv = fuse_qkv(q, k, v, dims)
    # group 0: q heads 0,1 then k0, v0; group 1: q heads 2,3 then k1, v1
    assert qkv[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(qkv, dims), (q, k, v)))


def test_missing_and_unplaced_tensors_are_named():
    model, dims = build_model(SMOKE["qwen2"], seed=1)
    hf = dict(model.state_dict())
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match=r"model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(hf, dims)
    hf = dict(model.state_dict(), **{"model.layers.0.extra.weight": torch.zeros(1)})
    with pytest.raises(ConversionError, match="no megatron place: model.layers.0.extra.weight"):
        hf_to_megatron(hf, dims)


def test_config_translation_per_family():
    q2, moe, ds = (transformer_config(SMOKE[f]) for f in ("qwen2", "qwen3_moe", "deepseek_v3"))
    assert q2["add_qkv_bias"] and q2["num_query_groups"] == SMOKE["qwen2"].num_kv_heads and "num_moe_experts" not in q2
    assert moe["qk_layernorm"] and moe["num_moe_experts"] == 8 and moe["moe_router_topk"] == 2
    assert moe["moe_router_score_function"] == "softmax" and moe["moe_router_pre_softmax"] is False
    assert moe["kv_channels"] == SMOKE["qwen3_moe"].head_dim
    assert ds["kv_lora_rank"] == 32 and ds["qk_pos_emb_head_dim"] == 8 and ds["moe_layer_freq"] == [0, 1, 1]
    assert ds["moe_router_score_function"] == "sigmoid" and ds["moe_router_enable_expert_bias"]
    assert ds["moe_shared_expert_intermediate_size"] == SMOKE["deepseek_v3"].moe_intermediate_size


def test_megatron_engine_refuses_the_cpu_before_building():
    from rlrecipes.engines.megatron.train import MegatronTrainEngine

    for layout, pp in (((1, 1), 1), ((2, 1), 2)):
        with pytest.raises(RuntimeError, match="computes on CUDA or NPU, not cpu; use the native engine"):
            MegatronTrainEngine(SMOKE["qwen2"], layout=layout, pp=pp, device="cpu")


def _megatron_ranks(layout, rank, etp=1):
    """megatron's coordinates of a global rank (order tp-cp-ep-dp-pp) as shard.Ranks."""
    from rlrecipes.engines.megatron.shard import Ranks

    loc = rank % layout.stage_size
    return Ranks(tp=layout.tp, tp_rank=loc % layout.tp, pp_layers=layout.pp_layers or (), pp_rank=rank // layout.stage_size,
                 ep=layout.ep, ep_rank=(loc // etp) % layout.ep, etp=etp, etp_rank=loc % etp)


LAYOUTS = [("qwen2", dict(tp=2, pp=2, dp=1, pp_layers=(1, 3)), 4), ("qwen2_tied", dict(tp=2, pp=2, dp=1, pp_layers=(3, 1)), 4),
           ("qwen3_moe", dict(tp=2, ep=4, dp=2), 2), ("qwen3_moe", dict(tp=1, pp=2, ep=2, dp=2, pp_layers=(1, 1)), 2),
           ("deepseek_v3", dict(tp=2, pp=3, ep=2, dp=1, pp_layers=(1, 1, 1)), 3)]


def _dims(case, layers):
    base = SMOKE["qwen2" if case == "qwen2_tied" else case]
    return dataclasses.replace(base, num_layers=layers, tie_embeddings=case == "qwen2_tied")


@pytest.mark.parametrize("case,kw,layers", LAYOUTS, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(LAYOUTS)])
def test_rank_shards_are_the_resharders_slices_and_convert_back(case, kw, layers):
    """Each rank's megatron tensors (TP / PP / EP slices, local expert numbering) come back under HF
    names as exactly the slice core.resharder expects that rank to hold in the train layout."""
    from rlrecipes.core.resharder import Layout
    from rlrecipes.core.resharder.layout import shard_for
    from rlrecipes.engines.megatron.shard import full_reader, hf_from_shard, megatron_shard, resharder_shards
    from rlrecipes.models import param_specs

    dims = dataclasses.replace(_dims(case, layers), num_heads=4, num_kv_heads=2, head_dim=16) \
        if case != "deepseek_v3" else _dims(case, layers)
    hf = build_model(dims, seed=3)[0].state_dict()
    layout = Layout(**kw)
    specs = param_specs(dims, layout.pp_layers)
    for rank in range(layout.world):
        r = _megatron_ranks(layout, rank)
        mg = megatron_shard(full_reader(hf), dims, r)
        assert all(".layers." not in k or int(k.split(".")[2]) < (layout.pp_layers or (layers,))[r.pp_rank] for k in mg)
        if dims.is_moe:
            local = {int(k.split(".")[6]) for k in mg if "local_experts" in k}
            assert not local or local == set(range(dims.num_experts // layout.ep))
        back = resharder_shards(hf_from_shard(mg, dims, r), dims, r)
        want = {s.name: shard_for(s, hf[s.name], layout, rank) for s in specs}
        want = {k: v for k, v in want.items() if v is not None}
        assert set(back) == set(want), rank
        for k, v in want.items():
            assert torch.equal(back[k], v), (rank, k)


def test_vocab_is_padded_to_a_multiple_of_tp_and_the_padding_dropped_on_the_way_back():
    from rlrecipes.engines.megatron.shard import Ranks, full_reader, hf_from_shard, megatron_shard, padded_vocab

    dims = dataclasses.replace(SMOKE["qwen2"], vocab_size=33)
    hf = build_model(dims, seed=3)[0].state_dict()
    assert padded_vocab(33, 2) == 34 and padded_vocab(32, 4) == 32
    parts = []
    for tp_rank in range(2):
        r = Ranks(tp=2, tp_rank=tp_rank)
        mg = megatron_shard(full_reader(hf), dims, r)
        assert mg["embedding.word_embeddings.weight"].shape[0] == 17 and mg["output_layer.weight"].shape[0] == 17
        parts.append(hf_from_shard(mg, dims, r)["lm_head.weight"])
    assert not parts[1][16:].any() or parts[1].shape[0] == 16
    assert torch.equal(torch.cat(parts), hf["lm_head.weight"])


def test_layouts_megatron_cannot_split_are_named():
    from rlrecipes.engines.megatron.shard import Ranks, check_layout

    with pytest.raises(ValueError, match="2 query groups .* TP4"):
        check_layout(SMOKE["qwen2"], Ranks(tp=4))
    with pytest.raises(ValueError, match="8 experts do not divide by EP3"):
        check_layout(SMOKE["qwen3_moe"], Ranks(ep=3))
    with pytest.raises(ValueError, match=r"pp_layers \[1, 2\] do not split 2 layers"):
        check_layout(SMOKE["qwen2"], Ranks(pp_layers=(1, 2)))


def test_pipeline_layout_places_embedding_and_loss():
    from rlrecipes.engines.megatron.train import pipeline_layout

    lay = pipeline_layout([7, 7, 8, 8, 8, 8, 8, 7])
    assert lay[0] == ["embedding"] + ["decoder"] * 7 and lay[-1] == ["decoder"] * 7 + ["loss"]
    assert sum(row.count("decoder") for row in lay) == 61
