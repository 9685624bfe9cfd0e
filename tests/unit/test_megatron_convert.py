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


@pytest.mark.parametrize("family", [f for f in SMOKE if not SMOKE[f].has_vision])  # megatron: text decoders
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


@pytest.mark.parametrize("family", [f for f in SMOKE if not SMOKE[f].has_vision])  # megatron: text decoders
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
    # MLA: the local spec builds q/kv norms only with qk_layernorm; the attention output per head is a value head
    assert ds["qk_layernorm"] is True and ds["kv_channels"] == SMOKE["deepseek_v3"].v_head_dim
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
    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.core.resharder.layout import shard_for
    from rlrecipes.engines.megatron.shard import full_reader, hf_from_shard, megatron_shard, resharder_shards
    from rlrecipes.models import param_specs

    dims = dataclasses.replace(_dims(case, layers), num_heads=4, num_kv_heads=2, head_dim=16) \
        if case != "deepseek_v3" else _dims(case, layers)
    hf = build_model(dims, seed=3)[0].state_dict()
    layout = ParallelLayout.of(**kw)
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

    with pytest.raises(ValueError, match="KV heads divide by TP: layout: 2 KV heads, TP4"):
        check_layout(SMOKE["qwen2"], Ranks(tp=4))
    with pytest.raises(ValueError, match="experts divide by EP: layout: 8 experts, EP3"):
        check_layout(SMOKE["qwen3_moe"], Ranks(ep=3))
    with pytest.raises(ValueError, match=r"pp_layers \[1, 2\] sums to 3, model has 2 layers"):
        check_layout(SMOKE["qwen2"], Ranks(pp_layers=(1, 2)))
    with pytest.raises(ValueError, match=r"pp_layers \[2, 0\] leaves a stage without layers"):
        check_layout(SMOKE["qwen2"], Ranks(pp_layers=(2, 0)))
    with pytest.raises(ValueError, match="MLP size .* does not divide by TP3"):  # megatron's own rule
        check_layout(dataclasses.replace(SMOKE["qwen2"], num_heads=6, num_kv_heads=3), Ranks(tp=3))


def test_pipeline_layout_places_embedding_and_loss():
    from rlrecipes.engines.megatron.layout import pipeline_layout

    lay = pipeline_layout([7, 7, 8, 8, 8, 8, 8, 7])
    assert lay[0] == ["embedding"] + ["decoder"] * 7 and lay[-1] == ["decoder"] * 7 + ["loss"]
    assert sum(row.count("decoder") for row in lay) == 61


# ------------------------------------------------------------------------------------- layout.py
def _planned_actor(name: str, nodes=None):
    """(dims, HF config dict, megatron Ranks) of a shipped recipe's actor as ``plan`` lays it out."""
    from rlrecipes.engines.megatron.shard import Ranks
    from rlrecipes.models import hf_config
    from rlrecipes.plan import build_plan
    from rlrecipes.recipe.loading import load_recipe

    recipe = load_recipe(name)
    a = build_plan(recipe, nodes).roles["actor"]
    dims = recipe.model.dims()
    hf = hf_config(dims).to_dict()
    return recipe, dims, hf, Ranks(tp=a.tp, pp_layers=tuple(a.pp_layers or ()) if a.pp > 1 else (), ep=a.ep, etp=a.tp)


RECIPES = [("qwen25_7b", None), ("qwen3_moe_30b", None), ("deepseek_r1_671b", 48)]


@pytest.mark.parametrize("name,nodes", RECIPES)
def test_engine_config_for_the_shipped_recipes(name, nodes):
    """The TransformerConfig keywords the engine builds for each recipe's planned actor layout: sequence
    parallelism with TP > 1 (MoE training requires it), the pipeline layout of the plan's layer split,
    variable sequence lengths with the all-to-all dispatcher across stages, recompute, DeepSeek's
    dense first layers and MLA norms. The megatron tier constructs the real configs from them."""
    from rlrecipes.engines.megatron.layout import engine_config_kwargs, layout_problems

    recipe, dims, hf, r = _planned_actor(name, nodes)
    kw = engine_config_kwargs(dims, hf, r, torch.bfloat16, recompute=recipe.actor.recompute)
    assert kw["tensor_model_parallel_size"] == r.tp > 1 and kw["sequence_parallel"] is True
    assert kw["bf16"] and not kw["fp16"] and kw["params_dtype"] == torch.bfloat16
    assert kw["recompute_granularity"] == "full" and kw["recompute_method"] == "uniform"
    if r.pp > 1:
        lay = kw["pipeline_model_parallel_layout"]
        assert [row.count("decoder") for row in lay] == list(r.pp_layers)
        assert kw["variable_seq_lengths"] and kw["moe_token_dispatcher_type"] == "alltoall"
        assert kw["pipeline_dtype"] == torch.bfloat16
    if dims.is_moe:
        assert kw["moe_layer_freq"] == [0] * dims.first_k_dense + [1] * (dims.num_layers - dims.first_k_dense)
    if dims.is_mla:
        assert kw["qk_layernorm"] and kw["kv_channels"] == dims.v_head_dim and dims.first_k_dense == 3
    # no refusal on the devices the recipes run on
    for device, te, ms in (("npu", False, True), ("cuda", True, False)):
        assert layout_problems(dims, tp=r.tp, pp=r.pp, ep=r.ep, etp=r.etp, device=device, have_te=te,
                               have_mindspeed=ms, pp_layers=r.pp_layers or None,
                               offload_optimizer=recipe.actor.offload_optimizer, megatron_core="0.16.1") == []
    # a reference engine (not training) gets no recompute
    assert "recompute_granularity" not in engine_config_kwargs(dims, hf, r, torch.bfloat16, recompute=True,
                                                               training=False)


