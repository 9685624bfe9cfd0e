"""benchmarks/gpu_suite.py in its reduced CPU mode (``--cpu``: tiny shapes, one step each), so the
suite a GPU machine runs never rots: every part runs and prints the JSON lines docs/gpu_suite.md
describes, the results file holds the same lines, and a part that fails is recorded while the suite
goes on and exits non-zero. A subprocess, as a user runs it; the whole-RL-step part drives the
workflow's worker without Ray. Speeds are printed, never asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
sys.path.insert(0, str(SUITE.parent))
import gpu_suite  # noqa: E402  (the orchestrator imports no torch)

from rlrecipes.engines.native import MOE_GROUPED_MM  # noqa: E402  (no torch either)

pytestmark = pytest.mark.e2e

TRAIN_KEYS = {"part", "name", "engine", "shape", "options", "dtype", "params", "active_params", "recompute",
              "head_chunk_tokens", "attn_implementation", "max_tokens_per_micro_batch", "samples", "prompt", "response",
              "varied_lengths", "tokens_per_step", "micro_batches", "step_s", "tokens_per_s", "model_tflops_per_s",
              "mfu", "peak_bytes", "loaded_bytes", "plan_total_bytes", "peak_over_plan", "plan_breakdown_gib",
              "grad_norm", "load_s", "steps", "write_s", "seconds", "moe_grouped_mm", "experts_implementation",
              "compile_layers", "first_step_s", "grad_norm_first"}
DECODE_KEYS = {"part", "name", "shape", "batch", "prompt_len", "new_tokens", "decode", "prefill", "prefill_layout",
               "cache", "dtype", "native_s", "native_tokens", "native_tokens_per_s", "native_peak_bytes", "speedup",
               "seconds"}
PREFILL_KEYS = {"part", "name", "shape", "dist", "batch", "max_len", "tokens", "padded_tokens", "packed_s", "padded_s",
                "same_tokens", "max_logprob_diff", "speedup", "attention_backend", "decode", "cache", "seconds"}
GENERATE_KEYS = {"hf_generate_s", "hf_generate_tokens", "hf_generate_tokens_per_s", "hf_generate_peak_bytes"}
RL_KEYS = {"part", "name", "case", "driver", "algorithm", "recipe", "shape", "prompts", "samples_per_prompt",
           "prompt_len", "max_new_tokens", "params", "overrides", "multi_turn", "lora_rank", "steps", "measured_step",
           "step_s", "stage_s", "compute_s", "tps_per_card", "tokens", "samples", "response_length_mean",
           "overhead_share", "outside_compute_s", "mem_peak_gb", "reshard_bytes", "reward_mean", "run_dir", "seconds"}
# what each RL case must have run: its algorithm and a stage only it has (or a setting it ran with)
RL_EXPECT = {"grpo": ("grpo", "ref"), "dapo": ("dapo", "dynamic_sampling"), "ppo": ("ppo", "critic_update"),
             "multi_turn": ("grpo", "ref"), "lora": ("grpo", "ref")}
ENV_KEYS = {"part", "name", "python", "torch", "transformers", "megatron-core", "ray", "pytest",
            "megatron_core_imports", "device_type", "device_name", "device_count", "memory_bytes", "peak_flops",
            "bf16", "cpu_count"}


def run_suite(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict], Path]:
    out = tmp_path / "results.json"
    p = subprocess.run([sys.executable, str(SUITE), "--cpu", "--out", str(out), "--run-dir", str(tmp_path / "rl"),
                        *extra], capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env={**os.environ, "RLRECIPES_DEVICE": "cpu"})
    lines = [json.loads(s) for s in p.stdout.splitlines() if s.startswith("{")]
    return p, lines, out


def by(lines: list[dict], part: str) -> list[dict]:
    return [x for x in lines if x.get("part") == part]


def test_cpu_mode_runs_every_part_and_writes_its_results(tmp_path):
    p, lines, out = run_suite(tmp_path, "--cache", str(tmp_path / "models"))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert not [x for x in lines if "error" in x], [x for x in lines if "error" in x]
    prof = gpu_suite.PROFILES["cpu"]

    assert lines[0]["part"] == "suite" and lines[0]["name"] == "start" and lines[0]["mode"] == "cpu"
    (env,) = by(lines, "env")
    assert ENV_KEYS <= set(env) and env["device_type"] == "cpu" and env["device_name"] == "cpu"

    tests = {x["name"]: x for x in by(lines, "tests")}
    gpu = tests["tests/gpu"]
    assert gpu["failed"] == gpu["errors"] == 0 and gpu["skipped"] >= 1 and gpu["returncode"] == 0  # no device here
    assert "tests/megatron_tier/test_megatron_gpu.py" in tests

    train = [x for x in by(lines, "train") if x.get("engine") == "native"]
    want = [(shape, opts) for shape, sweep in prof["train"]["shapes"].items() for opts in sweep]
    assert sorted((x["shape"], json.dumps(x["options"], sort_keys=True)) for x in train) == \
        sorted((s, json.dumps(o, sort_keys=True)) for s, o in want)
    for x in train:
        assert TRAIN_KEYS <= set(x), TRAIN_KEYS - set(x)
        assert x["dtype"] == "fp32" and x["mfu"] is None  # a CPU has no bf16 peak to divide by
        assert x["tokens_per_s"] > 0 and x["step_s"] > 0 and x["peak_bytes"] > 0 and x["plan_total_bytes"] > 0
        assert x["steps"] == prof["train"]["steps"] and x["grad_norm"] > 0
        opts = x["options"]
        assert x["recompute"] == opts.get("recompute", False)
        assert x["max_tokens_per_micro_batch"] == opts.get("max_tokens_per_micro_batch", prof["train"]["budget"])
        assert x["head_chunk_tokens"] == opts.get("head_chunk_tokens", x["head_chunk_tokens"])
        # issue 49's options: compiled layers (aot_eager on the CPU) and the experts' implementation
        assert x["compile_layers"] == (opts.get("compile_layers") or False) and x["first_step_s"] > 0
        assert x["moe_grouped_mm"] == opts.get("moe_grouped_mm", MOE_GROUPED_MM)
        if x["shape"] == "tiny-moe":
            assert x["experts_implementation"] == ("grouped_mm" if x["moe_grouped_mm"] else "eager")
    moe = [x for x in train if x["shape"] == "tiny-moe"]
    assert moe and all(x["active_params"] < x["params"] for x in moe)
    assert {x["moe_grouped_mm"] for x in moe} == {True, False}
    assert any(x["compile_layers"] for x in train)
    assert any(x.get("not_run") for x in by(lines, "train") if x["name"].endswith("fsdp_prefetch"))
    assert any(x.get("not_run") for x in by(lines, "train") if x["name"].startswith("megatron"))

    decode = by(lines, "decode")
    d = prof["decode"]
    prefill = [x for x in decode if x["name"].startswith("prefill packed vs padded")]
    assert [x["dist"] for x in prefill] == d["prefill"]["dists"]
    for x in prefill:  # the same engine in both layouts: the same tokens, the packed row shorter
        assert PREFILL_KEYS <= set(x), PREFILL_KEYS - set(x)
        assert x["same_tokens"] and x["max_logprob_diff"] < 1e-4 and x["attention_backend"] == "sdpa"
        assert x["tokens"] < x["padded_tokens"] and x["packed_s"] > 0 and x["padded_s"] > 0
    vs = {x["batch"]: x for x in decode if x["name"].startswith("native vs generate")}
    assert sorted(vs) == sorted(d["generate_batches"])
    alone = [x for x in decode if x["name"].startswith("native batch=") and "options" not in x]
    assert [x["batch"] for x in alone] == [b for b in d["batches"] if b not in d["generate_batches"]]
    for x in alone + list(vs.values()):  # every batch: one iteration against the bandwidth limit
        assert x["hardware"] == "cpu" and x["iteration_s"] > 0 and 0 < x["bandwidth_share"]
        assert x["weight_bytes_per_iteration"] > 0 and x["kv_bytes_per_iteration"] > 0
        assert x["bandwidth_limit_iteration_s"] == pytest.approx(
            (x["weight_bytes_per_iteration"] + x["kv_bytes_per_iteration"]) / x["hbm_bytes_s"], rel=1e-3, abs=1e-6)
    for b, x in vs.items():
        assert (DECODE_KEYS | GENERATE_KEYS) <= set(x), (DECODE_KEYS | GENERATE_KEYS) - set(x)
        assert x["native_tokens"] == x["hf_generate_tokens"] == b * d["new"]  # no EOS: every token generated
        assert x["native_tokens_per_s"] > 0 and x["hf_generate_tokens_per_s"] > 0 and x["speedup"] > 0
    sweep = [x for x in decode if "options" in x]
    assert [x["options"] for x in sweep] == d["sweep"]
    for x in sweep:
        assert DECODE_KEYS <= set(x) and x["batch"] == d["sweep_batch"]
        assert all(x[k] == v for k, v in x["options"].items())  # the engine ran the option it was given
    assert {x["decode"] for x in decode} >= {"fast", "layers"} and {x["cache"] for x in decode} == {"static", "dynamic"}

    rl = {x["case"]: x for x in by(lines, "rl")}
    assert list(rl) == list(gpu_suite.RL_CASES) == list(RL_EXPECT)  # every case, in the table's order
    for case, x in rl.items():
        shape, (algo, stage) = gpu_suite.rl_case_spec(prof["rl"], case), RL_EXPECT[case]
        steps = gpu_suite.RL_CASES[case]["steps"]
        assert RL_KEYS <= set(x), (case, RL_KEYS - set(x))
        assert x["driver"] == "inprocess" and x["algorithm"] == algo and x["steps"] == steps, case
        assert x["shape"] == shape["shape"] and x["name"] == gpu_suite.rl_case_name(case, shape)
        assert x["measured_step"] == steps - 1 and x["tps_per_card"] > 0 and 0 <= x["overhead_share"] <= 1, case
        # per-stage seconds of the measured step (the metrics rows' timing_s/<stage>), and of the first
        assert {"rollout", "reward", "advantage", "update", "reshard", stage} <= set(x["stage_s"]), (case, x["stage_s"])
        assert all(v >= 0 for v in x["stage_s"].values()) and x["step_s"] > 0
        assert {"rollout", "update"} <= set(x["compute_s"]), case
        if steps > 1:
            assert x["first_step_s"] > 0 and set(x["first_stage_s"]) >= {"rollout", "update"}, case
        rows = [json.loads(s) for s in (Path(x["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == steps and all(f"timing_s/{stage}" in r for r in rows), case
    assert rl["dapo"]["shape"] == "tiny-moe"  # DAPO's recipe is the MoE one
    assert rl["dapo"]["samples"] <= rl["dapo"]["prompts"] * rl["dapo"]["samples_per_prompt"]  # groups may drop
    assert rl["grpo"]["samples"] == rl["grpo"]["prompts"] * rl["grpo"]["samples_per_prompt"]
    assert rl["multi_turn"]["multi_turn"] is True and rl["lora"]["lora_rank"] > 0
    assert not (rl["grpo"]["multi_turn"] or rl["grpo"]["lora_rank"])

    summary = lines[-1]
    assert summary["name"] == "summary" and summary["failed"] == [] and summary["results_file"] == str(out)
    assert set(summary["targets"]) == {"train_mfu_qwen2.5-1.5b_bf16", "train_mfu_qwen3-moe-2b_bf16",
                                       "decode_speedup_batch64", "decode_bandwidth_share_batch64",
                                       "decode_bandwidth_share_batch256"}
    assert all(t["met"] is None for t in summary["targets"].values())  # not applicable on a CPU

    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and saved["mode"] == "cpu" and saved["failed"] == []
    assert saved["lines"] == lines  # every printed line, in order
    assert "gpu_suite on cpu" in p.stdout and "target decode_bandwidth_share_batch64" in p.stdout  # the table


def test_a_failing_part_is_recorded_and_the_suite_goes_on(tmp_path):
    """No folder can be written under a regular file: the train part fails, the decode part and the
    RL cases still run their own attempts (the second RL case in a fresh child, after the first
    failed), and the suite exits non-zero with all of them in ``failed``, each with the tail of the
    traceback of the exception the child raised."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    p, lines, out = run_suite(tmp_path, "--parts", "train,decode,rl", "--rl-cases", "grpo,lora", "--cache",
                              str(blocker), "--no-table")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    failed = [x for x in lines if x.get("error")]
    assert {x["part"] for x in failed} == {"train", "decode", "rl"}
    assert [x["case"] for x in by(lines, "rl")] == ["grpo", "lora"]
    for x in failed:
        tb = x["traceback"]
        assert x["error"] and 3 <= len(tb) <= gpu_suite.TRACEBACK_LINES, x
        assert any(s.lstrip().startswith("File ") and "gpu_suite.py" in s for s in tb), tb  # the frames
        assert tb[-1].startswith(x["error"].split(":")[0]), tb  # ... down to where it was raised
    summary = lines[-1]
    assert summary["name"] == "summary" and len(summary["failed"]) == len(failed)
    assert json.loads(out.read_text())["failed"] == summary["failed"]
    assert "gpu_suite on" not in p.stdout  # --no-table


