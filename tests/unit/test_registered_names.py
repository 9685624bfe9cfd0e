"""The schema takes engine, algorithm and tool-format names from their registries: a toy engine
registered in a test is accepted by the schema and by plan with no edit outside its own module
and the registry (issue 47)."""
import sys
import types

import pytest

from rlrecipes.engines import registry
from rlrecipes.engines.capabilities import Capabilities
from rlrecipes.plan import build_plan
from rlrecipes.recipe import RecipeError, load_recipe


@pytest.fixture
def toy_engine(monkeypatch):
    mod = types.ModuleType("toy_engine_pkg")
    mod.CAPABILITIES = Capabilities(name="toy", roles=frozenset({"train", "rollout"}), memory_model="fsdp",
                                    devices=("cpu",), critic=False)
    monkeypatch.setitem(sys.modules, "toy_engine_pkg", mod)
    monkeypatch.setitem(registry.BACKENDS, "toy", "toy_engine_pkg")
    return mod


def test_a_toy_engine_in_the_registry_is_accepted_by_the_schema_and_plan(toy_engine):
    r = load_recipe("qwen25_7b", smoke=True, overrides=["actor.engine=toy", "rollout.engine=toy"])
    assert (r.actor.engine, r.rollout.engine) == ("toy", "toy")
    plan = build_plan(r)
    assert plan.ok, plan.violations
    assert plan.engines == {"actor": "toy", "ref": "toy", "rollout": "toy"}
    assert plan.predicted is not None and plan.predicted.step_s > 0  # the step-time model takes it too


def test_an_engine_is_refused_for_a_role_it_does_not_serve_naming_the_ones_that_do(toy_engine):
    toy_engine.CAPABILITIES = Capabilities(name="toy", roles=frozenset({"rollout"}), devices=("cpu",))
    with pytest.raises(RecipeError) as e:
        load_recipe("qwen25_7b", smoke=True, overrides=["actor.engine=toy"])
    assert "actor.engine='toy': that engine does not serve the train role; one of: native, megatron" in str(e.value)


@pytest.mark.parametrize("override, needle", [
    ("rollout.engine=vlm", "rollout.engine='vlm' is not a registered engine; one of: native, vllm (did you mean 'vllm'?)"),
    ("algorithm.name=sac", "unknown algorithm 'sac' (algorithm.name)"),
    ("rollout.multi_turn.tool_format=hermes", "not a registered tool format; one of: auto, qwen, smoke"),
    ("reward.fn=math_verfy", "reward.fn='math_verfy' is not a registered reward; one of: format, math_verify, smoke, smoke_vision, "
                             "or an import path 'pkg.module:function' (did you mean 'math_verify'?)"),
    ("model.family=qwen4", "model.family='qwen4' is not a registered model family; one of: qwen2, qwen3_moe, "
                           "deepseek_v3, qwen2_5_vl (did you mean 'qwen2'?)"),
    ("data.synthetic=copi", "data.synthetic='copi' is not a registered synthetic task; one of: copy, reverse, add, "
                            "longtail, colors (did you mean 'copy'?)"),
    ("resharding.strategy=allgather", "resharding.strategy='allgather' is not a registered reshard strategy; one of: "
                                      "auto, allgather_naive, allgather_swap, alltoallv_experts, tp_allgather_pp_alltoall"),
    ("trainer.loggers=[jsonl,tensorbord]", "trainer.loggers='tensorbord' is not a registered logger; one of: jsonl, "
                                           "tensorboard, wandb (did you mean 'tensorboard'?)"),
])
def test_unknown_names_list_the_registered_ones(override, needle):
    with pytest.raises(RecipeError) as e:
        load_recipe("qwen25_7b", smoke=True, overrides=[override])
    assert needle in str(e.value)
