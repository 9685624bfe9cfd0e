"""A smoke run with Ulysses sequence parallelism (``actor.layout.sp=2``: both devices split every
sequence, DP 1) through the installed CLI reproduces the SP = 1 run (DP 2) step by step: the same
rollouts, and the same loss and gradient norm within fp32 reduction-order noise."""
import pytest

from test_smoke_runs import cli, metrics

pytestmark = pytest.mark.e2e


def test_sp2_run_matches_sp1_run(tmp_path):
    a, b = tmp_path / "sp1", tmp_path / "sp2"
    cli("run", "qwen25_7b", "--smoke", "--steps", "3", "--out", str(a), "--quiet", "trainer.export_hf=false")
    cli("run", "qwen25_7b", "--smoke", "--steps", "3", "--out", str(b), "--quiet", "trainer.export_hf=false",
        "actor.layout.sp=2")
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [0, 1, 2]
    for x, y in zip(ra, rb):
        assert x["perf/tokens"] == y["perf/tokens"]
        for k in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/kl"):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), (x["step"], k)
