"""``rlrecipes plan`` for long responses (issue 34): ``layout.sp`` carved out of DP, the rules of
Ulysses (native) and context parallelism (megatron), the memory a sequence-parallel rank holds, the
rollout KV cache at the longest sample, the smallest SP that fits, and the 32K plans of the
published megatron recipes."""
import dataclasses
import json

import pytest

from rlrecipes.engines.registry import capabilities
from typer.testing import CliRunner

from rlrecipes.cli import app
from rlrecipes.engines.megatron.layout import plan_rules
from rlrecipes.plan import build_plan, format_violations, placement_groups
from rlrecipes.plan.build import MEMORY_RULE
from rlrecipes.core.parallel import ParallelLayout
from rlrecipes.plan.checks import CONTEXT_RULE, KV_LONGEST_RULE, SP_ENGINE_RULE, SP_HEADS_RULE, SP_LAYOUT_RULE
from rlrecipes.plan.long_context import kv_token_bytes, longest_sample, padded_row
from rlrecipes.plan.memory import micro_batch_tokens
from rlrecipes.recipe import load_recipe

GiB = 2 ** 30
LONG = {"qwen3_moe_30b": 2048 + 32768, "deepseek_r1_671b": 1024 + 32768}


def _long(name: str, *extra: str):
    """A published recipe at 32K-token responses. The schema asks the packing budget to hold the
    longest sample, so it is raised with the length (megatron packs nothing: it does not count)."""
    return load_recipe(name, overrides=["rollout.sampling.max_new_tokens=32768",
                                        f"trainer.max_tokens_per_micro_batch={LONG[name]}", *extra])


def _native_7b(*extra: str, tokens: int = 0):
    """qwen25_7b on the native engines at TP1 (what Ulysses runs with); ``tokens``: prompt + response."""
    more = [f"rollout.sampling.max_new_tokens={tokens - 2048}", f"trainer.max_tokens_per_micro_batch={tokens}"] \
        if tokens else []
    return load_recipe("qwen25_7b", overrides=["actor.engine=native", "actor.layout.pp=1", "actor.layout.tp=1",
                                               "rollout.engine=native", *more, *extra])


def _rules(plan) -> set:
    return {v.rule for v in plan.violations}


# ---------------------------------------------------------------------------------------------
# layouts: SP is carved out of DP
# ---------------------------------------------------------------------------------------------
def test_role_layout_sp_is_carved_out_of_dp_and_shown():
    assert ParallelLayout("actor", 4, 1, 2, 16, sp=4).describe() == "TP4 PP1 EP2 SP4 DP1"
    assert ParallelLayout("actor", 4, 1, 2, 16).describe() == "TP4 PP1 EP2 DP4"  # unchanged without SP
    p = build_plan(_long("qwen3_moe_30b", "actor.layout.sp=4"))
    a = p.roles["actor"]
    assert (a.sp, a.dp) == (4, 1) and a.tp * a.pp * a.sp * a.dp == p.world
    assert p.roles["rollout"].sp == 1 and p.roles["rollout"].dp == 4
    assert json.loads(json.dumps(p.to_json()))["roles"]["actor"]["sp"] == 4
    groups = placement_groups(_long("qwen3_moe_30b", "actor.layout.sp=4"))
    assert groups.roles["actor"].dp == 1
    # the resharder sees SP ranks as more weight replicas (they hold the same weight shards)
    assert groups.reshard_layouts()[0] is groups.roles["actor"] and groups.reshard_layouts()[0].replicas == 4
    assert a.replicas == 4 and a.stage_size == 16


def test_world_must_divide_by_tp_pp_sp():
    p = build_plan(_native_7b("actor.layout.sp=3"), _search=False)
    assert "TP*PP*SP divides the world" in _rules(p)
    assert "TP1 x PP1 x SP3 = 3 does not divide 16 devices" in format_violations(p)


def test_megatron_places_ep_groups_over_dp_times_cp():
    """megatron carves experts out of every rank of a stage (expert-DP = world / (etp * ep * pp)):
    EP must divide DP x CP. DeepSeek at SP2: 8 nodes give DP2 x SP2 = 4 < EP8; 16 nodes DP4 x SP2 = 8."""
    r = _long("deepseek_r1_671b", "actor.layout.sp=2")
    assert "engine places EP groups across DP" in _rules(build_plan(r, 8))
    assert "EP8 does not divide DP2 x SP2 = 4" in format_violations(build_plan(r, 8))
    assert build_plan(r, 16).ok, format_violations(build_plan(r, 16))


