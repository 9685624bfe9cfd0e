"""Disaggregated placement and bounded staleness through the CLI (1 train worker + 1 rollout worker).

- k = 0 is synchronous: the same metrics, bit for bit, as the colocated path on one worker (same seed,
  data, batch and thread count; only the process holding the rollout differs).
- k = 1: every sample of step t >= 1 comes from version t - 1, the rows say so, and the decoupled
  objective's importance weights are reported.
The reward rise over 30 steps is measured by `benchmarks/async_overlap.py` and the issue note.
"""
import pytest

from test_smoke_runs import cli, metrics  # same folder (rootdir-relative imports)

pytestmark = pytest.mark.e2e

BASE = ["--smoke", "--quiet", "--keep-batch", "trainer.export_hf=false", "actor.layout.tp=1",
        "resources.cpus_per_worker=1"]
DISAGG = ["-d", "2", "resources.placement=disaggregated", "resources.rollout_devices=1"]
SAME = ["reward/mean", "actor/loss", "actor/pg_loss", "actor/kl", "actor/grad_norm", "response_length/mean",
        "perf/tokens", "samples"]


def test_disaggregated_k0_equals_the_synchronous_path(tmp_path):
    sync, disagg = tmp_path / "sync", tmp_path / "disagg"
    cli("run", "qwen25_7b", "--steps", "3", "--out", str(sync), "-d", "1", *BASE)
    cli("run", "qwen25_7b", "--steps", "3", "--out", str(disagg), *DISAGG, *BASE)
    a, b = metrics(sync), metrics(disagg)
    assert [r["step"] for r in b] == [0, 1, 2]
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in SAME} == {k: rb[k] for k in SAME}
        assert rb["async/staleness_mean"] == 0 and rb["async/staleness_max"] == 0
        assert "timing_s/publish" in rb and rb["timing_s/rollout"] > 0  # the rollout worker's figures merged


def test_disaggregated_k1_trains_one_version_behind(tmp_path):
    run = tmp_path / "k1"
    cli("run", "qwen25_7b", "--steps", "4", "--out", str(run), *DISAGG, "algorithm.max_staleness=1", *BASE)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    for r in rows:  # decoupled PPO: behaviour (rollout) log-probs weight the proximal-policy ratio
        assert r["rollout/is_weight_mean"] > 0 and 0 <= r["rollout/is_capped_frac"] <= 1
        # one optimizer step per batch: the proximal policy is the pre-update actor, so no old pass
        assert "timing_s/old" not in r


@pytest.mark.parametrize("recipe, extra", [
    ("qwen25_7b", []),
    # DAPO: its first step drops groups and trims a second round's surplus; rank 0's drops ride on
    # its next dock call (the re-balancing claim), which a claim that waited for them needs
    ("qwen3_moe_30b", ["actor.layout.ep=1"]),
])
def test_update_on_own_rows_trains_what_the_rebalanced_update_trains(tmp_path, recipe, extra):
    """Colocated pure DP at W=2: each worker trains on the rows it generated while the loads are within
    ``trainer.rebalance_tolerance`` (no dock claim in the update); with tolerance 0 the update re-balances
    through the dock. One mini-batch normalised by the global token count: the same step either way."""
    own, rebal = tmp_path / "own", tmp_path / "rebal"
    common = ["--steps", "1", "-d", "2", *BASE, *extra, "trainer.dock_timeout_s=60"]
    cli("run", recipe, "--out", str(own), *common, "trainer.rebalance_tolerance=100")
    cli("run", recipe, "--out", str(rebal), *common, "trainer.rebalance_tolerance=0")
    [a], [b] = metrics(own), metrics(rebal)
    assert a["dock_s/update"] == 0.0 and b["dock_s/update"] > 0.0   # only the re-balancing update claims
    assert a["reward/mean"] == b["reward/mean"] and a["perf/tokens"] == b["perf/tokens"]
    assert a.get("dapo/dropped_groups", 1) == b.get("dapo/dropped_groups", 1) > 0    # DAPO dropped some
    for k in ["actor/loss", "actor/pg_loss", "actor/kl", "actor/grad_norm"]:  # all reduced over the ranks
        assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-7), k
