"""Does disaggregated, one-step-off-policy RL overlap generation with training? One JSON line per mode.

Runs ``rlrecipes run <recipe> --smoke`` on this machine three ways, with the same data, model and
global batch:

- ``colocated``: 2 workers, each holding actor and rollout in turn (actor DP2, rollout DP2);
- ``disaggregated_k0``: 1 train worker + 1 rollout worker, ``algorithm.max_staleness=0``
  (synchronous: the rollout waits for each new version, the trainer waits for each batch);
- ``disaggregated_k1``: the same two workers, ``max_staleness=1``: step t+1 is generated while step
  t trains.

Per mode (medians over steps 2.., steps 0-1 hold warm-up and the pipeline fill): ``step_s``,
``tokens_per_s`` (prompt + response tokens trained per second), ``train_busy`` (share of a step
the trainer is not waiting for samples: 1 - ``dock_s/reward`` / step), ``rollout_busy``
(generation seconds over generation + waiting for weights; colocated: generation share of the
step), the staleness, and the reward's first-5 / last-5 means.

Usage: ``python benchmarks/async_overlap.py [--recipe qwen25_7b] [--steps 14]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = ["trainer.export_hf=false", "actor.layout.tp=1", "actor.layout.ep=1", "resources.cpus_per_worker=1"]
MODES = {
    "colocated": ["--devices-per-node", "2"],
    "disaggregated_k0": ["--devices-per-node", "2", "resources.placement=disaggregated",
                         "resources.rollout_devices=1", "algorithm.max_staleness=0"],
    "disaggregated_k1": ["--devices-per-node", "2", "resources.placement=disaggregated",
                         "resources.rollout_devices=1", "algorithm.max_staleness=1"],
}


def run(recipe: str, mode: str, steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "rlrecipes", "run", recipe, "--smoke", "--quiet", "--steps", str(steps),
           "--keep-batch", "--out", str(out), *MODES[mode], *COMMON]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"mode": mode, "error": (p.stderr.strip() or p.stdout.strip()).splitlines()[-3:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    used = rows[2:]
    med = lambda key: statistics.median(r.get(key) or 0.0 for r in used)  # noqa: E731
    step_s = med("timing_s/step")
    gen = med("timing_s/rollout")
    if mode == "colocated":
        rollout_busy, train_busy = gen / step_s, 1.0 - gen / step_s
    else:
        rollout_busy = gen / (gen + med("async/weights_wait_s")) if gen else 0.0
        train_busy = 1.0 - med("dock_s/reward") / step_s
    rewards = [r["reward/mean"] for r in rows]
    return {"mode": mode, "steps_used": len(used), "step_s": round(step_s, 4),
            "tokens_per_s": round(med("perf/tokens") / step_s, 1),
            "train_busy": round(train_busy, 3), "rollout_busy": round(rollout_busy, 3),
            "rollout_s": round(gen, 4), "staleness_mean": round(med("async/staleness_mean"), 3),
            "reward_first5": round(statistics.mean(rewards[:5]), 4), "reward_last5": round(statistics.mean(rewards[-5:]), 4)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="qwen25_7b")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes.split(","):
            print(json.dumps(run(a.recipe, mode, a.steps, Path(tmp) / mode)), flush=True)


if __name__ == "__main__":
    main()