# ---------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------
def test_sp_on_an_engine_that_cannot_split_sequences(monkeypatch):
    import rlrecipes.engines.megatron as meg

    monkeypatch.setattr(meg, "CAPABILITIES", dataclasses.replace(meg.CAPABILITIES, sequence_parallel=""))
    p = build_plan(_long("qwen3_moe_30b", "actor.layout.sp=4"))
    found = [v for v in p.violations if v.rule == SP_ENGINE_RULE]
    assert len(found) == 1 and "actor.layout.sp=4" in found[0].detail and "actor.engine: native" in found[0].detail
    assert not p.suggestions  # an engine that cannot split sequences gets no SP suggestion


def test_native_ulysses_needs_tp1_ep1_and_no_routing_replay():
    p = build_plan(_native_7b("actor.layout.tp=2", "actor.layout.sp=2"))
    assert [v.rule for v in p.violations] == [SP_LAYOUT_RULE]
    assert "actor.layout.tp=1" in p.violations[0].detail
    tp1 = ["actor.layout.tp=1", "actor.layout.ep=1"]  # the smoke recipe's TP2 EP2
    moe = load_recipe("qwen3_moe_30b", smoke=True, overrides=["actor.layout.sp=2", "actor.layout.tp=1",
                                                              "resources.devices_per_node=4"])
    assert "TP1 EP2" in format_violations(build_plan(moe))
    rr = load_recipe("qwen3_moe_30b", smoke=True, overrides=["actor.layout.sp=2", *tp1,
                                                             "algorithm.routing_replay=true"])
    p = build_plan(rr)
    assert SP_LAYOUT_RULE in _rules(p) and "algorithm.routing_replay=false" in format_violations(p)
    ok = build_plan(load_recipe("qwen3_moe_30b", smoke=True, overrides=["actor.layout.sp=2", *tp1]))
    assert ok.ok, format_violations(ok)
    lora = load_recipe("qwen25_7b", smoke=True, overrides=["actor.layout.sp=2", "actor.lora.rank=8"])
    assert SP_LAYOUT_RULE not in _rules(build_plan(lora))  # LoRA + SP is fine


def test_ulysses_heads_divide_by_tp_times_sp():
    p = build_plan(_native_7b("actor.layout.sp=8"))  # 28 heads over 8 ranks
    assert SP_HEADS_RULE in _rules(p)
    assert "use actor.layout.sp in 2, 4, 7, 14" in format_violations(p)
    assert SP_HEADS_RULE not in _rules(build_plan(_native_7b("actor.layout.sp=4")))


def test_ref_layout_keeps_the_actors_sp_on_the_native_engine():
    r = load_recipe("qwen25_7b", smoke=True, overrides=["actor.layout.sp=2", "ref.layout={tp: 1, pp: 1, ep: 1}"])
    p = build_plan(r)
    assert "engine keeps ref/critic on the actor layout" in _rules(p) and "SP1" in format_violations(p)


def test_megatron_cp_needs_fused_attention_on_the_target():
    """megatron's local attention refuses CP: CUDA needs TransformerEngine (never assumed for another
    machine), Ascend MindSpeed (part of its supported stack)."""
    cuda = build_plan(_long("qwen3_moe_30b", "actor.layout.sp=4", "resources.device=cuda"), _search=False)
    assert "TransformerEngine" in format_violations(cuda)
    assert "TransformerEngine" not in format_violations(build_plan(_long("qwen3_moe_30b", "actor.layout.sp=4")))
    r = _long("qwen3_moe_30b", "actor.layout.sp=4")
    here = plan_rules(layout=ParallelLayout("actor", tp=4, ep=2, world=16, sp=4), dims=r.model.dims(), etp=None,
                      device="npu", installed=True, recipe=r)
    assert any("MindSpeed" in p for p in here)  # not installed on this machine


