"""Does the long-tail smoke task learn as well with the pooled rollout as with k=1, and how far does
each remedy pull the trained batch's response lengths back? One JSON line per run, then a table.

The task is the documented smoke run ``rlrecipes run qwen25_7b --smoke data.synthetic=longtail
rollout.sampling.max_new_tokens=64`` from the smoke model's random weights (its answers end at a
random ``<eos>`` and score near 0; it learns to write the digit and stop, the short answers first),
on 1 train + 1 rollout worker with ``algorithm.max_staleness=1``, ``--steps`` (50) steps per run,
each mode over ``--seeds`` (trainer.seed). Modes (``--modes``):

- ``k1``: no pool (every group of the step is trained on in it);
- ``k1_batch48``: the same with 48 groups a step. Under a token bound of 1 a pooled step trains
  every group that completes in it (up to oversample x batch = 48 groups, one optimizer step), so
  this control shows what the bigger batch alone does;
- ``pooled``: ``rollout.partial=true rollout.oversample=3`` under the recipe's token bound (1:
  ``algorithm.max_token_staleness`` defaults to ``max_staleness``), ``rollout.on_stale=regenerate``;
- ``pooled_finish``: the same with ``rollout.on_stale=finish`` (a group about to pass the bound is
  finished in the step, not regenerated);
- ``pooled_wait1``: the same with ``rollout.max_wait_steps=1`` (a carried group is finished, and
  trained on, in the next step);
- ``pooled_unbounded``: the bound lifted (``max_token_staleness=1000``): the pool as it ran before.

Per run: ``reward_last10`` (the trained rows' reward, mean over the last 10 steps: what each mode
chose to train on); ``eval_reward`` and ``eval_len`` (the exported final actor sampled on 64 of the
task's prompts x 8 at temperature 1: what it learnt, the same yardstick for every mode);
``trained_len`` (the run's trained response length, mean) and ``len_vs_k1`` (its ratio to k1's,
same seed); ``length_bias`` (the pooled rollout's ``rollout/length_bias``, mean over steps:
trained against the step's pool); ``samples`` trained; ``regenerated_share`` of generated tokens;
``token_staleness_max``; ``wall_s``. The last line per mode is the mean over the seeds, the median
and each seed's ``eval_reward``, and ``ran_on``: the seeds whose final policy lost its ``<eos>``
(mean answer over 20 tokens: the smoke recipe's learning rate, 3e-3, is high, and a run can
collapse so within 50 steps).

Usage: ``python benchmarks/long_tail_learning.py [--steps 50] [--seeds 1234] [--modes ...]``.
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

from long_tail import DISAGG, sample_task

LIMIT = 64
RAN_ON = 20  # a final policy whose mean answer is longer has lost its <eos> (the task's mean answer: 7.7 digits)
COMMON = ["data.synthetic=longtail", f"rollout.sampling.max_new_tokens={LIMIT}", "trainer.export_hf=true",
          "resources.cpus_per_worker=1", "trainer.checkpoint_interval=0", *DISAGG]
POOLED = ["rollout.partial=true", "rollout.oversample=3"]
MODES = {"k1": [], "k1_batch48": ["trainer.global_batch=48", "trainer.mini_batch=48"], "pooled": POOLED, "pooled_finish": POOLED + ["rollout.on_stale=finish"],
         "pooled_wait1": POOLED + ["rollout.max_wait_steps=1"],
         "pooled_unbounded": POOLED + ["algorithm.max_token_staleness=1000"]}


def run(mode: str, seed: int, steps: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "rlrecipes", "run", "qwen25_7b", "--smoke", "--quiet", "--steps", str(steps),
           "--devices-per-node", "2", "--keep-batch", "--out", str(out), f"trainer.seed={seed}", *COMMON, *MODES[mode]]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"mode": mode, "seed": seed, "error": (p.stderr.strip() or p.stdout.strip()).splitlines()[-5:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    samples = sum(r["samples"] for r in rows)
    generated = sum(r.get("rollout/generated_tokens", 0) for r in rows)
    groups = sample_task(out / "actor_hf", 64, 8, LIMIT, seed=seed)
    evals = [x for g in groups for x in g]
    return {"mode": mode, "seed": seed,
            "reward_last10": round(statistics.mean(r.get("reward/trained_mean", r.get("reward/mean", 0.0))
                                                   for r in rows[-10:]), 4),
            "eval_reward": round(statistics.mean(s for _, s in evals), 4),
            "eval_len": round(statistics.mean(n for n, _ in evals), 2),
            "trained_len": round(sum(r["response_length/mean"] * r["samples"] for r in rows) / samples, 2),
            "length_bias": round(statistics.mean(r["rollout/length_bias"] for r in rows), 3)
            if "rollout/length_bias" in rows[0] else 0.0,
            "samples": samples,
            "regenerated_share": round(sum(r.get("rollout/pool_restarted_tokens", 0) for r in rows) / generated, 4)
            if generated else 0.0,
            "token_staleness_max": max(r.get("async/token_staleness_max", r.get("async/staleness_max", 0))
                                       for r in rows),
            "step_s_median": round(statistics.median(r["timing_s/step"] for r in rows[3:]), 4),
            "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seeds", default="1234")
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            k1_len = None
            for mode in a.modes.split(","):
                res = run(mode, seed, a.steps, Path(tmp) / f"{mode}_{seed}")
                if "error" not in res:
                    k1_len = res["trained_len"] if mode == "k1" else k1_len
                    if k1_len:
                        res["len_vs_k1"] = round(res["trained_len"] / k1_len, 3)
                    results.setdefault(mode, []).append(res)
                print(json.dumps(res), flush=True)
    for mode, runs in results.items():
        keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and k != "seed"]
        print(json.dumps({"mode": mode, "seeds": len(runs),
                          **{k: round(statistics.mean(r[k] for r in runs if k in r), 4) for k in keys},
                          "eval_reward_median": round(statistics.median(r["eval_reward"] for r in runs), 4),
                          "eval_rewards": [r["eval_reward"] for r in runs],
                          "ran_on": sum(r["eval_len"] > RAN_ON for r in runs)}), flush=True)


if __name__ == "__main__":
    main()
