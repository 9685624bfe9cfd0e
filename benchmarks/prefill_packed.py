"""Prefill seconds of the native sampler, packed vs padded, on batches of skewed prompt lengths.

The native rollout engine's fast prefill runs the prompts either as the left-padded ``[B, P]``
square (``prefill_layout="padded"``: every projection / MLP sees ``B * P`` tokens, attention
``B * P^2``) or packed into one row of ``sum(P_i)`` tokens with attention restricted to each prompt
(``"packed"``: ``engines/native/prefill.py``). This script times both on one engine (its
``prefill_layout`` switched between calls) and the same prompts, for a few length distributions of
one batch:

* ``skewed``: one prompt of ``--max-len`` tokens, the rest 1 to ``--max-len / 16`` tokens;
* ``spread``: lengths uniform in ``[1, --max-len]``;
* ``tight``: lengths uniform in ``[15/16 --max-len, --max-len]`` (little padding: the packed row's
  own costs, its index scatter and one attention call per prompt, against little saved work);
* ``equal``: every prompt ``--max-len`` tokens (no padding: the packed layout runs the square).

A measurement is one ``sample(prompts, max_new_tokens=1)`` call (left-padding, the prefill, one
draw; no decode step), median of ``--repeats`` after a warm-up, device-synchronised; the two
layouts take turns, so that a slow spell of a shared host falls on both. Each line also
carries the greedy tokens' agreement and the largest log-prob difference between the layouts.

    python benchmarks/prefill_packed.py                       # CPU, fp32, a 4-layer GQA Qwen2 shape
    python benchmarks/prefill_packed.py --device cuda --dtype bf16 --batch 64 --max-len 2048

Prints one JSON line per (shape, distribution); ``gpu_suite.py``'s decode part calls :func:`measure`
on its own engine. Measurements only: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

#: a small GQA shape (Qwen2, 8 query heads of 64 over 2 KV heads), the smoke Qwen3-MoE widened the same way, and
#: the smoke DeepSeek-V3 widened
SHAPES = {
    "qwen2-gqa": ("qwen2", dict(vocab_size=2048, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                                head_dim=64, intermediate_size=1408, max_position_embeddings=8192)),
    "qwen3_moe-gqa": ("qwen3_moe", dict(vocab_size=2048, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                                        head_dim=64, moe_intermediate_size=256, max_position_embeddings=8192)),
    # MLA: 8 heads of 64 + 32 rope dims over a 128-wide latent, one dense layer then MoE layers
    "deepseek_v3-mla": ("deepseek_v3", dict(vocab_size=2048, hidden_size=512, num_layers=4, num_heads=8,
                                            num_kv_heads=8, head_dim=96, q_lora_rank=192, kv_lora_rank=128,
                                            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                                            intermediate_size=1408, moe_intermediate_size=256,
                                            max_position_embeddings=8192)),
}


def lengths_of(dist: str, batch: int, max_len: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    if dist == "equal":
        return [max_len] * batch
    if dist == "spread":
        return torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    if dist == "tight":
        return torch.randint(max_len - max_len // 16, max_len + 1, (batch,), generator=g).tolist()
    if dist == "skewed":
        short = max(1, max_len // 16)
        return [max_len] + torch.randint(1, short + 1, (batch - 1,), generator=g).tolist()
    raise ValueError(f"unknown distribution {dist!r}")


def measure(eng, lengths: list[int], *, repeats: int = 3, seed: int = 0,
            layouts: tuple[str, ...] = ("packed", "padded")) -> dict:
    """Seconds of one prefill (``sample(..., max_new_tokens=1)``) of prompts of ``lengths`` in each of
    ``layouts`` on ``eng`` (its ``prefill_layout`` switched between calls; restored after), median
    of ``repeats`` after a warm-up of each."""
    from rlrecipes import device as devmod

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, eng.config.vocab_size, (n,), generator=g) for n in lengths]
    out = {"batch": len(lengths), "max_len": max(lengths), "tokens": sum(lengths),
           "padded_tokens": len(lengths) * max(lengths)}
    before = eng.prefill_layout
    results, times = {}, {name: [] for name in layouts}
    try:
        for name in layouts:
            eng.prefill_layout = name
            eng.sample(prompts, max_new_tokens=1, temperature=0)  # warm-up (allocations, kernels)
        for _ in range(repeats):  # the layouts take turns: a slow spell of a shared host hits both
            for name in layouts:
                eng.prefill_layout = name
                devmod.synchronize(eng.device)
                t = time.perf_counter()
                results[name] = eng.sample(prompts, max_new_tokens=1, temperature=0)
                devmod.synchronize(eng.device)
                times[name].append(time.perf_counter() - t)
    finally:
        eng.prefill_layout = before
    for name in layouts:
        out[f"{name}_s"] = round(statistics.median(times[name]), 5)
    if "packed" in results and "padded" in results:
        a, b = results["packed"], results["padded"]
        out["same_tokens"] = all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))
        out["max_logprob_diff"] = max(float((x - y).abs().max()) for x, y in zip(a.log_probs, b.log_probs))
        out["speedup"] = round(out["padded_s"] / max(out["packed_s"], 1e-9), 3)
        cfg = eng.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        out["attention_backend"] = devmod.varlen_attention_backend(eng.device, eng.dtype, head_dim)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2-gqa,qwen3_moe-gqa", help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--dists", default="skewed,spread,tight,equal")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from rollout_vs_generate import ensure_process_group

    from rlrecipes import device as devmod
    from rlrecipes.engines.native.rollout import NativeRolloutEngine
    from rlrecipes.models import SMOKE

    device = devmod.torch_device(devmod.resolve(args.device))
    ensure_process_group(device.type)
    for shape in args.shapes.split(","):
        family, changes = SHAPES[shape]
        dims = dataclasses.replace(SMOKE[family], **changes)
        eng = NativeRolloutEngine(dims, device=device, dtype=args.dtype, seed=0)
        for dist in args.dists.split(","):
            line = {"bench": "prefill_packed", "shape": shape, "dist": dist, "device": str(device),
                    "dtype": args.dtype, "threads": torch.get_num_threads(), "host": platform.node(),
                    "cpus": os.cpu_count()}
            line.update(measure(eng, lengths_of(dist, args.batch, args.max_len), repeats=args.repeats))
            print(json.dumps(line), flush=True)
        del eng


if __name__ == "__main__":
    main()
