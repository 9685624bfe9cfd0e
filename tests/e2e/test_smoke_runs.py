"""Smoke recipes through the installed CLI: the main job, resume, failures and the CI gate.

Each run starts its own embedded Ray; steps are few so the file stays within a few minutes on
2 cores. Reward rise over a full smoke run is measured by benchmarks/e2e.py, not asserted here.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from inproc import rlrecipes  # same folder (rootdir-relative imports)

pytestmark = pytest.mark.e2e

REQUIRED_KEYS = {"step", "perf/tokens", "perf/tps_per_card", "timing_s/step", "timing_s/rollout",
                 "timing_s/update", "timing_s/reshard", "perf/dispatch_skew_s", "reward/mean", "actor/loss",
                 "actor/kl", "actor/clipfrac", "actor/grad_norm", "response_length/mean", "mem/peak_gb"}


def cli(*args, timeout=600, check=True, subprocess_=False):
    """``rlrecipes *args``: in this process on the e2e tests' shared Ray session (``inproc.py``:
    the same run, without an interpreter's and a Ray's start-up each time), or in a subprocess
    (``subprocess_=True``, or every call with RLRECIPES_E2E_SUBPROCESS=1; ``timeout`` applies
    there only)."""
    out = rlrecipes(*map(str, args), timeout=timeout, own_process=subprocess_)
    if check and out.returncode != 0:
        raise AssertionError(f"rlrecipes {' '.join(args)} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_qwen25_smoke_metrics_check_and_report(tmp_path):
    run = tmp_path / "run"
    cli("run", "qwen25_7b", "--smoke", "--steps", "3", "--out", str(run), "--quiet")
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert REQUIRED_KEYS <= set(r), REQUIRED_KEYS - set(r)
        assert r["perf/tokens"] > 0 and r["perf/tps_per_card"] > 0 and r["samples"] == 16 * 8
        assert 0 <= r["reward/mean"] <= 1
    assert (run / "config.yaml").is_file() and (run / "plan.json").is_file()
    # the CI gate: pass against a low baseline, fail (exit 1) against an impossible one
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"hardware": {"cpu": {"tps_per_card": 1.0, "tolerance": 0.5, "steps": [1, 2]}}}))
    ok = cli("check", str(run), "--baseline", str(base), "--hardware", "cpu")
    assert "OK" in ok.stdout and "refresh the baseline" in ok.stdout
    base.write_text(json.dumps({"hardware": {"cpu": {"tps_per_card": 1e9, "tolerance": 0.5, "steps": [1, 2]}}}))
    bad = cli("check", str(run), "--baseline", str(base), "--hardware", "cpu", check=False)
    assert bad.returncode == 1 and "REGRESSION" in bad.stderr
    rep = cli("report", str(run))
    assert (run / "report.png").stat().st_size > 10_000 and "reward" in rep.stdout
    # the trained actor is exported as an HF folder that transformers loads and generates from
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "actor_hf")
    model = AutoModelForCausalLM.from_pretrained(run / "actor_hf")
    ids = tok("123=", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1] and torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("recipe, extra", [
    ("qwen3_moe_30b", "dapo/kept_groups"),     # DAPO, MoE, experts EP2 -> EP1
    ("deepseek_r1_671b", "actor/kl"),          # MLA + MoE, DP2 -> TP2 EP2, old_log_prob skipped
])
def test_moe_recipes_smoke(tmp_path, recipe, extra):
    run = tmp_path / recipe
    cli("run", recipe, "--smoke", "--steps", "2", "--out", str(run), "--quiet")
    rows = metrics(run)
    assert len(rows) == 2 and all(extra in r for r in rows)
    assert "timing_s/old" not in rows[0]  # on-policy: the old-log-prob pass is skipped


def test_ppo_with_critic(tmp_path):
    run = tmp_path / "ppo"
    cli("run", "qwen25_7b", "--smoke", "--steps", "2", "--out", str(run), "--quiet",
        "algorithm.name=ppo", "algorithm.adv_estimator=gae", "algorithm.lam=0.95")
    rows = metrics(run)
    assert all("timing_s/values" in r and "timing_s/critic_update" in r for r in rows)


def test_resume_reproduces_uninterrupted_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cli("run", "qwen25_7b", "--smoke", "--steps", "4", "--out", str(a), "--quiet", "trainer.checkpoint_interval=2")
    # the second run stops after step 3 (as if killed after its checkpoint at step 2), then resumes
    cli("run", "qwen25_7b", "--smoke", "--steps", "3", "--out", str(b), "--quiet", "trainer.checkpoint_interval=2")
    assert (b / "checkpoints" / "latest").read_text().strip() == "step_000002"
    cli("run", "qwen25_7b", "--smoke", "--steps", "4", "--resume", str(b), "--quiet")
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [0, 1, 2, 3]
    for x, y in zip(ra, rb):
        for k in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/kl", "perf/tokens"):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), (x["step"], k)


def test_killed_worker_stops_run_and_keeps_checkpoint(tmp_path):
    run = tmp_path / "kill"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([sys.executable, "-m", "rlrecipes", "run", "qwen25_7b", "--smoke", "--steps", "200",
                             "--out", str(run), "--quiet", "trainer.checkpoint_interval=2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if (run / "metrics.jsonl").is_file() and len(metrics(run)) >= 3 and (run / "checkpoints" / "latest").is_file():
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        latest = (run / "checkpoints" / "latest").read_text().strip()
        pid = json.loads((run / "workers.json").read_text())["pids"][1]
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
        stopped_in = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "worker rank 1 died" in err and "during stage" in err, err[-2000:]
    assert stopped_in < 30
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert ckpt.is_dir() and (ckpt / "trainer_state.json").is_file() and latest <= ckpt.name


def interruptible() -> None:
    """In the child: Ctrl-C's default, as a terminal gives it (a harness started in the background of a
    non-interactive shell has SIGINT ignored, and children inherit that: the test would test the harness)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_cleanly(tmp_path):
    run = tmp_path / "int"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([sys.executable, "-m", "rlrecipes", "run", "qwen25_7b", "--smoke", "--steps", "200",
                             "--out", str(run), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=interruptible)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and metrics(run)):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err
    assert "Traceback" not in err


