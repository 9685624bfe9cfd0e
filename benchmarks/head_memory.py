"""Peak memory of the LM head's forward + backward: the plain head (whole ``[N, V]`` logits, then the
chunked fp32 log-softmax of ``rlrecipes.algos.logprobs``) against the chunked head
(``rlrecipes.engines.native.head.chunked_logprobs``: logits per chunk of tokens, recomputed in
backward). One JSON line per (tokens, vocab, mode), then one per (tokens, vocab) with the ratio.

Each measurement runs in a fresh process: a ``Linear(hidden, vocab)`` head and ``[N, hidden]``
hidden states in the compute dtype (bf16 by default), then log-probs (and entropy with
``--entropy``) of random targets, a weighted sum, ``backward()``. ``peak_extra_bytes`` is the
peak over that forward + backward minus the memory before it (inputs and the head's weight are
not counted; the head's weight gradient is). Memory is the project's measurement
(``rlrecipes.device.memory_stats``): on CPU this process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``; the process runs with a fixed glibc mmap threshold so that freed large
blocks leave RSS, as in ``benchmarks/engine_memory.py``); on an accelerator the allocator's peak.
``logits_bytes`` is the size of the whole ``[N, V]`` logits in the compute dtype, for scale.

A plain run whose estimated peak (``N x V x (2 x dtype bytes + fp32 bytes saved by the log-softmax)``)
exceeds ``--max-fraction`` of the available memory is skipped and reported as such.

Usage: ``python benchmarks/head_memory.py [--tokens 2048,8192] [--vocab 32768,152064] [--hidden 256]
[--dtype bf16] [--chunk 1024] [--entropy] [--device cpu]``
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _measure(mode: str, tokens: int, vocab: int, hidden: int, dtype: str, chunk: int, entropy: bool,
             device: str, out) -> None:
    """One forward + backward in this (fresh) process; puts a result dict on ``out``."""
    import torch.nn as nn

    from rlrecipes import device as devmod
    from rlrecipes.algos.logprobs import logprobs_and_entropy
    from rlrecipes.engines.native.head import chunked_logprobs

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    dev = devmod.torch_device(device)
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.02, generator=g)
    head = head.to(device=dev, dtype=dt)
    h = torch.randn(tokens, hidden, generator=g).to(device=dev, dtype=dt).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(dev)
    w = torch.randn(tokens, generator=g).to(dev)
    devmod.synchronize(dev)
    devmod.reset_peak_memory(dev)
    before = devmod.memory_stats(dev).allocated_bytes
    t0 = time.perf_counter()
    if mode == "plain":
        lp, ent = logprobs_and_entropy(head(h), targets, with_entropy=entropy, chunk_size=chunk)
    else:
        lp, ent = chunked_logprobs(h, head, targets, with_entropy=entropy, chunk_tokens=chunk)
    loss = (lp * w).sum() + ((ent * w).sum() * 0.01 if ent is not None else 0.0)
    loss.backward()
    devmod.synchronize(dev)
    seconds = time.perf_counter() - t0
    peak = devmod.memory_stats(dev).peak_bytes
    out.put({"peak_extra_bytes": int(peak - before), "seconds": round(seconds, 2), "loss": float(loss.detach()),
             "grad_norm_head": float(head.weight.grad.float().norm()),
             "grad_norm_hidden": float(h.grad.float().norm())})


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        return None
    return None


def _run(mode: str, *args) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(mode, *args, q))
    p.start()
    try:
        res = q.get(timeout=3600)
    except Exception as e:  # noqa: BLE001 - the child died (e.g. out of memory)
        res = {"error": f"{type(e).__name__}: child exit code {p.exitcode}"}
    p.join()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--vocab", default="32768,152064")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (both paths' softmax chunk)")
    ap.add_argument("--entropy", action="store_true", help="entropy too (the plain path keeps more fp32)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-fraction", type=float, default=0.8)
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 << 20))  # read by the spawned processes' glibc
    elt = torch.finfo(DTYPES[args.dtype]).bits // 8
    avail = _available_bytes() if args.device == "cpu" else None
    for n in (int(x) for x in args.tokens.split(",")):
        for v in (int(x) for x in args.vocab.split(",")):
            common = {"tokens": n, "vocab": v, "hidden": args.hidden, "dtype": args.dtype, "chunk": args.chunk,
                      "entropy": args.entropy, "device": args.device, "logits_bytes": n * v * elt}
            res = {}
            for mode in ("plain", "chunked"):
                estimate = n * v * (2 * elt + 4 * (2 if args.entropy else 1)) if mode == "plain" else 0
                if avail is not None and estimate > args.max_fraction * avail:
                    r = {"skipped": f"estimated {estimate / 2**30:.1f} GiB > {args.max_fraction} x available "
                                    f"{avail / 2**30:.1f} GiB"}
                else:
                    r = _run(mode, n, v, args.hidden, args.dtype, args.chunk, args.entropy, args.device)
                res[mode] = r
                print(json.dumps({**common, "mode": mode, **r}), flush=True)
            p, c = res["plain"].get("peak_extra_bytes"), res["chunked"].get("peak_extra_bytes")
            summary = {**common, "plain_peak_gib": round(p / 2**30, 3) if p else None,
                       "chunked_peak_gib": round(c / 2**30, 3) if c else None,
                       "ratio_plain_over_chunked": round(p / c, 2) if p and c else None}
            if p and c:
                gp, gc = res["plain"]["grad_norm_head"], res["chunked"]["grad_norm_head"]
                summary["loss_diff"] = abs(res["plain"]["loss"] - res["chunked"]["loss"])
                summary["grad_norm_head_rel_diff"] = abs(gp - gc) / max(gp, 1e-30)
            print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