def test_megatron_cp_rows_pad_to_its_chunks():
    """megatron-core cuts a row into 2 x CP chunks, each CP rank's pair split over TP: the engine pads to
    lcm(2 cp, cp tp), so any recipe length plans, with the padding counted."""
    assert padded_row(33792, 2, 4) == 33792 and padded_row(34817, 4, 4) == 34832 and padded_row(4097, 1, 4) == 4100
    p = build_plan(load_recipe("qwen3_moe_30b", overrides=[
        "rollout.sampling.max_new_tokens=32768", "data.max_prompt_length=2049", "actor.layout.sp=4",
        "trainer.max_tokens_per_micro_batch=34817"]))
    assert p.sequence["roles"]["actor"] == {"sp": 4, "row_tokens": 34832, "tokens_per_rank": 8708}


def test_the_longest_sample_fits_the_models_context():
    p = build_plan(load_recipe("qwen25_7b", overrides=["rollout.sampling.max_new_tokens=32768",
                                                       "trainer.max_tokens_per_micro_batch=34816"]))
    found = [v for v in p.violations if v.rule == CONTEXT_RULE]
    assert found and "rollout.sampling.max_new_tokens to 30720" in found[0].detail


# ---------------------------------------------------------------------------------------------
# memory per SP rank
# ---------------------------------------------------------------------------------------------
def test_a_micro_batch_holds_at_least_one_whole_sample():
    r = _native_7b(tokens=32768)
    r.trainer.max_tokens_per_micro_batch = 4096  # below the longest sample (a run's packer takes it alone)
    assert micro_batch_tokens(r) == 32768
    r.trainer.max_tokens_per_micro_batch = None
    assert micro_batch_tokens(r) == r.trainer.micro_batch * 32768


def test_native_activations_and_logits_scale_with_one_over_sp():
    one = build_plan(_native_7b(tokens=32768)).train_memory
    r = load_recipe("qwen25_7b")
    dims = r.model.dims()
    # the chunked head: one chunk's logits (compute dtype 2 + fp32 softmax and gradient 8) at any SP
    chunk = capabilities("native").head_chunk_tokens * dims.vocab_size * (2 + 8)
    for sp in (2, 4):
        m = build_plan(_native_7b(f"actor.layout.sp={sp}", tokens=32768)).train_memory
        assert m.activations == pytest.approx((one.activations - chunk) / sp + chunk, rel=1e-3)
        # FSDP2 shards over DP x SP = every rank: the sharded state does not change with SP
        assert (m.weights, m.grads, m.optimizer) == pytest.approx((one.weights, one.grads, one.optimizer))
    # the whole-row attention mask (34816^2 booleans) is the same on every SP rank
    assert build_plan(_native_7b("actor.layout.sp=4", tokens=32768)).train_memory.transient >= 32768 ** 2


def test_megatron_activations_scale_with_one_over_cp_and_local_attention_is_quadratic():
    m = {sp: build_plan(_long("qwen3_moe_30b", f"actor.layout.sp={sp}")).train_memory for sp in (1, 2, 4)}
    assert m[4].activations == pytest.approx(m[2].activations / 2, rel=1e-3)
    assert m[4].transient == pytest.approx(m[2].transient / 2, rel=1e-3)
    # sp=1 also holds the fp32 response slice the log-probs gather and its gradient (8 bytes per
    # response element; CP takes every column's log-prob without that gather: memory.pipeline_logits_per_element)
    r = _long("qwen3_moe_30b")
    plan1 = build_plan(r)
    T = padded_row(longest_sample(r), 1, plan1.roles["actor"].tp)
    slice_bytes = r.trainer.micro_batch * min(T, r.rollout.max_response_len) * r.model.dims().vocab_size \
        / plan1.roles["actor"].tp * 8
    assert m[1].activations == pytest.approx(2 * m[2].activations + slice_bytes, rel=1e-3)
    # sp=1: megatron's local attention holds [rows, heads / tp, T, T] scores; CP's fused attention none
    assert m[1].transient > 100 * m[2].transient and m[1].transient > 200 * GiB
    # the distributed optimizer shards over DP x CP: unchanged by CP
    assert m[1].optimizer == pytest.approx(m[4].optimizer) and m[1].weights == m[4].weights


