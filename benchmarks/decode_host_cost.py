"""Seconds one decode iteration costs per transformer layer in each rollout engine, where the host
bounds it: the native sampler and vLLM's eager path (its CPU build), on the same smoke shapes.

The step-time model prices an eager decode iteration as ``layers x per_layer_s + fixed_s``. On
this CPU (the ``cpu`` hardware row: the smoke runs, and the vLLM tier's smoke run) it takes each
engine's own figures from here. It does not carry them over to an accelerator: here the kernels
run on the same cores as the host, so the ratio between two engines says nothing about a GPU's
host (the accelerator figure is the native sampler's on an H200, ``gpu_suite``).

For each engine and layer count (``--layers``, default 2 and 6) it builds the engine from the
smoke dimensions (``rlrecipes.models.SMOKE``, fp32, one thread), generates ``--samples`` responses
to 16-token prompts with EOS ignored, once with 1 new token and once with ``--new`` new tokens,
and takes ``(t_new - t_1) / (new - 1)`` as one iteration (prefill cancels). Two layer counts split
an iteration into a per-layer part and a fixed part (sampling, scheduling, the head).

Run it with each environment that has an engine: ``python benchmarks/decode_host_cost.py --out F``
(native) and ``.venv-vllm/bin/python benchmarks/decode_host_cost.py --engines vllm --out F``
(vLLM's CPU build) append to the same JSON file (``--out``), which ``plan/steptime.py`` reads from
``benchmarks/results/decode_host_cost-cpu-<date>.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def _engine(name: str, family: str, layers: int):
    from rlrecipes.engines.base import EngineSpec
    from rlrecipes.engines.registry import build_rollout_engine
    from rlrecipes.models import SMOKE

    dims = dataclasses.replace(SMOKE[family], num_layers=layers)
    kw = {"max_model_len": 128} if name == "vllm" else {}
    return build_rollout_engine(name, EngineSpec(model=dims, role="rollout", dtype="fp32", seed=0, **kw))


def measure(name: str, family: str, layers: int, samples: int, new: int, repeats: int) -> float:
    from rlrecipes.engines.base import SamplingParams

    eng = _engine(name, family, layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 30, (16,), generator=g) for _ in range(samples)]

    def timed(n: int) -> float:
        params = SamplingParams(max_new_tokens=n, temperature=1.0, eos_token_id=None)
        out = []
        for i in range(repeats):
            t = time.perf_counter()
            eng.generate(prompts, params, seed=i)
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    timed(2)  # warm-up
    one, many = timed(1), timed(new)
    close = getattr(eng, "close", None)
    if close:
        close()
    return (many - one) / (new - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="native")
    ap.add_argument("--layers", default="2,6")
    ap.add_argument("--families", default="qwen2,qwen3_moe,deepseek_v3", help="model families (their smoke shapes)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--new", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="append the lines to this JSON file")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if "native" in a.engines.split(","):  # the native engine builds its mesh on a process group
        import os

        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    lo, hi = (int(x) for x in a.layers.split(","))
    lines = []
    for name, family in ((n, f) for n in a.engines.split(",") for f in a.families.split(",")):
        small, big = (measure(name, family, n, a.samples, a.new, a.repeats) for n in (lo, hi))
        per_layer = (big - small) / (hi - lo)
        lines.append({"part": "decode_iteration", "engine": name, "family": family, "per_layer_s": round(per_layer, 6),
                      "fixed_s": round(small - lo * per_layer, 6), f"s_at_{lo}_layers": round(small, 6),
                      f"s_at_{hi}_layers": round(big, 6), "samples": a.samples, "threads": 1, "dtype": "fp32",
                      "machine": platform.machine(), "torch": torch.__version__})
    for ln in lines:
        print(json.dumps(ln), flush=True)
    if a.out:
        old = json.loads(a.out.read_text()) if a.out.is_file() else {
            "suite": "decode_host_cost", "hardware": "cpu", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "lines": []}
        new = {(x["engine"], x["family"]) for x in lines}
        old["lines"] = [ln for ln in old["lines"] if (ln.get("engine"), ln.get("family")) not in new] + lines
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(old, indent=1) + "\n")


if __name__ == "__main__":
    main()
