"""What one eager pass costs per transformer layer where the host, not the math, bounds it.

The step-time model (``rlrecipes/plan/steptime.py``) needs, for an eager engine on small shapes,
the seconds one transformer layer adds to a pass: a forward of a micro-batch and a forward +
backward + AdamW step (a decode iteration, per rollout engine: ``decode_host_cost.py``). On a GPU that is the host launching kernels; on this CPU
it is the same Python and dispatch plus small-tensor kernels. This script measures them on the
smoke shapes (``rlrecipes.models.SMOKE``, fp32, one thread: a smoke worker's share of the machine),
at two layer counts, so a pass's cost splits into a per-layer part and a fixed part (embedding,
head, loss, optimizer):

    pass_s(layers) = fixed_s + layers * per_layer_s

Per model family (``--families``: each one's smoke shape; a MoE layer's routing and expert
loops, or MLA's projections, cost more per layer than a dense one), one JSON line per pass kind,
then a summary line ``{"part": "summary", "family": ...}`` that
``steptime.load_factors`` reads when its output is saved under ``benchmarks/results/`` as
``host_pass_cost-<hardware>-<date>.json`` (``--out``).

Usage: ``python benchmarks/host_pass_cost.py [--samples 64] [--repeats 20] [--out FILE]``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def _model(family: str, layers: int):
    import dataclasses

    from transformers import AutoModelForCausalLM

    from rlrecipes.models import SMOKE
    from rlrecipes.models.catalog import hf_config

    torch.manual_seed(0)
    cfg = hf_config(dataclasses.replace(SMOKE[family], num_layers=layers))
    return AutoModelForCausalLM.from_config(cfg).float()


def _median(fn, repeats: int) -> float:
    fn()
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def measure(family: str, layers: int, samples: int, prompt: int, new: int, repeats: int) -> dict:
    model = _model(family, layers)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (samples, prompt + new))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward():
        with torch.no_grad():
            logits = model(ids).logits
            torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1))

    def train():
        logits = model(ids).logits
        loss = -torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"forward": _median(forward, repeats), "train": _median(train, repeats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64, help="sequences per pass (a smoke worker's share)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", default="2,6", help="two layer counts to split fixed and per-layer cost")
    ap.add_argument("--families", default="qwen2,qwen3_moe,deepseek_v3", help="model families (their smoke shapes)")
    ap.add_argument("--out", type=Path, default=None, help="also write every line to this JSON file")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lo, hi = (int(x) for x in a.layers.split(","))
    lines = []
    for family in a.families.split(","):
        small, big = (measure(family, n, a.samples, a.prompt, a.new, a.repeats) for n in (lo, hi))
        passes = []
        for kind in small:
            per_layer = (big[kind] - small[kind]) / (hi - lo)
            passes.append({"part": "pass", "family": family, "kind": kind, "per_layer_s": round(per_layer, 6),
                           "fixed_s": round(small[kind] - lo * per_layer, 6), f"s_at_{lo}_layers": round(small[kind], 6),
                           f"s_at_{hi}_layers": round(big[kind], 6), "samples": a.samples,
                           "tokens": a.prompt + a.new})
        lines += passes + [{"part": "summary", "family": family, "hardware": "cpu", "threads": 1, "dtype": "fp32",
                            "model": f"SMOKE[{family!r}] (HF)", "machine": platform.processor() or platform.machine(),
                            "torch": torch.__version__,
                            **{f"{ln['kind']}_per_layer_s": ln["per_layer_s"] for ln in passes},
                            **{f"{ln['kind']}_fixed_s": ln["fixed_s"] for ln in passes}}]
    for ln in lines:
        print(json.dumps(ln), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"suite": "host_pass_cost", "hardware": "cpu", "started": time.strftime(
            "%Y-%m-%dT%H:%M:%S"), "lines": lines}, indent=1) + "\n")


if __name__ == "__main__":
    main()