# ---------------------------------------------------------------------------------------------
# the 32K plans and the suggestion line
# ---------------------------------------------------------------------------------------------
def test_qwen3_moe_30b_at_32k_refuses_at_sp1_and_suggests_sp4():
    p = build_plan(_long("qwen3_moe_30b"))
    assert _rules(p) == {MEMORY_RULE}
    text = format_violations(p)
    assert "training memory does not fit at sp=1: actor.layout.sp=4 fits" in text
    assert "no node count fixes these" in text and p.nearest_valid_nodes == []
    ok = build_plan(_long("qwen3_moe_30b", "actor.layout.sp=4"))
    assert ok.ok, format_violations(ok)
    assert ok.train_memory.total <= 64 * GiB and ok.roles["actor"].describe() == "TP4 PP1 EP2 SP4 DP1"
    assert "actor SP4: 8704 tokens of a 34816-token row per rank" in " ".join(ok.sequence_lines())
    # sp=2 does not fit: the suggestion is the smallest
    assert MEMORY_RULE in _rules(build_plan(_long("qwen3_moe_30b", "actor.layout.sp=2")))


def test_deepseek_r1_671b_at_32k_refuses_at_sp1_and_suggests_sp2():
    p = build_plan(_long("deepseek_r1_671b"))
    assert _rules(p) == {MEMORY_RULE}
    assert "actor.layout.sp=2 fits" in format_violations(p)
    ok = build_plan(_long("deepseek_r1_671b", "actor.layout.sp=2"))
    assert ok.ok, format_violations(ok)
    assert ok.train_memory.total + ok.ref_memory.total <= 64 * GiB
    assert ok.roles["actor"].dp == 4 and ok.roles["ref"].sp == 2
    # the recipe's own 16 nodes are the smallest count this layout fits (EP8 over DP x CP)
    assert build_plan(_long("deepseek_r1_671b", "actor.layout.sp=2"), 8).nearest_valid_nodes[0] == 16


def test_native_suggestion_is_ulysses_and_names_what_blocks():
    p = build_plan(_native_7b("resources.device_memory_gb=24", tokens=32768))
    assert "training memory does not fit at sp=1: actor.layout.sp=2 fits" in format_violations(p)
    assert "Ulysses" in p.suggestions[0]
    tp2 = build_plan(_native_7b("actor.layout.tp=2", "resources.device_memory_gb=32", tokens=32768))
    assert "actor.layout.sp=2 would fit" in tp2.suggestions[0] and "TP1 EP1" in tp2.suggestions[0]


def test_cli_plan_json_carries_the_suggestion():
    res = CliRunner().invoke(app, ["plan", "qwen3_moe_30b", "rollout.sampling.max_new_tokens=32768",
                                   "trainer.max_tokens_per_micro_batch=34816", "--json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.output)
    assert any("actor.layout.sp=4 fits" in s for s in data["suggestions"])


# ---------------------------------------------------------------------------------------------
# rollout KV cache at the longest sample
# ---------------------------------------------------------------------------------------------
def test_kv_cache_per_device_splits_gqa_heads_up_to_their_count():
    dims = load_recipe("qwen3_moe_30b").model.dims()  # 4 KV heads
    assert kv_token_bytes(dims, 8) == kv_token_bytes(dims, 4) == kv_token_bytes(dims, 1) / 4
    mla = load_recipe("deepseek_r1_671b").model.dims()
    assert kv_token_bytes(mla, 2) == kv_token_bytes(mla, 1)  # the latent is on every TP rank


def test_kv_cache_refuses_when_one_longest_sequence_does_not_fit():
    p = build_plan(_long("qwen3_moe_30b", "actor.layout.sp=4", "rollout.inference.gpu_memory_utilization=0.125"))
    found = [v for v in p.violations if v.rule == KV_LONGEST_RULE]
    assert found, format_violations(p)
    assert "rollout.sampling.max_new_tokens=32768" in found[0].detail
    assert "raise rollout.layout.ep" in found[0].detail  # TP4 already splits the 4 KV heads
    tp2 = build_plan(_long("qwen3_moe_30b", "actor.layout.sp=4", "rollout.layout.tp=2",
                           "rollout.inference.gpu_memory_utilization=0.14"))
    assert "raise rollout.layout.tp (TP2 now" in format_violations(tp2)
    assert p.nearest_valid_nodes == []  # a rollout device's memory does not change with the node count


def test_kv_cache_note_when_a_rank_runs_more_than_fit():
    p = build_plan(_long("deepseek_r1_671b", "actor.layout.sp=2"))
    note = " ".join(p.notes)
    assert "rollout.sampling.max_new_tokens=32768" in note and "each of the 128 rollout ranks" in note
    assert "rollout.inference.max_num_seqs=" in note
    assert not build_plan(load_recipe("deepseek_r1_671b")).notes  # 4K tokens: every concurrent sequence fits
