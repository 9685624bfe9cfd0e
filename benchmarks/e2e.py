"""End-to-end smoke benchmark: one JSON line per recipe.

For each recipe it runs ``rlrecipes run <recipe> --smoke`` (the embedded default: local Ray, tiny
same-architecture model, 2 CPU workers) and reports, from the run's metrics.jsonl:

- ``wall_s``: wall time of the whole command (Ray start, model build, every step);
- ``tps_per_card``: median ``perf/tps_per_card`` from step 1 on (step 0 includes warm-up);
- ``stage_s``: mean seconds per stage; ``overhead_share`` / ``overhead_share_median``: mean and
  median share of the step outside model compute (dispatch, dock, reward, reshard);
- ``reward_first5`` / ``reward_last5``: mean reward of the first and last 5 steps;
- ``predicted_tps_per_card`` / ``predicted_step_s`` / ``predicted_stage_s``: what ``plan``'s
  step-time model predicts for the same run on the ``cpu`` hardware row (the run's ``plan.json``),
  and ``predicted_over_measured`` against the median above;
- ``predicted_at_run_lengths``: the same model given the run's own mean response length
  (``run_response_tokens``, the mean of ``response_length/mean`` from step 1 on) in place of the
  recipe's ``rollout.expected_response_tokens``: what the model says once the length it was told
  is taken out of the comparison (a DAPO smoke run's answers shorten as it learns);
- ``rollout_tokens_per_s`` vs ``generate_tokens_per_s``: the native rollout engine against
  ``transformers`` ``model.generate`` on the same smoke model and batch (single process).

Usage: ``python benchmarks/e2e.py [--recipes qwen25_7b,...] [--steps 30] [--out runs/bench]``.
Numbers are measurements, never asserted in tests.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPES = ("qwen25_7b", "qwen3_moe_30b", "deepseek_r1_671b")


def run_one(recipe: str, steps: int, out: Path) -> dict:
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "rlrecipes", "run", recipe, "--smoke", "--steps", str(steps),
                           "--out", str(out), "--quiet"], capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"recipe": recipe, "error": (proc.stderr or proc.stdout)[-2000:], "wall_s": round(wall, 1)}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    stages = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    body = rows[1:] or rows
    return {
        "recipe": recipe, "steps": len(rows), "wall_s": round(wall, 1),
        "tps_per_card": round(statistics.median(r["perf/tps_per_card"] for r in body), 1),
        "step_s": round(statistics.fmean(r["timing_s/step"] for r in body), 3),
        "stage_s": {s.split("/", 1)[1]: round(statistics.fmean(r.get(s, 0.0) for r in body), 4) for s in stages},
        "overhead_share": round(statistics.fmean(r.get("perf/overhead_share", 0.0) for r in body), 3),
        "overhead_share_median": round(statistics.median(r.get("perf/overhead_share", 0.0) for r in body), 3),
        "dispatch_skew_s": round(statistics.fmean(r.get("perf/dispatch_skew_s", 0.0) for r in body), 4),
        "reward_first5": round(statistics.fmean(r["reward/mean"] for r in rows[:5]), 4),
        "reward_last5": round(statistics.fmean(r["reward/mean"] for r in rows[-5:]), 4),
        **_predicted(out, statistics.median(r["perf/tps_per_card"] for r in body)),
        **_predicted_at_run_lengths(recipe, steps, statistics.fmean(r["response_length/mean"] for r in body),
                                    statistics.median(r["perf/tps_per_card"] for r in body)),
        "run_dir": str(out),
    }


def _predicted(out: Path, measured: float) -> dict:
    """plan's step-time model for the same run (its plan.json), beside the measured median."""
    pred = json.loads((out / "plan.json").read_text()).get("predicted") or {}
    if "tps_per_card" not in pred:
        return {}
    return {"predicted_tps_per_card": pred["tps_per_card"], "predicted_step_s": pred["step_s"],
            "predicted_over_measured": round(pred["tps_per_card"] / measured, 3) if measured else None,
            "predicted_stage_s": {k: v["s"] for k, v in pred["stages"].items()}}


def _predicted_at_run_lengths(recipe: str, steps: int, response_tokens: float, measured: float) -> dict:
    """The smoke plan's prediction with the run's measured mean response length as the recipe's."""
    from rlrecipes.plan import build_plan
    from rlrecipes.plan.steptime import predict
    from rlrecipes.recipe import load_recipe

    mean = max(1, round(response_tokens))
    r = load_recipe(recipe, smoke=True, overrides=[f"trainer.steps={steps}", f"rollout.expected_response_tokens={mean}"])
    pred = predict(r, build_plan(r, r.resources.nodes, r.resources.devices_per_node))
    return {"run_response_tokens": round(response_tokens, 2),
            "predicted_at_run_lengths": {"tps_per_card": round(pred.tps_per_card, 1), "step_s": round(pred.step_s, 4),
                                         "over_measured": round(pred.tps_per_card / measured, 3) if measured else None,
                                         "stage_s": {s.name: round(s.seconds, 4) for s in pred.stages}}}


def rollout_vs_generate(recipe: str) -> dict:
    import torch

    from rlrecipes.recipe import load_recipe

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rollout_vs_generate import bench_vs_generate, ensure_process_group

    ensure_process_group("cpu")

    r = load_recipe(recipe, smoke=True)
    torch.set_num_threads(1)
    res = bench_vs_generate(r.model.dims(), batch=r.trainer.global_batch * r.trainer.n_samples_per_prompt,
                            prompt_len=8, max_new_tokens=r.rollout.sampling.max_new_tokens, device="cpu", repeats=3)
    return {"rollout_tokens_per_s": round(res["native_tokens_per_s"], 1),
            "generate_tokens_per_s": round(res["hf_generate_tokens_per_s"], 1),
            "rollout_speedup": round(res["speedup"], 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="folder for the run folders (default: a temp dir)")
    ap.add_argument("--no-rollout-bench", action="store_true")
    args = ap.parse_args(argv)
    base = args.out or Path(tempfile.mkdtemp(prefix="rlrecipes-e2e-"))
    for recipe in args.recipes.split(","):
        row = run_one(recipe, args.steps, base / recipe)
        if not args.no_rollout_bench and "error" not in row:
            row.update(rollout_vs_generate(recipe))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
