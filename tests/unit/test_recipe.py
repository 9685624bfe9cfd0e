from pathlib import Path

import pytest
import yaml

from rlrecipes.recipe import Recipe, RecipeError, load_recipe, parse_override, registry

RECIPES = ["qwen25_7b", "qwen3_moe_30b", "deepseek_r1_671b"]


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("smoke", [False, True])
def test_registered_recipes_load(name, smoke):
    r = load_recipe(name, smoke=smoke)
    assert isinstance(r, Recipe) and r.name == name
    if smoke:
        assert r.resources.device == "cpu" and r.model.smoke is not None
        assert 2 <= r.resources.nodes * r.resources.devices_per_node <= 4
        # a layout pair that still needs real resharding: another TP/EP split, or FSDP shards over DP
        world = r.resources.nodes * r.resources.devices_per_node
        assert (r.actor.layout.tp, r.actor.layout.ep) != (r.rollout.layout.tp, r.rollout.layout.ep) \
            or world // (r.actor.layout.tp * r.actor.layout.pp) > 1
        if r.model.family != "qwen2":
            assert r.actor.layout.ep != r.rollout.layout.ep


def test_pinned_figures():
    ds = load_recipe("deepseek_r1_671b")
    assert (ds.actor.layout.tp, ds.actor.layout.pp, ds.actor.layout.ep) == (4, 8, 8)
    assert ds.actor.layout.pp_layers == [7, 7, 8, 8, 8, 8, 8, 7]
    assert (ds.rollout.layout.tp, ds.rollout.layout.ep) == (2, 128)
    assert (ds.trainer.global_batch, ds.trainer.n_samples_per_prompt) == (512, 16)
    assert ds.algorithm.skip_old_log_prob == "true"
    q = load_recipe("qwen25_7b")
    assert (q.actor.layout.tp, q.actor.layout.pp, q.rollout.layout.tp) == (2, 2, 1)
    m = load_recipe("qwen3_moe_30b")
    assert (m.algorithm.name, m.algorithm.clip_ratio_high, m.actor.layout.ep, m.rollout.layout.ep) == ("dapo", 0.28, 2, 8)


def test_smoke_yaml_holds_only_differences():
    for name, folder in registry().items():
        data = yaml.safe_load((folder / "smoke.yaml").read_text())
        assert data["defaults"] == ["recipe.yaml"]
        assert "name" not in data and "algorithm" not in data or name == "qwen3_moe_30b"


def test_overrides_are_typed():
    r = load_recipe("qwen25_7b", overrides=["trainer.steps=7", "actor.layout.tp=4", "rollout.sampling.top_p=0.9",
                                           "algorithm.dual_clip_c=null", "data.train_files=[a.jsonl, b.parquet]"])
    assert r.trainer.steps == 7 and r.actor.layout.tp == 4 and r.rollout.sampling.top_p == 0.9
    assert r.algorithm.dual_clip_c is None and r.data.train_files == ["a.jsonl", "b.parquet"]


@pytest.mark.parametrize("override, needle", [
    ("trainer.steps=abc", "`trainer.steps`"),
    ("trainer.stpes=3", "did you mean `trainer.steps`"),
    ("algorithm.name=sac", "unknown algorithm 'sac' (algorithm.name)"),
    ("rollout.sampling.top_p=2", "`rollout.sampling.top_p`"),
    ("nonsense", "expected KEY=VALUE"),
    ("trainer.steps.x=1", "is a value, not a section"),
])
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(RecipeError) as e:
        load_recipe("qwen25_7b", overrides=[override])
    assert needle in str(e.value)
    if "." in override.split("=")[0] and "=" in override and "not a section" not in needle:
        assert f"override `{override}`" in str(e.value)


def test_unknown_key_in_file_names_file_and_suggests(tmp_path: Path):
    folder = tmp_path / "r"
    folder.mkdir()
    src = registry()["qwen25_7b"]
    (folder / "recipe.yaml").write_text((src / "recipe.yaml").read_text().replace("micro_batch:", "micro_bach:"))
    with pytest.raises(RecipeError) as e:
        load_recipe(str(folder))
    msg = str(e.value)
    assert str(folder / "recipe.yaml") in msg and "trainer.micro_bach" in msg and "did you mean `trainer.micro_batch`" in msg


def test_invalid_yaml_reports_line(tmp_path: Path):
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "recipe.yaml").write_text("name: x\nmodel: [unclosed\n")
    with pytest.raises(RecipeError, match=r"recipe.yaml:\d+: invalid YAML"):
        load_recipe(str(folder))


def test_defaults_cycle_and_missing(tmp_path: Path):
    (tmp_path / "recipe.yaml").write_text("defaults: [smoke.yaml]\n")
    (tmp_path / "smoke.yaml").write_text("defaults: [recipe.yaml]\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(str(tmp_path))


def test_unknown_recipe_suggests():
    with pytest.raises(RecipeError, match="did you mean `qwen25_7b`"):
        load_recipe("qwen25_7")


def test_cross_field_rules():
    with pytest.raises(RecipeError, match="gae"):
        load_recipe("qwen25_7b", overrides=["algorithm.name=ppo"])
    with pytest.raises(RecipeError, match="mini_batch"):
        load_recipe("qwen25_7b", overrides=["trainer.mini_batch=5"])


def test_parse_override():
    assert parse_override("a.b=1") == (["a", "b"], 1)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=x=y") == (["a"], "x=y")


def test_kl_in_reward_needs_token_rewards():
    with pytest.raises(RecipeError, match="use_kl_in_reward"):
        load_recipe("qwen25_7b", overrides=["algorithm.use_kl_in_reward=true"])
    r = load_recipe("qwen25_7b", overrides=["algorithm.use_kl_in_reward=true", "algorithm.name=ppo",
                                            "algorithm.adv_estimator=gae"])
    assert r.algorithm.use_kl_in_reward


@pytest.mark.parametrize("overrides, needles", [
    (["resources.placement=disaggregated"], ["resources.rollout_devices", "resources.placement=disaggregated"]),
    (["algorithm.max_staleness=1"], ["algorithm.max_staleness=1", "set resources.placement=disaggregated"]),
    (["resources.rollout_devices=4"], ["resources.rollout_devices=4", "resources.rollout_devices=null"]),
    (["resources.rollout_devices=0"], ["`resources.rollout_devices`"]),
    (["algorithm.max_staleness=-1"], ["`algorithm.max_staleness`"]),
    (["resources.placement=split"], ["`resources.placement`"]),
])
def test_placement_and_staleness_keys(overrides, needles):
    with pytest.raises(RecipeError) as e:
        load_recipe("qwen25_7b", overrides=overrides)
    for n in needles:
        assert n in str(e.value), str(e.value)
    r = load_recipe("qwen25_7b", overrides=["resources.placement=disaggregated", "resources.rollout_devices=8",
                                            "algorithm.max_staleness=2"])
    assert (r.resources.placement, r.resources.rollout_devices, r.algorithm.max_staleness) == ("disaggregated", 8, 2)
    d = load_recipe("qwen25_7b")
    assert (d.resources.placement, d.resources.rollout_devices, d.algorithm.max_staleness) == ("colocated", None, 0)
