"""trainer.loggers: TensorBoard event files hold the same per-step values as metrics.jsonl; a logger
that is not installed is refused before anything starts."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_tensorboard_events_equal_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "tb"
    out = subprocess.run([sys.executable, "-m", "rlrecipes", "run", "qwen25_7b", "--smoke", "--steps", "3", "--quiet",
                          "--out", str(run), "trainer.loggers=[jsonl,tensorboard]"], capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "perf/tps_per_card", "rollout/logprob_diff_mean"):
        assert key in tags, (key, sorted(tags)[:20])
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert sorted(got) == [0, 1, 2]
        for r in rows:
            assert got[r["step"]] == pytest.approx(r[key], rel=1e-6, abs=1e-9), (key, r["step"])


def test_wandb_runs_offline_when_not_logged_in(tmp_path):
    pytest.importorskip("wandb")
    run = tmp_path / "wb"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path))  # no ~/.netrc: not logged in
    out = subprocess.run([sys.executable, "-m", "rlrecipes", "run", "qwen25_7b", "--smoke", "--steps", "2", "--quiet",
                          "--out", str(run), "trainer.loggers=[wandb]"], capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run / "wandb").iterdir())
    data = list(runs[0].glob("*.wandb"))
    assert data and data[0].stat().st_size > 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
