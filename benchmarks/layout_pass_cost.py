"""What an eager pass costs per transformer layer on this CPU when the model is split over gloo
processes: the native engines themselves, at a layout (data-parallel FSDP, TP, TP + EP).

``host_pass_cost.py`` and ``decode_host_cost.py`` measure a plain model in one process. A smoke
run that splits its model (``qwen3_moe_30b``'s actor at TP2 EP2, ``deepseek_r1_671b``'s rollout at
TP2 EP2) pays more per layer: DTensor's per-op dispatch, the expert all-to-alls and the TP
all-reduces over gloo, each a round trip between two processes on the same cores. This script runs
the native train engine (``forward``: per-sample log-probs; ``train``: forward + backward + clip +
AdamW) and the native rollout engine (``decode``: one iteration, prefill cancelled as in
``decode_host_cost.py``) in ``world`` gloo processes at each layout, at two layer counts, so a pass
splits into a per-layer and a fixed part:

    pass_s(layers) = fixed_s + layers * per_layer_s      (rank 0's wall seconds, median of the repeats)

Each measurement includes that layout's collectives, so the step-time model, where it uses one,
adds no collective latency of its own for the pass (``plan/steptime.py``, ``_eager_at_layout``).

Layouts (``--cases family:layout,...``): ``dp2`` (two data-parallel ranks, each its half of the
batch; FSDP where the engine shards a model of this size), ``tp2`` and ``tp2ep2`` (one TP group of
two: both ranks see the whole batch). Decode runs at the TP layouts only: a data-parallel rollout
rank decodes alone, which ``decode_host_cost.py`` measures.

The batch is a smoke step's (``--batch`` 128 samples of a 5-token prompt and a 4-8 token
response: one packed micro-batch at the smoke budget, 2,048 tokens), and every timed call meets
input shapes no earlier call had (``--shapes new``), as a run's steps do. DTensor caches its
sharding decisions per input shape: a pass over a shape it has not seen propagates every op's
sharding again, which on these tiny models costs as much as the math. ``--shapes repeat`` measures
the cache-hit cost instead. Each figure is the median of ``--repeats`` calls, as in
``host_pass_cost.py`` and ``decode_host_cost.py``: a run's step costs what a typical call costs. (The
fastest call, ``fastest_s_at_*``, is no estimate of it: on an idle machine two gloo processes on two
cores still spread by 1.3-2x from call to call, and a smoke run's update took the median, not the
fastest. Measure on an idle machine: other work only adds time.)

Output: one JSON line per (family, layout, kind), and with ``--out`` a results file
(``benchmarks/results/layout_pass_cost-cpu-<date>.json``) that ``steptime.load_factors`` reads.

Usage: ``python benchmarks/layout_pass_cost.py [--cases qwen3_moe:tp2ep2] [--out FILE]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

CASES = ("qwen2:dp2,qwen2:tp2,qwen3_moe:dp2,qwen3_moe:tp2ep2,deepseek_v3:dp2,deepseek_v3:tp2ep2")
#: layout tag -> (tp, ep); the world is 2 for each
LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "tp2ep2": (2, 2)}


def _batches(vocab: int, samples: int, prompt: int, new: int, seed: int, count: int, shapes: str,
             first: int = 0) -> list:
    """``count`` batches, each response's length drawn from ``new // 2 .. new``. ``shapes="new"``:
    as a run's steps bring them, every batch has an input shape no earlier one had, at nearly the
    same token count: batch ``k`` (``first + i``) drops ``k // 4`` samples and pads its rows ``k % 4``
    tokens longer (its first sample's prompt; that sample's response is the longest). DTensor caches
    its sharding decisions per op and input shape, for the whole process: a TP layout's pass over a
    shape it has not seen propagates the first layer's ops again (the later layers' hit what the
    first one cached), which on these tiny models costs more than the math. ``"repeat"``: one
    batch, repeated: the cache-hit cost."""
    from rlrecipes.engines.base import SeqBatch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count if shapes == "new" else 1):
        k = first + i if shapes == "new" else 0
        n = samples - k // 4
        lens = [new] + torch.randint(max(1, new // 2), new + 1, (n - 1,), generator=g).tolist()
        out.append(SeqBatch(prompts=[torch.randint(3, vocab, (prompt + (k % 4 if j == 0 else 0),), generator=g)
                                     for j in range(n)],
                            responses=[torch.randint(3, vocab, (m,), generator=g) for m in lens],
                            per_sample={"advantages": torch.randn(n, generator=g)}))
    return out * (count if shapes == "repeat" else 1)


def _pg_loss(logp, _ent, mb):
    m = mb["response_mask"]  # the micro-batch's per-sample columns come spread over its tokens
    return -(torch.where(m.bool(), logp * mb["advantages"], 0.0)).sum() / m.sum().clamp(min=1), {}


def _timed(fn, repeats: int, barrier) -> tuple[float, float]:
    """The median of ``repeats`` timed calls ``fn(i)`` after a warm-up ``fn(0)``, and the fastest."""
    fn(0)
    out = []
    for i in range(1, repeats + 1):
        barrier()
        t = time.perf_counter()
        fn(i)
        barrier()
        out.append(time.perf_counter() - t)
    return statistics.median(out), min(out)


def measure(family: str, tag: str, layers: int, a) -> dict[str, float]:
    """Rank-0 seconds of each pass kind at this layout and layer count (every rank runs it)."""
    import torch.distributed as dist

    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.engines.base import EngineSpec, SamplingParams
    from rlrecipes.engines.registry import build_rollout_engine, build_train_engine
    from rlrecipes.models import SMOKE

    tp, ep = LAYOUTS[tag]
    dims = dataclasses.replace(SMOKE[family], num_layers=layers)
    barrier = dist.barrier
    # data-parallel ranks hold different samples; a TP group's ranks the same ones
    seed = dist.get_rank() if tp == 1 else 0
    samples = a.batch // (dist.get_world_size() // tp)  # a rank's share: the batch over the DP ranks
    batches = _batches(dims.vocab_size, samples, a.prompt, a.new, seed, a.repeats + 1, a.shapes)
    # the train passes on shapes of their own: a run's update meets shapes no forward cached (the
    # sharding cache is shared by every pass of the process), and repeating the forward's would
    # price its forward half at cache hits
    train_batches = _batches(dims.vocab_size, samples, a.prompt, a.new, seed + 1, a.repeats + 1, a.shapes,
                             first=a.repeats + 1 if a.shapes == "new" else 0)
    spec = dict(model=dims, dtype="fp32", seed=0, lr=1e-4, micro_batch_size=samples,
                max_tokens_per_micro_batch=a.budget)
    world = dist.get_world_size()
    out = {}
    train = build_train_engine("native", EngineSpec(role="actor", layout=ParallelLayout(
        role="actor", tp=tp, ep=ep, world=world), **spec))
    out["forward"] = _timed(lambda i: train.forward(batches[i]), a.repeats, barrier)
    out["train"] = _timed(lambda i: train.train_step(train_batches[i], _pg_loss), a.repeats, barrier)
    train = None  # frees its model before the rollout engine's
    if tp > 1:
        eng = build_rollout_engine("native", EngineSpec(role="rollout", layout=ParallelLayout(
            role="rollout", tp=tp, ep=ep, world=world), **spec))
        g = torch.Generator().manual_seed(0)  # shapes="new": a new prompt length every call
        grow = 1 if a.shapes == "new" else 0
        prompts = [[torch.randint(3, dims.vocab_size, (a.prompt + grow * i,), generator=g) for _ in range(samples)]
                   for i in range(a.decode_repeats + 1)]

        def gen(n: int):
            return lambda i: eng.generate(prompts[i], SamplingParams(max_new_tokens=n, temperature=1.0,
                                                                     eos_token_id=None), seed=i)

        one = _timed(gen(1), a.decode_repeats, barrier)
        many = _timed(gen(a.decode_new), a.decode_repeats, barrier)
        out["decode"] = tuple((m - o) / (a.decode_new - 1) for m, o in zip(many, one))
        close = getattr(eng, "close", None)
        if close:
            close()
    return out


def _rank(rank: int, world: int, port: int, out: str, case: str, layers: int, a) -> None:
    """One measurement in fresh processes: DTensor's sharding cache lives as long as the process, so a
    case measured after another (or at 6 layers after 2) would meet the shapes it had cached."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # a smoke worker's share of the machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RLRECIPES_DEVICE="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        family, tag = case.split(":")
        res = measure(family, tag, layers, a)
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _row(case: str, lo: int, hi: int, kind: str, small: tuple, big: tuple, a) -> dict:
    family, tag = case.split(":")
    (small_s, small_min), (big_s, big_min) = small, big
    per_layer = (big_s - small_s) / (hi - lo)
    world = 2
    return {"part": "pass", "family": family, "layout": tag, "kind": kind,
            "per_layer_s": round(per_layer, 6), "fixed_s": round(small_s - lo * per_layer, 6),
            f"s_at_{lo}_layers": round(small_s, 6), f"s_at_{hi}_layers": round(big_s, 6),
            f"fastest_s_at_{lo}_layers": round(small_min, 6), f"fastest_s_at_{hi}_layers": round(big_min, 6),
            "statistic": "median", "world": world, "samples_per_rank": a.batch // (world // LAYOUTS[tag][0]),
            "prompt_tokens": a.prompt, "max_response_tokens": a.new, "shapes": a.shapes,
            "engine": "native", "threads": 1, "dtype": "fp32"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=CASES, help="family:layout pairs; layouts: " + ", ".join(LAYOUTS))
    ap.add_argument("--batch", type=int, default=128,
                    help="samples per step over all ranks (the smoke recipes' 16 prompts x 8); a rank's share is "
                         "the batch over the data-parallel ranks: 64 at dp2, all 128 at tp2")
    ap.add_argument("--prompt", type=int, default=5, help="prompt tokens (the smoke copy task's 5)")
    ap.add_argument("--new", type=int, default=8,
                    help="the longest response (max_new_tokens); lengths are drawn from new/2..new, mean 6 as "
                         "the smoke recipes expect")
    ap.add_argument("--budget", type=int, default=2048, help="max_tokens_per_micro_batch (the smoke recipes')")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shapes", choices=("new", "repeat"), default="new",
                    help="new: every timed call meets input shapes no earlier call had, as a run's steps do "
                         "(DTensor's sharding cache misses); repeat: one batch again and again (cache hits)")
    ap.add_argument("--decode-new", type=int, default=17)
    ap.add_argument("--decode-repeats", type=int, default=5)
    ap.add_argument("--layers", default="2,6", help="two layer counts to split fixed and per-layer cost")
    ap.add_argument("--out", type=Path, default=None, help="also write the lines to this JSON results file")
    a = ap.parse_args(argv)
    for case in a.cases.split(","):
        family, _, tag = case.partition(":")
        if tag not in LAYOUTS:
            ap.error(f"--cases {case!r}: layout {tag!r} is not one of {', '.join(LAYOUTS)} (write family:layout)")
    os.environ.setdefault("RLRECIPES_DEVICE", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch.multiprocessing as mp

    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    lo, hi = (int(x) for x in a.layers.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases.split(","):
            got = {}
            for layers in (lo, hi):
                res_file = str(Path(tmp) / f"{case.replace(':', '_')}_{layers}.json")
                mp.spawn(_rank, args=(2, _port(), res_file, case, layers, a), nprocs=2, join=True)
                got[layers] = json.loads(Path(res_file).read_text())
            for kind in got[lo]:
                rows.append(_row(case, lo, hi, kind, tuple(got[lo][kind]), tuple(got[hi][kind]), a))
                print(json.dumps(rows[-1]), flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"suite": "layout_pass_cost", "hardware": "cpu", "started": started,
                                     "machine": platform.processor() or platform.machine(),
                                     "torch": torch.__version__, "lines": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
