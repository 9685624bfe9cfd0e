"""Every algorithm under every placement, 2 steps each, with the strict stage batch (every
--smoke run is strict: an undeclared read or write, or a missing write, stops the run naming the
stage and the column; tests/unit/test_stage_contract.py shows the check firing)."""
import pytest

from test_smoke_runs import cli, metrics  # same folder (rootdir-relative imports)

pytestmark = pytest.mark.e2e

BASE = ["--smoke", "--quiet", "--steps", "2", "--keep-batch", "trainer.export_hf=false", "resources.cpus_per_worker=1"]
DISAGG = ["-d", "2", "resources.placement=disaggregated", "resources.rollout_devices=1", "actor.layout.tp=1",
          "actor.layout.ep=1"]
ALGOS = {
    "grpo": ["qwen25_7b"],
    "dapo": ["qwen3_moe_30b"],
    "ppo": ["qwen25_7b", "algorithm.name=ppo", "algorithm.adv_estimator=gae"],
    "gspo": ["qwen25_7b", "algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean"],
}
PLACEMENTS = {"colocated": [], "disagg_k0": DISAGG + ["algorithm.max_staleness=0"],
              "disagg_k1": DISAGG + ["algorithm.max_staleness=1"],
              # the pooled rollout (workflow/pool.py): partial rollout with over-sampling
              "pooled_k1": DISAGG + ["algorithm.max_staleness=1", "rollout.partial=true", "rollout.oversample=1.5"]}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("algo", list(ALGOS))
def test_strict_stage_contract(tmp_path, algo, placement):
    recipe, *extra = ALGOS[algo]  # DAPO disaggregated: its filter runs on the rollout side (pooled)
    out = tmp_path / "run"
    cli("run", recipe, "--out", str(out), *BASE, *PLACEMENTS[placement], *extra)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["samples"] > 0 for r in rows)


def test_no_kl_term_builds_no_reference_model_in_plan_or_run(tmp_path):
    """recipe.roles.roles_of is the one rule: with no KL term, plan.json has no ref role and the run has
    no ref stage."""
    import json

    out = tmp_path / "run"
    cli("run", "qwen25_7b", "--out", str(out), "--smoke", "--quiet", "--steps", "1", "algorithm.use_kl_loss=false",
        "algorithm.use_kl_in_reward=false")
    assert "ref" not in json.loads((out / "plan.json").read_text())["roles"]
    [row] = metrics(out)
    assert "timing_s/ref" not in row and "timing_s/update" in row


@pytest.mark.parametrize("case", [
    # rollout TP2: the TP peer of each rollout DP rank generates and scores nothing itself
    ["qwen3_moe_30b", "rollout.layout.tp=2", "rollout.layout.ep=1"],
    # one prompt group for two workers: one rank has no rows at all, the other all of them
    ["qwen25_7b", "trainer.global_batch=1", "trainer.mini_batch=1", "actor.layout.tp=2", "algorithm.use_kl_loss=false"],
], ids=["dapo-rollout-tp2", "grpo-empty-rank-actor-tp2"])
def test_ranks_without_rows_take_the_same_collective_path(tmp_path, case):
    """The I/O object decides own rows vs dock claims from the config and earlier decisions, never from
    a rank's own row count, so a rank holding no rows runs the same collectives as its peers."""
    recipe, *extra = case
    out = tmp_path / "run"
    cli("run", recipe, "--out", str(out), "--smoke", "--quiet", "--steps", "2", "--keep-batch",
        "trainer.export_hf=false", "resources.cpus_per_worker=1", *extra, timeout=400)
    assert [r["step"] for r in metrics(out)] == [0, 1]


MULTI_TURN = ["data.synthetic=add", "rollout.multi_turn.enabled=true", "rollout.multi_turn.tools=[calculator]"]


@pytest.mark.parametrize("case", [
    ["qwen25_7b", "algorithm.name=ppo", "algorithm.adv_estimator=gae"],  # GAE and the critic over masks
    ["deepseek_r1_671b"],  # rollout TP2 EP2: the instance's leader runs the loop, its peer replays the calls
    ["qwen25_7b", *DISAGG, "algorithm.max_staleness=1"],  # masks cross the bridge through the dock
], ids=["ppo-colocated", "grpo-rollout-tp2-ep2", "grpo-disagg-k1"])
def test_multi_turn_runs_under_the_strict_contract(tmp_path, case):
    """A multi-turn rollout's response_mask reaches every stage that declares it (strict batch), and
    every row carries the agent metrics."""
    recipe, *extra = case
    out = tmp_path / "run"
    cli("run", recipe, "--out", str(out), *BASE, *MULTI_TURN, *extra, timeout=400)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["agent/tool_calls_mean"] > 0 and 0 < r["agent/observation_token_frac"] < 1
        if "algorithm.max_staleness=1" not in extra:  # on-policy: rollout and trainer agree on the model's tokens
            assert r["rollout/logprob_diff_max"] < 1e-4
