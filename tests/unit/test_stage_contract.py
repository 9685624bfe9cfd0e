"""The stage contract (rlrecipes/workflow/stage_io.py): a stage gets exactly its declared reads and
must return exactly its declared writes; a strict batch names the stage and the column otherwise.
These run the real stage functions of workflow/stages.py against a declaration with a column left out."""
from types import SimpleNamespace

import pytest
import torch

from rlrecipes.algos.spec import Stage, get_algorithm
from rlrecipes.recipe import load_recipe
from rlrecipes.workflow.shares import SHARES, share_of
from rlrecipes.workflow.stage_io import StageBatch, StageContractError, StepState, check_writes
from rlrecipes.workflow.stages import STAGE_FUNCTIONS


def _ctx():
    return SimpleNamespace(recipe=load_recipe("qwen25_7b", smoke=True))


def _advantage(reads=("scores",), writes=("advantages",)):
    return Stage("outcome_advantage", reads, writes, "groups", "train", reports_as="advantage")


def test_an_undeclared_read_raises_naming_the_stage_and_the_column():
    """outcome_advantage reads `scores`; declared without it, the strict batch refuses the read."""
    st = StepState(step=0, target=2)
    cols = {"scores": torch.tensor([1.0, 0.0] * 8)}
    ok = StageBatch(_advantage(), st, list(range(16)), cols, strict=True)
    writes = STAGE_FUNCTIONS["outcome_advantage"](_ctx(), ok)
    check_writes(ok.stage, ok, writes)  # the true declaration passes
    bad = StageBatch(_advantage(reads=()), st, list(range(16)), cols, strict=True)
    with pytest.raises(StageContractError, match=r"stage 'outcome_advantage' reads column 'scores', which it does not declare"):
        STAGE_FUNCTIONS["outcome_advantage"](_ctx(), bad)


def test_undeclared_and_missing_writes_raise():
    st = StepState(step=0, target=2)
    b = StageBatch(_advantage(writes=()), st, list(range(16)), {"scores": torch.ones(16)}, strict=True)
    writes = STAGE_FUNCTIONS["outcome_advantage"](_ctx(), b)
    with pytest.raises(StageContractError, match=r"writes \['advantages'\], which it does not declare"):
        check_writes(b.stage, b, writes)
    b = StageBatch(_advantage(writes=("advantages", "returns")), st, list(range(16)), {"scores": torch.ones(16)},
                   strict=True)
    with pytest.raises(StageContractError, match=r"does not write \['returns'\], which it declares"):
        check_writes(b.stage, b, STAGE_FUNCTIONS["outcome_advantage"](_ctx(), b))
    empty = StageBatch(_advantage(), st, [], {"scores": torch.zeros(0)}, strict=True)
    check_writes(empty.stage, empty, {})  # no rows here: nothing to write


@pytest.mark.parametrize("overrides", [[], ["algorithm.name=ppo", "algorithm.adv_estimator=gae"],
                                       ["algorithm.routing_replay=true"], ["algorithm.dynamic_sampling.enabled=true"]])
def test_every_declared_stage_has_a_function_of_its_name_and_a_registered_share(overrides):
    r = load_recipe("qwen3_moe_30b" if "routing" in str(overrides) else "qwen25_7b", smoke=True, overrides=overrides)
    stages = get_algorithm(r.algorithm.name).stages(r.algorithm, use_ref=True, skip_old=False)
    for s in stages:
        assert s.name in STAGE_FUNCTIONS and STAGE_FUNCTIONS[s.name].__name__ in (s.name, "forward_pass")
        assert share_of(s) is SHARES[s.share]
    rollout = next(s for s in stages if s.name == "rollout")
    assert {"policy_version", "rollout_log_probs"} <= set(rollout.writes)
    assert ("routed_experts" in rollout.writes) is r.algorithm.routing_replay
    update = next(s for s in stages if s.name == "update")
    assert "rollout_log_probs" in update.reads


def test_placement_selects_stages_without_rewriting_them():
    from rlrecipes.workflow.context import select_stages

    r = load_recipe("qwen25_7b", smoke=True)
    both = [s.name for s in select_stages(r, "both", use_ref=True, skip_old=True)]
    train = [s.name for s in select_stages(r, "train", use_ref=True, skip_old=True)]
    rollout = [s.name for s in select_stages(r, "rollout", use_ref=False, skip_old=True)]
    assert both == ["rollout", "reward", "ref", "outcome_advantage", "update", "reshard"]
    assert train == ["reward", "ref", "outcome_advantage", "update", "publish"]
    assert rollout == ["rollout"]


def test_a_share_that_hands_out_an_engines_rows_needs_the_stage_to_name_it():
    with pytest.raises(ValueError, match=r"stage 'x': share 'engine' hands out an engine's data-parallel share"):
        share_of(Stage("x", (), (), "engine", "train"))
    with pytest.raises(ValueError, match=r"share 'nope' is not one of"):
        share_of(Stage("x", (), (), "nope", "train"))
    with pytest.raises(ValueError, match=r"engine 'critc' is not one of"):
        Stage("x", (), (), "engine", "train", engine="critc")


def test_stages_that_do_one_job_report_under_one_name():
    """outcome_advantage (GRPO) and gae (PPO) both report as `advantage` (timing_s/advantage)."""
    for name, ov in (("outcome_advantage", []), ("gae", ["algorithm.name=ppo", "algorithm.adv_estimator=gae"])):
        r = load_recipe("qwen25_7b", smoke=True, overrides=ov)
        [s] = [s for s in get_algorithm(r.algorithm.name).stages(r.algorithm, use_ref=True, skip_old=False)
               if s.name == name]
        assert s.reports_as == "advantage"
