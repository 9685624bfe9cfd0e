"""Fingerprint the five reference smoke runs, so a refactor can show it changed no number.

Runs, each ``--smoke --steps 2`` from the same seed: the three recipes colocated, ``qwen25_7b``
with vLLM's CPU build as the rollout engine (in ``.venv-vllm``, skipped when that venv is absent),
and ``qwen25_7b`` disaggregated at staleness 1. Each run's fingerprint is a SHA-256 over its
metrics rows with the wall-clock keys removed (``timing_s/*``, ``perf/*``, ``time/*`` and the other
measured-time fields): rewards, losses, KL, gradient norms, log-prob differences, lengths. Two
commits that compute the same thing print the same fingerprints.

Usage::

    python scripts/fingerprint_runs.py --save /tmp/before.json            # on the old commit
    python scripts/fingerprint_runs.py --compare /tmp/before.json         # on the new one

``--compare`` prints, per run, ``same`` or the first differing key, and exits 1 on any difference.
``--only name,name`` runs a subset (names: qwen25_7b, qwen3_moe_30b, deepseek_r1_671b, vllm, disagg_k1).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--smoke", "--quiet", "--steps", "2", "trainer.export_hf=false", "resources.cpus_per_worker=1"]
RUNS = {
    "qwen25_7b": ["qwen25_7b"],
    "qwen3_moe_30b": ["qwen3_moe_30b"],
    "deepseek_r1_671b": ["deepseek_r1_671b"],
    "vllm": ["qwen25_7b", "rollout.engine=vllm"],
    "disagg_k1": ["qwen25_7b", "-d", "2", "resources.placement=disaggregated", "resources.rollout_devices=1",
                  "actor.layout.tp=1", "actor.layout.ep=1", "algorithm.max_staleness=1"],
}
#: keys that measure time or the machine, not the computation
TIMED_PREFIXES = ("timing_s/", "compute_s/", "dock_s/", "perf/", "time/", "wall", "mem/", "memory/",
                  "throughput/")
TIMED_KEYS = {"elapsed_s", "timestamp", "time", "step_s"}


def _deterministic(row: dict) -> dict:
    return {k: v for k, v in sorted(row.items())
            if not k.startswith(TIMED_PREFIXES) and k not in TIMED_KEYS and not k.endswith(("_s", "_seconds"))}


def run_one(name: str, out: Path) -> list[dict]:
    recipe, *extra = RUNS[name]
    python = sys.executable
    if name == "vllm":
        python = str(ROOT / ".venv-vllm" / "bin" / "python")
    cmd = [python, "-m", "rlrecipes", "run", recipe, "--out", str(out), *BASE, *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    if p.returncode != 0:
        raise SystemExit(f"{name}: {' '.join(cmd)} exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return [_deterministic(json.loads(x)) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save", type=Path, help="write the fingerprints (and rows) here")
    ap.add_argument("--compare", type=Path, help="compare with fingerprints saved by --save")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ", ".join(RUNS))
    args = ap.parse_args(argv)
    names = [n for n in (args.only.split(",") if args.only else RUNS) if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"--only: unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
    if "vllm" in names and not (ROOT / ".venv-vllm" / "bin" / "python").exists():
        print(json.dumps({"run": "vllm", "skipped": "no .venv-vllm (bash scripts/setup_vllm_cpu.sh)"}))
        names.remove("vllm")
    before = json.loads(args.compare.read_text()) if args.compare else {}
    result, differ = {}, False
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows = run_one(name, Path(tmp) / name)
            digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
            result[name] = {"sha": digest, "rows": rows}
            line = {"run": name, "sha": digest, "steps": len(rows)}
            if name in before:
                old = before[name]
                if old["sha"] == digest:
                    line["compare"] = "same"
                else:
                    differ = True
                    first = next(((i, k) for i, (a, b) in enumerate(zip(old["rows"], rows))
                                  for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)), None)
                    line["compare"] = "DIFFERENT"
                    if first:
                        i, k = first
                        line["first_difference"] = {"step": i, "key": k, "before": old["rows"][i].get(k),
                                                    "after": rows[i].get(k)}
            print(json.dumps(line), flush=True)
    if args.save:
        args.save.write_text(json.dumps(result, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
