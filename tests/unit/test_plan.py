import random

import pytest

from rlrecipes.plan import build_plan, format_violations
from rlrecipes.recipe import load_recipe


def test_deepseek_16_nodes_passes_pinned_layout():
    p = build_plan(load_recipe("deepseek_r1_671b"), 16)
    assert p.ok, format_violations(p)
    assert p.world == 256 and p.roles["actor"].dp == 8 and p.roles["rollout"].dp == 128
    assert p.changes == []
    assert 0 < p.train_memory.total <= 64 * 2**30 and 0 < p.rollout_memory.total <= 64 * 2**30
    assert 0 < p.reshard_bytes_per_device < p.reshard_full_bytes


def test_deepseek_48_nodes_scales_dp_and_says_so():
    p = build_plan(load_recipe("deepseek_r1_671b"), 48)
    assert p.ok, format_violations(p)
    assert p.roles["actor"].dp == 24 and p.roles["actor"].tp == 4 and p.roles["actor"].pp == 8
    assert p.global_batch == 1536
    text = " ".join(p.changes)
    assert "actor DP 8 -> 24" in text and "global batch 512 -> 1536" in text
    strong = build_plan(load_recipe("deepseek_r1_671b"), 48, keep_batch=True)
    assert not strong.ok and any("global batch divides by DP" == v.rule for v in strong.violations)


def test_deepseek_3_nodes_fails_with_every_reason_and_nearest():
    p = build_plan(load_recipe("deepseek_r1_671b"), 3)
    assert not p.ok
    rules = {v.rule for v in p.violations}
    assert "TP*PP divides the world" in rules and "EP divides DP*TP" in rules
    # 8 nodes would fit TP4 PP8 (DP4) but not EP8: megatron's expert-TP = TP puts EP groups across DP
    assert p.nearest_valid_nodes == [16]
    assert "32 does not divide 48" in format_violations(p)


def test_rules_reported_together():
    r = load_recipe("qwen25_7b", overrides=["actor.layout.tp=3", "rollout.layout.pp=2", "actor.layout.pp_layers=[10,10]"])
    p = build_plan(r, 1)
    rules = {v.rule for v in p.violations}
    assert {"rollout PP = 1", "attention heads divide by TP", "layer split sums to the layer count"} <= rules


def test_experts_divide_by_ep_and_memory():
    r = load_recipe("qwen3_moe_30b", overrides=["rollout.layout.ep=16", "rollout.layout.tp=1"])
    assert build_plan(r, 1).ok  # 128 experts / 16
    r = load_recipe("qwen3_moe_30b", overrides=["rollout.layout.ep=3"])
    assert "experts divide by EP" in {v.rule for v in build_plan(r, 3).violations}
    r = load_recipe("qwen25_7b", overrides=["actor.layout.tp=1", "actor.layout.pp=1", "resources.device_memory_gb=16"])
    assert "training memory fits the device" in {v.rule for v in build_plan(r, 1).violations}


@pytest.mark.parametrize("name", ["qwen25_7b", "qwen3_moe_30b", "deepseek_r1_671b"])
def test_property_random_node_counts(name):
    """Whatever the node count: a valid plan's layouts multiply out to the world and the batch divides;
    an invalid one always lists a rule, and its nearest valid counts are valid."""
    recipe = load_recipe(name)
    rng = random.Random(0)
    for nodes in rng.sample(range(1, 80), 12):
        p = build_plan(recipe, nodes)
        if p.ok:
            for role in p.roles.values():
                assert role.tp * role.pp * role.dp == p.world
                assert (role.dp * role.tp) % role.ep == 0
                if role.role != "rollout":
                    assert p.global_batch % role.dp == 0
        else:
            assert p.violations
            for n in p.nearest_valid_nodes:
                assert build_plan(recipe, n).ok


@pytest.mark.parametrize("name", ["qwen25_7b", "qwen3_moe_30b", "deepseek_r1_671b"])
def test_smoke_plans_pass(name):
    p = build_plan(load_recipe(name, smoke=True))
    assert p.ok, format_violations(p)


def test_native_engine_keeps_ref_on_actor_layout():
    r = load_recipe("qwen25_7b", smoke=True, overrides=["ref.layout={tp: 2, pp: 1, ep: 1}"])
    rules = {v.rule for v in build_plan(r).violations}
    assert "engine keeps ref/critic on the actor layout" in rules


