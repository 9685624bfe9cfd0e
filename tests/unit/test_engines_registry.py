"""Engine registry and capabilities, and how `plan` uses them (no processes, no engines built)."""
import pytest

from rlrecipes.engines.registry import BACKENDS, EngineError, capabilities, problems
from rlrecipes.plan import build_plan, resolve
from rlrecipes.recipe import load_recipe


def test_every_recipe_engine_name_is_registered_with_capabilities():
    for name in ("native", "vllm", "megatron"):
        caps = capabilities(name)
        assert caps.name == name and caps.roles
    assert capabilities("native").roles == {"train", "rollout"}
    assert capabilities("megatron").pipeline_parallel and not capabilities("native").pipeline_parallel


def test_unknown_engine_names_the_choices():
    with pytest.raises(EngineError, match="did you mean 'native'"):
        capabilities("nativ")
    assert "unknown engine" in problems("nope", "train")[0]


def test_problems_name_role_device_and_install():
    assert problems("native", "train", "cpu") == [] and problems("native", "rollout", "cpu") == []
    assert any("has no train engine" in p for p in problems("vllm", "train", "cpu"))
    assert any("does not run on cpu" in p for p in problems("megatron", "train", "cpu"))
    for name in BACKENDS:
        for p in problems(name, next(iter(capabilities(name).roles)), "cuda"):
            assert "not complete in this release" in p or "not installed here" in p and "pip install" in p


def test_plan_asks_the_engine_not_the_name():
    r = load_recipe("qwen3_moe_30b", smoke=True, overrides=["actor.layout.pp=2"])
    v = {x.rule for x in build_plan(r).violations}
    assert "engine has pipeline parallelism" in v  # native has no PP
    r = load_recipe("qwen3_moe_30b", smoke=True, overrides=["actor.layout.tp=1", "actor.layout.ep=2"])
    assert "engine keeps EP inside the TP group" in {x.rule for x in build_plan(r).violations}


def test_full_recipes_plan_and_say_what_is_missing_here():
    p = build_plan(load_recipe("deepseek_r1_671b"), 16)
    assert p.ok and p.engines["actor"] == "megatron" and p.engines["rollout"] == "vllm"
    for m in p.missing_here:
        assert m.startswith(("actor.engine=megatron", "rollout.engine=vllm"))


def test_megatron_on_cpu_is_a_plan_error():
    p = build_plan(load_recipe("qwen25_7b", smoke=True, overrides=["actor.engine=megatron"]))
    assert not p.ok and any("does not run on cpu" in v.detail for v in p.violations)


def test_grpo_with_one_sample_is_refused():
    p = build_plan(load_recipe("qwen25_7b", smoke=True, overrides=["trainer.n_samples_per_prompt=1"]))
    assert "GRPO needs a group per prompt" in {v.rule for v in p.violations}


def test_nodes_and_devices_per_node_scale_the_batch_alike_and_resolve_is_stable():
    r = load_recipe("qwen25_7b", smoke=True)
    by_nodes, by_devices = build_plan(r, nodes=2), build_plan(r, devices_per_node=4)
    assert by_nodes.global_batch == by_devices.global_batch == 2 * r.trainer.global_batch
    assert by_nodes.mini_batch == by_devices.mini_batch == 2 * r.trainer.mini_batch
    kept = build_plan(r, nodes=2, keep_batch=True)
    assert kept.global_batch == r.trainer.global_batch
    resolved = resolve(r, by_nodes)
    assert resolved.trainer.global_batch == by_nodes.global_batch and resolved.resources.nodes == 2
    again = build_plan(resolved)
    assert again.global_batch == by_nodes.global_batch and not again.changes


def test_every_backend_declares_its_classes_and_the_critic_agrees_with_capabilities():
    import importlib

    from rlrecipes.engines import base

    for name, path in BACKENDS.items():
        pkg, caps = importlib.import_module(path), capabilities(name)
        assert hasattr(pkg, "TRAIN") and hasattr(pkg, "CRITIC") and hasattr(pkg, "ROLLOUT"), name
        assert (pkg.CRITIC is not None) == (caps.critic and "train" in caps.roles), name
        assert (pkg.TRAIN is not None) == ("train" in caps.roles)
        assert (pkg.ROLLOUT is not None) == ("rollout" in caps.roles)
    # create(spec) is part of both interfaces: a backend without it cannot be instantiated
    assert "create" in base.TrainEngine.__abstractmethods__ and "create" in base.RolloutEngine.__abstractmethods__
    assert "model_parallel_group" in base.TrainEngine.__abstractmethods__


def test_the_critic_class_comes_from_the_registry_and_megatron_has_none():
    from rlrecipes.engines.registry import engine_class

    critic, actor = engine_class("native", "critic"), engine_class("native", "train")
    assert critic.__name__ == "NativeValueEngine" and issubclass(critic, actor) and critic.serves == ("critic",)
    with pytest.raises(EngineError, match="trains no critic"):
        engine_class("megatron", "critic")


def test_engine_spec_is_typed():
    import dataclasses

    from rlrecipes.engines.base import EngineSpec

    fields = {f.name for f in dataclasses.fields(EngineSpec)}
    assert "options" not in fields
    assert {"pad_token_id", "routing_replay", "expert_tensor_parallel", "inference", "max_model_len"} <= fields


def test_plan_reads_engines_only_through_base_and_registry_and_names_none():
    """The planner takes every engine rule and memory model from the declared capabilities."""
    import ast
    import re
    from pathlib import Path

    import rlrecipes.plan

    for f in Path(rlrecipes.plan.__file__).parent.glob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and "engines" in node.module:
                assert node.module.rsplit(".", 1)[-1] in ("base", "registry"), f"{f.name} imports {node.module}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not re.fullmatch(r"native|megatron|vllm", node.value), f"{f.name} names engine {node.value!r}"


def test_engine_suggestions_come_from_capabilities():
    from rlrecipes.engines.registry import engines_that

    assert engines_that(lambda c: c.critic and "train" in c.roles) == ["native"]
    assert engines_that(lambda c: c.pipeline_parallel) == ["megatron"]
    assert engines_that(lambda c: c.routing_replay) == ["native"]
    p = build_plan(load_recipe("qwen25_7b", overrides=["algorithm.name=ppo", "algorithm.adv_estimator=gae"]), 1)
    assert "use actor.engine: native for PPO" in str(p.violations)
