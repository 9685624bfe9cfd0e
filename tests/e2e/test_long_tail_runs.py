"""A pooled rollout through the CLI (1 train worker + 1 rollout worker, ``max_staleness=1``) on the
long-tail smoke task: no generated sample is lost between steps, and DAPO's filter runs on the
rollout side. The speed-up is measured by ``benchmarks/long_tail.py``; the per-token version and
log-prob of an interrupted generation by ``tests/unit/test_pool.py``."""
import pytest

from test_smoke_runs import cli, metrics  # same folder (rootdir-relative imports)

pytestmark = pytest.mark.e2e

BASE = ["--smoke", "--quiet", "--keep-batch", "trainer.export_hf=false", "resources.cpus_per_worker=1",
        "resources.placement=disaggregated", "resources.rollout_devices=1", "algorithm.max_staleness=1"]
LONG_TAIL = ["data.synthetic=longtail", "rollout.sampling.max_new_tokens=32", "rollout.chunk_tokens=4",
             "rollout.partial=true", "rollout.oversample=2", "trainer.global_batch=8", "trainer.mini_batch=8"]


def test_no_sample_is_lost_between_steps(tmp_path):
    run = tmp_path / "pool"
    cli("run", "qwen25_7b", "--steps", "6", "--out", str(run), "-d", "2", *BASE, *LONG_TAIL)
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(6))
    n = 8  # the smoke's n_samples_per_prompt
    carried_before = 0
    for r in rows:
        # every group of the pool is trained on, filtered (DAPO only), or still in the dock
        assert r["rollout/pool_carried_in"] == carried_before
        assert r["rollout/pool_carried_in"] + r["rollout/pool_new_groups"] == (
            r["rollout/pool_committed_groups"] + r["rollout/pool_filtered_groups"] + r["rollout/pool_carried_groups"])
        assert r["samples"] == n * r["rollout/pool_committed_groups"]  # the trainer got exactly the committed rows
        assert r["rollout/pool_dock_rows"] == n * r["rollout/pool_carried_groups"]  # counted by the dock itself
        assert r["rollout/pool_committed_groups"] >= 8 and r["async/staleness_max"] <= 1
        assert r["async/token_staleness_max"] >= r["async/staleness_max"]
        carried_before = r["rollout/pool_carried_groups"]
    # over-sampling leaves unfinished groups in the dock; the run's token count closes too
    assert sum(r["rollout/pool_carried_groups"] for r in rows) > 0
    generated = sum(r["rollout/generated_tokens"] for r in rows)
    trained = sum(round(r["response_length/mean"] * r["samples"]) for r in rows)
    assert generated == trained + rows[-1]["rollout/pool_dock_tokens"]


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