def test_vllm_ascend_settings_checked_in_plan():
    p = build_plan(load_recipe("deepseek_r1_671b"), 16)
    assert p.ok and p.inference["vllm_ascend"] == "0.23.0"
    assert p.inference["additional_config"]["multistream_overlap_shared_expert"] is True
    bad = build_plan(load_recipe("deepseek_r1_671b", overrides=["rollout.inference.vllm_ascend_version=0.26.0"]), 16)
    assert [v.rule for v in bad.violations] == ["inference settings supported by the rollout engine"]
    assert bad.nearest_valid_nodes == [] and "no node count fixes these" in format_violations(bad)


def _native_7b(*extra):
    return load_recipe("qwen25_7b", overrides=["actor.engine=native", "actor.layout.pp=1", "rollout.engine=native",
                                               *extra])


def test_native_engine_memory_model_follows_fsdp_sharding_and_memory_features():
    """The native engine's estimate: fp32 master/grad/Adam shards over DP, activations by token
    budget, FSDP transients (checked against measurement by benchmarks/engine_memory.py)."""
    base = build_plan(_native_7b())
    m = base.train_memory
    assert base.ok, format_violations(base)
    local = 7.62e9 / 2 / 8  # TP2, DP8 on 16 devices
    assert m.weights == pytest.approx(4 * local, rel=0.02) and m.grads == m.weights
    assert m.optimizer == pytest.approx(2 * m.weights) and m.transient > 0 and m.activations > 0
    twice = build_plan(_native_7b(), nodes=2).train_memory  # DP16: the shards halve, activations stay
    assert twice.weights == pytest.approx(m.weights / 2) and twice.activations == m.activations
    assert build_plan(_native_7b("actor.offload_optimizer=true")).train_memory.optimizer == 0
    on = build_plan(_native_7b("actor.recompute=true")).train_memory
    off = build_plan(_native_7b("actor.recompute=false")).train_memory
    assert on.activations < off.activations / 4
    small = build_plan(_native_7b("trainer.max_tokens_per_micro_batch=4096")).train_memory
    big = build_plan(_native_7b("trainer.max_tokens_per_micro_batch=16384")).train_memory
    assert big.activations == pytest.approx(4 * small.activations)
    fp32 = build_plan(_native_7b("model.dtype=fp32")).train_memory
    assert fp32.activations > m.activations and fp32.weights == m.weights  # masters are fp32 either way


# ---- disaggregated placement (issue 16) -------------------------------------------------------
def _disagg(name="qwen25_7b", rollout_devices=8, *extra):
    return load_recipe(name, overrides=["resources.placement=disaggregated",
                                        f"resources.rollout_devices={rollout_devices}", *extra])


def test_disaggregated_plan_has_two_device_groups():
    from rlrecipes.plan import placement_groups

    p = build_plan(_disagg("qwen25_7b", 8, "algorithm.max_staleness=2"))
    assert p.ok, format_violations(p)
    assert (p.placement, p.train_devices, p.rollout_devices) == ("disaggregated", 8, 8)
    a, ro = p.roles["actor"], p.roles["rollout"]
    assert (a.world, a.dp, ro.world, ro.dp) == (8, 2, 8, 8) and p.roles["ref"].dp == 2
    # the train group has no KV cache / rollout weights; the rollout group no grads / optimizer
    assert p.train_memory.kv_cache == 0 and p.train_memory.grads > 0 and p.train_memory.optimizer > 0
    assert p.rollout_memory.grads == p.rollout_memory.optimizer == 0 and p.rollout_memory.kv_cache > 0
    # cross-group bytes from the resharder's plan: a rollout device receives its whole rollout shard
    # (TP1: the whole model), the 8 train devices share the 8 rollout devices' sends
    assert p.reshard_method == "resharder plan"
    assert p.reshard_bytes_per_device == pytest.approx(p.reshard_full_bytes, rel=0.01)
    assert p.reshard_send_bytes_per_device == pytest.approx(p.reshard_bytes_per_device, rel=0.01)
    j = p.to_json()
    assert j["groups"]["train"] == {"devices": 8, "ranks": [0, 8], "roles": ["actor", "ref"],
                                    "memory_gib": p.train_memory.gib()}
    assert j["groups"]["rollout"]["ranks"] == [8, 16] and j["placement"] == "disaggregated"
    lines = "\n".join(p.placement_lines())
    assert "ranks 0-7" in lines and "ranks 8-15" in lines and "nothing is swapped out" in lines
    g = placement_groups(_disagg("qwen25_7b", 8))
    assert g.disaggregated and g.train_ranks == range(8) and g.rollout_ranks == range(8, 16)
    assert g.roles["actor"].dp == 2 and g.roles["rollout"].dp == 8
    assert g.group_of(3) == "train" and g.group_of(12) == "rollout"
    train, rollout = g.reshard_layouts()
    assert (train.world, rollout.world) == (8, 8) and train.pp == 2