def test_layout_problems_name_the_reason_and_the_fix():
    from rlrecipes.engines.megatron.layout import layout_problems

    q2, moe = SMOKE["qwen2"], SMOKE["qwen3_moe"]
    ok = dict(tp=2, pp=1, ep=1, device="cuda", have_te=False, have_mindspeed=False)
    assert layout_problems(q2, **ok) == []
    assert any("CUDA or NPU, not cpu" in p and "actor.engine: native" in p
               for p in layout_problems(q2, **dict(ok, device="cpu")))
    assert any("needs MindSpeed" in p for p in layout_problems(q2, **dict(ok, device="npu")))
    assert layout_problems(q2, **dict(ok, device="npu", have_mindspeed=True)) == []
    # heads, experts, stages: the layout rules every engine shares (ParallelLayout.model_problems), which
    # plan reports once and the engine's check_layout raises; megatron's own: expert-TP, the MLP size
    assert layout_problems(q2, **dict(ok, tp=4)) == [] and layout_problems(moe, **dict(ok, ep=3)) == []
    assert any("expert size" in p and "expert-TP" in p for p in layout_problems(moe, **dict(ok, etp=5)))
    # MLA builds with megatron's local attention through the engine's adapter: no TE / MindSpeed needed
    assert layout_problems(SMOKE["deepseek_v3"], **ok) == []
    # the host optimizer on megatron-core < 0.19 without TE fails in OptimizerConfig (TE version check)
    off = dict(ok, offload_optimizer=True)
    assert any("offload_optimizer" in p and "transformer-engine" in p
               for p in layout_problems(q2, **dict(off, megatron_core="0.16.1")))
    assert layout_problems(q2, **dict(off, megatron_core="0.19.1")) == []
    assert layout_problems(q2, **dict(off, megatron_core="0.16.1", have_te=True)) == []


def test_optimizer_config_offloads_everything_and_scales_fp16():
    from rlrecipes.engines.megatron.layout import FP16_INITIAL_LOSS_SCALE, optimizer_config_kwargs

    base = dict(lr=1e-6, weight_decay=0.01, grad_clip=1.0)
    kw = optimizer_config_kwargs(**base, dtype=torch.bfloat16, offload=False)
    assert kw["use_distributed_optimizer"] and kw["bf16"] and "optimizer_cpu_offload" not in kw
    kw = optimizer_config_kwargs(**base, dtype=torch.bfloat16, offload=True)
    assert kw["optimizer_cpu_offload"] and kw["optimizer_offload_fraction"] == 1.0
    assert kw["use_precision_aware_optimizer"] and kw["decoupled_weight_decay"]
    assert kw["main_params_dtype"] == kw["main_grads_dtype"] == torch.float32
    kw = optimizer_config_kwargs(**base, dtype=torch.float16, offload=False)
    assert kw["fp16"] and kw["loss_scale"] is None and kw["initial_loss_scale"] == FP16_INITIAL_LOSS_SCALE


def test_rows_are_right_aligned_and_padded_to_a_multiple_of_tp(random_seq_batch):
    """The engine's megatron rows: every sample from column 0, padding after it, the length a
    multiple of TP under sequence parallelism; the response logit index picks the column before
    each response token."""
    from rlrecipes.engines.megatron.layout import padded_length, response_logit_index, right_align
    from rlrecipes.engines.native.batching import micro_batches

    assert [padded_length(n, 1) for n in (5, 6)] == [5, 6]
    assert [padded_length(n, 4) for n in (5, 8, 9)] == [8, 8, 12]
    batch = random_seq_batch(50, n=5)
    (mb,) = micro_batches(batch, 8, pad_id=0, collective=False)
    T = mb["input_ids"].shape[1]
    R = mb["response_mask"].shape[1]
    ids, lead = right_align(mb["input_ids"], mb["attention_mask"], padded_length(T, 4), pad_id=0)
    assert ids.shape == (5, padded_length(T, 4)) and ids.shape[1] % 4 == 0
    idx = response_logit_index(lead, T - R, R)
    for i, (p, r) in enumerate(zip(batch.prompts, batch.responses)):
        n = p.numel() + r.numel()
        assert torch.equal(ids[i, :n], torch.cat([p, r])) and not ids[i, n:].any()
        # the logits at idx[i, j] predict the token one column later: response token j
        assert torch.equal(ids[i, idx[i, :r.numel()] + 1], r)
    with pytest.raises(ValueError, match="shorter"):
        right_align(mb["input_ids"], mb["attention_mask"], T - 1, pad_id=0)
