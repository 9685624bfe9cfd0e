"""A pooled rollout through the CLI (1 train worker + 1 rollout worker, ``max_staleness=1``) on the
long-tail smoke task: no generated sample is lost between steps, no trained token is older than
``algorithm.max_token_staleness``, a group waits no longer than ``rollout.max_wait_steps``, and
DAPO's filter runs on the rollout side. The speed-up is measured by ``benchmarks/long_tail.py``; the per-token version and
log-prob of an interrupted generation by ``tests/unit/test_pool.py``."""
import pytest

from test_smoke_runs import cli, metrics  # same folder (rootdir-relative imports)

pytestmark = pytest.mark.e2e

BASE = ["--smoke", "--quiet", "--keep-batch", "trainer.export_hf=false", "resources.cpus_per_worker=1",
        "resources.placement=disaggregated", "resources.rollout_devices=1", "algorithm.max_staleness=1"]
LONG_TAIL = ["data.synthetic=longtail", "rollout.sampling.max_new_tokens=32", "rollout.chunk_tokens=4",
             "rollout.partial=true", "rollout.oversample=2", "trainer.global_batch=8", "trainer.mini_batch=8"]


def check_pool(rows: list[dict], staleness: int, bound: int, steps: int = 6) -> None:
    """Every group of the pool is accounted for, step by step, and every generated token too: trained
    on, in the dock at the end, or thrown away by a restart; no row past ``staleness``, no token past
    ``bound``."""
    assert [r["step"] for r in rows] == list(range(steps))
    n = 8  # the smoke's n_samples_per_prompt
    carried_before = 0
    for r in rows:
        # every group of the pool is trained on, filtered (DAPO only), or still in the dock
        assert r["rollout/pool_carried_in"] == carried_before
        assert r["rollout/pool_carried_in"] + r["rollout/pool_new_groups"] == (
            r["rollout/pool_committed_groups"] + r["rollout/pool_filtered_groups"] + r["rollout/pool_carried_groups"])
        assert r["samples"] == n * r["rollout/pool_committed_groups"]  # the trainer got exactly the committed rows
        assert r["rollout/pool_dock_rows"] == n * r["rollout/pool_carried_groups"]  # counted by the dock itself
        assert r["rollout/pool_committed_groups"] >= 8 and r["async/staleness_max"] <= staleness
        assert r["async/staleness_max"] <= r["async/token_staleness_max"] <= bound
        trained = r["rollout/length_trained_mean"]
        assert trained == pytest.approx(r["response_length/mean"])  # the rollout's view of the trained rows
        assert r["rollout/length_bias"] == pytest.approx(trained / r["rollout/length_pool_mean"] - 1)
        carried_before = r["rollout/pool_carried_groups"]
    # over-sampling leaves unfinished groups in the dock; the run's token count closes too
    assert sum(r["rollout/pool_carried_groups"] for r in rows) > 0
    generated = sum(r["rollout/generated_tokens"] for r in rows)
    trained = sum(round(r["response_length/mean"] * r["samples"]) for r in rows)
    thrown = sum(r["rollout/pool_restarted_tokens"] for r in rows)
    assert generated == trained + rows[-1]["rollout/pool_dock_tokens"] + thrown


def test_no_sample_is_lost_between_steps_and_no_token_passes_the_bound(tmp_path):
    run = tmp_path / "pool"
    cli("run", "qwen25_7b", "--steps", "6", "--out", str(run), "-d", "2", *BASE, *LONG_TAIL)
    rows = metrics(run)
    check_pool(rows, staleness=1, bound=1)  # max_token_staleness defaults to max_staleness
    # a sample carried over a step holds tokens of the version before: past the bound of 1 at the
    # next step, so it was regenerated (the untrained smoke model's answers run to the limit)
    assert sum(r["rollout/pool_restarted_samples"] for r in rows) > 0


def test_a_group_waits_no_longer_than_the_cap(tmp_path):
    # max_staleness 2 and over-sampling 4: without the cap, groups drawn at step b are trained at
    # b + 2 (and carried out of b + 1); with it, every group is trained by the step after its own
    run = tmp_path / "wait"
    cli("run", "qwen25_7b", "--steps", "6", "--out", str(run), "-d", "2", *BASE, *LONG_TAIL, "algorithm.max_staleness=2",
        "algorithm.max_token_staleness=3", "rollout.oversample=4", "rollout.max_wait_steps=1")
    rows = metrics(run)
    check_pool(rows, staleness=2, bound=3)
    for r in rows:
        assert r["rollout/pool_committed_age_max"] <= 1 and r["rollout/pool_carried_age_max"] == 0


def test_dapo_filters_on_the_rollout_side(tmp_path):
    run = tmp_path / "dapo"
    cli("run", "qwen3_moe_30b", "--steps", "3", "--out", str(run), *BASE)
    rows = metrics(run)
    for r in rows:
        assert r["dapo/kept_groups"] == r["rollout/pool_committed_groups"] >= 16  # the batch is full
        assert r["samples"] == 8 * r["dapo/kept_groups"]
        assert r["dapo/generated_groups"] + r["rollout/pool_carried_in"] == (
            r["dapo/kept_groups"] + r["dapo/dropped_groups"] + r["rollout/pool_carried_groups"])
        assert r["reward/errors"] == 0 and "timing_s/dynamic_sampling" not in r  # off the trainer's path