def test_disaggregated_scales_the_train_group_and_keeps_the_rollout():
    p = build_plan(_disagg("deepseek_r1_671b", 128), 24)
    assert p.ok, format_violations(p)
    assert p.train_devices == 256 and p.rollout_devices == 128
    assert p.roles["actor"].dp == 8 and p.roles["rollout"].dp == 64
    assert "train group 128 -> 256, rollout group 128" in " ".join(p.changes)
    # a rollout device receives its whole shard, more than in the colocated plan where it holds part of it
    co = build_plan(load_recipe("deepseek_r1_671b"), 16)
    assert p.reshard_bytes_per_device > co.reshard_bytes_per_device > 0


def test_colocated_output_and_groups_unchanged():
    from rlrecipes.plan import placement_groups

    p = build_plan(load_recipe("qwen25_7b"))
    assert p.placement == "colocated" and p.placement_lines() == []
    j = p.to_json()
    assert "groups" not in j and "placement" not in j
    g = placement_groups(load_recipe("qwen25_7b"))
    assert not g.disaggregated and g.train_ranks == g.rollout_ranks == range(16)
    assert g.group_of(5) == "both" and g.roles["actor"].dp == 4 and g.roles["rollout"].dp == 16


@pytest.mark.parametrize("rollout_devices, extra, needles", [
    (16, [], ["resources.rollout_devices=16", "leaves no training device", "below 16"]),
    (6, [], ["actor: TP2 x PP2 = 4 does not divide the 10 training devices", "resources.rollout_devices=6",
             "set resources.rollout_devices=4 or 8"]),
    (6, ["rollout.layout.tp=4"], ["rollout: TP4 x PP1 = 4 does not divide resources.rollout_devices=6",
                                  "set resources.rollout_devices=4 or 8", "rollout.layout.tp that divides 6"]),
    (8, ["resharding.strategy=allgather_swap"], ["resharding.strategy=allgather_swap", "resharding.strategy=auto"]),
])
def test_disaggregated_errors_name_the_key_and_the_fix(rollout_devices, extra, needles):
    from rlrecipes.plan import PlanError, placement_groups

    r = _disagg("qwen25_7b", rollout_devices, *extra)
    p = build_plan(r)
    assert not p.ok
    text = format_violations(p)
    if rollout_devices != 16:  # no node count fixes these: the nearest-node search is skipped
        assert "no node count fixes these" in text, text
    for n in needles:
        assert n in text, text
    if not any(e.startswith("resharding.") for e in extra):  # placement_groups checks only the device split
        with pytest.raises(PlanError) as e:
            placement_groups(r)
        assert needles[0] in str(e.value)


def test_megatron_rules_fail_in_plan_before_anything_starts():
    # PPO's critic: the megatron engine trains none
    p = build_plan(load_recipe("qwen25_7b", overrides=["algorithm.name=ppo", "algorithm.adv_estimator=gae"]), 1)
    assert not p.ok and "trains a critic" in format_violations(p) and "actor.engine: native" in format_violations(p)
    # expert-TP = TP: megatron's EP groups span DP ranks, so EP must divide DP (qwen3 MoE: TP4 -> DP4 on 16)
    p = build_plan(load_recipe("qwen3_moe_30b", overrides=["actor.layout.ep=8"]), 1)
    assert not p.ok and "EP8 does not divide DP4" in format_violations(p)
    assert build_plan(load_recipe("qwen3_moe_30b"), 1).ok


def test_plan_shows_exactly_the_roles_the_workers_build():
    """One rule (recipe.roles.roles_of) for plan and workers: no KL term -> no reference model."""
    from rlrecipes.plan import build_plan
    from rlrecipes.recipe import load_recipe
    from rlrecipes.recipe.roles import roles_of

    for overrides, ref in ((["algorithm.use_kl_loss=false", "algorithm.use_kl_in_reward=false"], False),
                           (["algorithm.use_kl_loss=true"], True),
                           (["algorithm.use_kl_loss=true", "ref.enabled=false"], False)):
        r = load_recipe("qwen25_7b", smoke=True, overrides=overrides)
        assert roles_of(r).ref is ref
        assert ("ref" in build_plan(r).roles) is ref, overrides
    ppo = load_recipe("qwen25_7b", smoke=True, overrides=["algorithm.name=ppo", "algorithm.adv_estimator=gae"])
    assert roles_of(ppo).critic and "critic" in build_plan(ppo).roles
