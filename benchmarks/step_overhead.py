"""Where a step's time goes outside model compute, at W = 1, 2, 4 workers: one JSON line per W.

For each W it runs ``rlrecipes run <recipe> --smoke -d W --keep-batch actor.layout.tp=1`` (embedded
Ray, the same global batch and a pure-DP actor at every W) and reports, as medians over steps 1.. (step 0 holds warm-up):

- ``stage_s``: wall seconds of each stage (the slowest worker's);
- ``compute_s``: model-compute seconds inside the compute stages (rollout decode/prefill, forward,
  forward + backward + optimizer), the slowest worker's per stage;
- ``step_s``, and ``overhead_s_per_step``: the median over steps of the step's seconds minus its
  compute seconds -- dispatch, dock round trips, reward, advantages, resharding, Python glue;
- ``overhead_share``: the run's own ``perf/overhead_share`` (median);
- ``dock_backend``: ``in_worker`` for W=1 (the dock lives in the one worker's process), else ``ray``.

Usage: ``python benchmarks/step_overhead.py [--recipe qwen25_7b] [--workers 1,2,4] [--steps 12]``.
On a 2-core machine W=4 oversubscribes the cores: compare W=1 and W=2 there.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(recipe: str, workers: int, steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "rlrecipes", "run", recipe, "--smoke", "--quiet", "--steps", str(steps),
           "--devices-per-node", str(workers), "--keep-batch", "--out", str(out),
           f"resources.cpus_per_worker={min(1.0, 2.0 / workers)}", "trainer.export_hf=false",
           "actor.layout.tp=1", "actor.layout.ep=1"]  # the same layout at every W: DP scales with W
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"recipe": recipe, "workers": workers, "error": p.stderr.strip().splitlines()[-1:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][1:]
    med = lambda key: statistics.median(r.get(key) or 0.0 for r in rows)  # noqa: E731
    stages = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    comp = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("compute_s/")})
    step_s = med("timing_s/step")
    compute = {k: round(med(f"compute_s/{k}"), 4) for k in comp}
    return {"recipe": recipe, "workers": workers, "steps_used": len(rows), "step_s": round(step_s, 4),
            "stage_s": {k: round(med(f"timing_s/{k}"), 4) for k in stages}, "compute_s": compute,
            # per step (its own step and compute seconds), then the median: medians of the parts
            # taken over different steps need not add up
            "overhead_s_per_step": round(statistics.median(
                (r.get("timing_s/step") or 0.0) - sum(r.get(f"compute_s/{k}") or 0.0 for k in comp) for r in rows), 4),
            "dock_round_trips": med("dock/round_trips"), "dock_wait_s": round(med("dock/wait_s"), 4),
            "dock_s": {k: round(med(f"dock_s/{k}"), 4) for k in stages},
            "overhead_share": round(med("perf/overhead_share"), 4),
            "dock_backend": json.loads((out / "workers.json").read_text()).get("dock_backend")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="qwen25_7b")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for w in (int(x) for x in a.workers.split(",")):
            print(json.dumps(run(a.recipe, w, a.steps, Path(tmp) / f"w{w}")), flush=True)


if __name__ == "__main__":
    main()