def test_pytest_counts_read_the_closing_line():
    assert gpu_suite.pytest_counts("..s\n2 passed, 1 skipped, 3 warnings in 1.2s") == \
        {"passed": 2, "failed": 0, "skipped": 1, "errors": 0, "xfailed": 0, "xpassed": 0, "deselected": 0}
    assert gpu_suite.pytest_counts("F\n1 failed, 1 error in 0.1s")["errors"] == 1
    assert gpu_suite.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_tracebacks_end_at_the_root_cause():
    """A chained exception (the worker's StageFailure raised from the stage's error) is written with
    its cause last, so the last lines are the frames where the error began; at most 30 lines."""
    def inner(depth):
        if depth:
            return inner(depth - 1)
        raise RuntimeError("Expected all tensors to be on the same device")

    def stage():
        try:
            inner(40)
        except RuntimeError as e:
            raise ValueError("worker rank 0 failed in stage 'update'") from e

    try:
        stage()
    except ValueError as e:
        tb, line = gpu_suite.traceback_tail(e), gpu_suite.failure(e)
    assert line["error"] == "ValueError: worker rank 0 failed in stage 'update'" and line["traceback"] == tb
    assert tb[0] == "Traceback (most recent call last):" and "ValueError: worker rank 0 failed in stage 'update'" in tb
    i = tb.index("The above exception was raised from this one (its direct cause):")
    assert any("in stage" in s for s in tb[:i]) and any("in inner" in s for s in tb[i:])
    assert tb[-1] == "RuntimeError: Expected all tensors to be on the same device"  # the root cause, last

    try:
        try:
            raise KeyError("k")
        except KeyError:
            raise RuntimeError("\n".join(f"line {i}" for i in range(40)))  # noqa: B904 - the implicit chain
    except RuntimeError as e:
        tb = gpu_suite.traceback_tail(e)
    assert len(tb) == gpu_suite.TRACEBACK_LINES and tb[-1] == "KeyError: 'k'"
    assert "The above exception was raised while handling this one:" in tb and "line 39" in tb


