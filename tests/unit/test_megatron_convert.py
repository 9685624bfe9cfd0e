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


def test_megatron_engine_refuses_the_cpu_and_unwritten_layouts_before_building():
    from rlrecipes.engines.megatron.train import MegatronTrainEngine

    with pytest.raises(RuntimeError, match="computes on CUDA or NPU, not cpu; use the native engine"):
        MegatronTrainEngine(SMOKE["qwen2"], device="cpu")
    with pytest.raises(NotImplementedError, match="TP2 PP1 EP1 is not written yet"):
        MegatronTrainEngine(SMOKE["qwen2"], layout=(2, 1), device="cpu")
