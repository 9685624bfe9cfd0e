"""One ParallelLayout per role (issue 47): DP inferred from the world, the layout rules stated once
with the recipe key and a fix, the rank coordinates the resharder and the meshes share, and the one
place a recipe's layout sections become a layout."""
import pytest

from rlrecipes.core.parallel import (EP_ACROSS_DP_RULE, EP_RULE, EP_WITHIN_TP_RULE, LayoutError, ParallelLayout)
from rlrecipes.models import PRESETS
from rlrecipes.recipe import load_recipe
from rlrecipes.recipe.roles import role_layout


def test_dp_is_inferred_from_the_world():
    lay = ParallelLayout("actor", tp=4, pp=2, ep=8, world=64, sp=2)
    assert (lay.dp, lay.model_parallel, lay.replicas, lay.stage_size) == (4, 16, 8, 32)
    assert ParallelLayout("actor", tp=3, world=16).dp is None  # not whole: plan prints DP "-"
    assert ParallelLayout.of(2, pp=2, dp=4).world == 16 and lay.on(32).dp == 2
    with pytest.raises(LayoutError, match="actor.layout.tp=0: must be a positive integer"):
        ParallelLayout("actor", tp=0)


def test_the_ep_rule_names_the_key_and_the_values_that_fit():
    lay = ParallelLayout("rollout", tp=4, ep=3, world=16, key="rollout.layout")
    [p] = lay.problems()
    assert p.rule == EP_RULE
    assert p.detail == "rollout: EP3 does not divide DP4 x TP4 = 16; set rollout.layout.ep to one of 1, 2, 4, 8, 16"
    # megatron splits every expert over TP too: EP x TP divides the stage, i.e. EP divides DP
    meg = ParallelLayout("actor", tp=4, ep=8, world=16)
    assert meg.problems() == []
    [p] = meg.problems("across_dp", etp=4, engine="megatron")
    assert p.rule == EP_ACROSS_DP_RULE and "engine megatron" in p.detail and "actor.layout.ep that divides 4" in p.detail
    # the generic failure names only the values the engine's placement allows
    [p] = ParallelLayout("actor", tp=4, ep=3, world=16).problems("across_dp", etp=4)
    assert p.rule == EP_RULE and p.detail.endswith("one of 1, 2, 4")
    # native: EP inside the TP group, whatever the device count
    found = ParallelLayout("actor", tp=2, ep=4, world=5, key="actor.layout").problems("within_tp", engine="native")
    assert [p.rule for p in found] == ["TP*PP divides the world", EP_WITHIN_TP_RULE]
    with pytest.raises(LayoutError, match="EP4 does not divide TP2"):
        ParallelLayout(tp=2, ep=4, world=8).check("within_tp")


def test_layer_split_and_model_rules():
    dims = PRESETS["qwen2.5-7b"]
    lay = ParallelLayout("ref", tp=3, pp=2, world=12, pp_layers=(14, 14, 0), key="actor.layout")
    rules = [p.rule for p in lay.model_problems(dims)]
    assert rules == ["attention heads divide by TP", "KV heads divide by TP", "layer split has one entry per PP stage",
                     "every pipeline stage has a layer"]
    assert "actor.layout.pp_layers" in str(lay.split_problems()[0])
    with pytest.raises(LayoutError, match="pp_layers has 3 entries for PP2"):
        lay.check()


def test_coordinates_follow_the_rank_order_with_sp():
    lay = ParallelLayout(tp=2, pp=2, ep=2, sp=2, world=16)  # dp 2: 4 replicas a stage of 8 ranks
    assert lay.coords(0) == {"pp": 0, "dp": 0, "tp": 0, "ep": 0}
    assert lay.coords(13) == {"pp": 1, "dp": 2, "tp": 1, "ep": 1}
    assert all(lay.rank(**{k: v for k, v in lay.coords(r).items() if k != "ep"}) == r for r in range(16))
    assert lay.describe() == "TP2 PP2 EP2 SP2 DP2"
    assert list(lay.to_json()) == ["role", "tp", "pp", "ep", "dp", "world", "pp_layers", "sp"]


def test_a_recipe_becomes_layouts_in_one_place():
    r = load_recipe("deepseek_r1_671b")
    actor, ref, ro = (role_layout(r, name, 256) for name in ("actor", "ref", "rollout"))
    assert (actor.tp, actor.pp, actor.ep, actor.dp, actor.pp_layers) == (4, 8, 8, 8, (7, 7, 8, 8, 8, 8, 8, 7))
    assert ref.key == "actor.layout" and ref.role == "ref" and ref.pp_layers == actor.pp_layers  # ref.layout: null
    assert (ro.tp, ro.ep, ro.dp, ro.key, ro.sp, ro.pp_layers) == (2, 128, 128, "rollout.layout", 1, None)