def test_a_child_that_dies_or_hangs_leaves_its_stderr_tail(tmp_path):
    """The orchestrator's side: a child that dies leaves the last 30 lines of its stderr (its
    uncaught traceback); one that times out is ended with SIGABRT first, so faulthandler writes
    where it stood."""
    suite = gpu_suite.Suite(gpu_suite.parse_args(["--cpu", "--no-table", "--out", str(tmp_path / "r.json")]))
    env = suite.child_env("cpu")
    script = tmp_path / "child.py"
    script.write_text("import sys, time\n"
                      "def hang():\n    time.sleep(60)\n"
                      "def die():\n    print('\\n'.join(f'noise {i}' for i in range(50)), file=sys.stderr)\n"
                      "    raise RuntimeError('the child died')\n"
                      "hang() if sys.argv[1] == 'hang' else die()\n")
    ran = suite.run([sys.executable, str(script), "die"], part="rl", name="dies", cap=60, env=env)
    died = suite.lines[-1]
    assert ran.rc == 1 and died["name"] == "dies" and died["error"] == "exited 1"
    assert len(died["traceback"]) == gpu_suite.TRACEBACK_LINES
    assert died["traceback"][-1] == "RuntimeError: the child died" and "in die" in "\n".join(died["traceback"])
    ran = suite.run([sys.executable, str(script), "hang"], part="rl", name="hangs", cap=2, env=env)
    hung = suite.lines[-1]
    assert ran.rc is None and hung["error"] == "timed out after 2 s"
    assert any("in hang" in s for s in hung["traceback"]), hung["traceback"]  # faulthandler's stack
    ran = suite.run([sys.executable, str(script), "hang"], part="rl", name="quiet", cap=60, line_cap=1, env=env,
                    report=False)
    assert ran.rc is None and ran.why == "timed out: no line for 1 s" and suite.lines[-1] is hung