def test_too_many_workers_refused_before_placement(tmp_path):
    world = 1 << (os.cpu_count() or 1).bit_length()  # more CPU workers than this machine has CPUs
    out = cli("run", "qwen25_7b", "--smoke", "--out", str(tmp_path / "big"), f"resources.devices_per_node={world}",
              f"trainer.global_batch={world}", f"trainer.mini_batch={world}", check=False, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "too small" in out.stderr and f"{world} CPUs" in out.stderr
    assert not (tmp_path / "big" / "metrics.jsonl").exists()


def test_off_policy_minibatches_compute_old_log_probs(tmp_path):
    """Two mini-batches per rollout batch is off-policy: the old-log-prob stage runs."""
    run = tmp_path / "offpolicy"
    cli("run", "qwen25_7b", "--smoke", "--steps", "2", "--out", str(run), "--quiet",
        "trainer.mini_batch=8", "trainer.warmup_steps=2")
    rows = metrics(run)
    assert all("timing_s/old" in r and r["samples"] == 16 * 8 for r in rows)


def test_plan_is_what_runs_when_nodes_scale_dp(tmp_path):
    """--nodes 2 doubles actor DP; the run trains on the batch `plan` printed, and records it."""
    import yaml

    run = tmp_path / "n2"
    cli("run", "qwen25_7b", "--smoke", "--nodes", "2", "--steps", "2", "--out", str(run), "--quiet",
        "resources.cpus_per_worker=0.5")
    plan = json.loads((run / "plan.json").read_text())
    assert plan["global_batch"] == 32 and plan["world"] == 4
    rows = metrics(run)
    assert [r["samples"] for r in rows] == [plan["global_batch"] * plan["n_samples"]] * 2
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["trainer"]["global_batch"] == 32 and cfg["resources"]["nodes"] == 2


@pytest.mark.parametrize("override, needle", [
    ("actor.engine=megatron", "actor.engine=megatron"),
    ("rollout.engine=vllm", "rollout.engine=vllm"),
    ("actor.engine=nope", "actor.engine"),
])
def test_unavailable_engine_refused_before_anything_starts(tmp_path, override, needle):
    run = tmp_path / "never"
    t0 = time.time()
    out = cli("run", "qwen25_7b", "--smoke", "--out", str(run), override, check=False)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert needle in out.stderr, out.stderr
    assert not run.exists()  # nothing written, nothing placed
    assert time.time() - t0 < 60


def test_smoke_task_on_a_model_folder_loads_sharded_and_learns(tmp_path):
    """``model.path`` with ``--smoke``: the actor, reference and rollout load the folder (the train
    engines through the meta build + per-rank sliced safetensors reads) and the reward rises."""
    from rlrecipes.engines.native.loader import build_model, save_hf_folder
    from rlrecipes.recipe import load_recipe

    r = load_recipe("qwen25_7b", smoke=True)
    model, _ = build_model(r.model.dims(), seed=r.trainer.seed + 1)  # not the built-in smoke weights
    folder = save_hf_folder(model.state_dict(), model.config, tmp_path / "hf", max_shard_bytes=64 << 10)
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # a sharded checkpoint with an index
    run = tmp_path / "run"
    cli("run", "qwen25_7b", "--smoke", "--steps", "12", "--out", str(run), "--quiet", f"model.path={folder}")
    reward = [row["reward/mean"] for row in metrics(run)]
    assert len(reward) == 12
    first, last = sum(reward[:4]) / 4, sum(reward[-4:]) / 4
    assert last > first + 0.03, reward
