"""The native train engine's efficiency options, each on and off, at a small dense and a small MoE
shape on one device: step seconds per option set. One JSON line per (shape, option set), then one
``choice`` line per option: the setting that was faster. The engine defaults
(``rlrecipes.engines.native.MOE_GROUPED_MM``, ``COMPILE_LAYERS``, ``HEAD_CHUNK_TOKENS``) are chosen
from these lines on the CPU (docs/engines.md, "Train efficiency options"); ``gpu_suite.py`` sweeps the
same options on a GPU.

Options (engine arguments): ``compile_layers`` (``torch.compile`` of each decoder layer, inductor),
``moe_grouped_mm`` (MoE experts as grouped GEMMs; the MoE shape only), ``head_chunk_tokens`` (the
chunked log-softmax head; 0 = the HF head's logits), with and without ``recompute``.
``fsdp_prefetch`` needs DP > 1 (several devices) and is not measured here.

Method: the models are built from smoke dimensions (random init, seeded; fp32 on the CPU, the
default dtype elsewhere); every option set trains on the same batch (``--samples`` sequences of
``--prompt`` + ``--response`` tokens packed into ``--budget``-token micro-batches). Per option set:
``first_step_s`` (the first step: with ``compile_layers`` it carries the compilation), then
``--warmup`` untimed steps and ``--steps`` timed ones; ``step_s`` is their median, ``step_s_min`` the
least. ``--rounds`` repeats the whole sweep in reverse order each time (drift and other processes
on the machine); the ``choice`` lines compare the least ``step_s_min`` over rounds (the least step
time is the one other work on the machine disturbed least). ``grad_norm_first``
is the first step's gradient norm: the same for every option set within float rounding (the options
do not change the math).

Usage (take the benchmark lock where other work shares the cores):
``flock /tmp/rlr_bench.lock python benchmarks/train_options.py [--device cpu] [--threads 1]``
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_memory import pg_loss  # noqa: E402

# small shapes a CPU trains in well under a second a step: Qwen2 and Qwen3-MoE smoke families, wider
SHAPES = {
    "dense": ("qwen2", dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                            num_kv_heads=2, head_dim=32, max_position_embeddings=1024)),
    "moe": ("qwen3_moe", dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                              head_dim=32, num_experts=16, moe_intermediate_size=128, experts_per_token=4,
                              max_position_embeddings=1024)),
}


def option_sets(shape: str) -> list[dict]:
    """The defaults, then one change each (and compile with recompute, the combination a large model
    would run)."""
    from rlrecipes.engines.native import MOE_GROUPED_MM

    sets = [{}, {"compile_layers": True}, {"head_chunk_tokens": 0}, {"recompute": True},
            {"recompute": True, "compile_layers": True}]
    if shape == "moe":
        sets.insert(2, {"moe_grouped_mm": not MOE_GROUPED_MM})
    return sets


def label(opts: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in opts.items()) or "defaults"


def dims_of(shape: str):
    from rlrecipes.models import SMOKE

    family, changes = SHAPES[shape]
    return dataclasses.replace(SMOKE[family], **changes)


def batch_of(dims, samples: int, prompt: int, response: int):
    from rlrecipes.engines.base import SeqBatch

    g = torch.Generator().manual_seed(0)
    v = dims.vocab_size
    return SeqBatch(prompts=[torch.randint(1, v, (prompt,), generator=g) for _ in range(samples)],
                    responses=[torch.randint(1, v, (response,), generator=g) for _ in range(samples)],
                    per_sample={"advantages": torch.randn(samples, generator=g)})


def run_once(shape: str, opts: dict, args, dev) -> dict:
    from rlrecipes import device as devmod
    from rlrecipes.engines.native.train import NativeTrainEngine

    dims = dims_of(shape)
    batch = batch_of(dims, args.samples, args.prompt, args.response)
    t0 = time.perf_counter()
    eng = NativeTrainEngine(dims, layout=(1, 1), device=dev, dtype=args.dtype, lr=1e-5, seed=0,
                            max_tokens_per_micro_batch=args.budget, **opts)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = eng.train_step(batch, pg_loss)
    devmod.synchronize(dev)
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        eng.train_step(batch, pg_loss)
    times = []
    for _ in range(args.steps):
        devmod.synchronize(dev)
        t0 = time.perf_counter()
        eng.train_step(batch, pg_loss)
        devmod.synchronize(dev)
        times.append(time.perf_counter() - t0)
    tokens = args.samples * (args.prompt + args.response)
    step = statistics.median(times)
    return {"build_s": round(build_s, 3), "first_step_s": round(first_s, 3), "step_s": round(step, 4),
            "step_s_min": round(min(times), 4), "tokens_per_step": tokens, "tokens_per_s": round(tokens / step, 1),
            "micro_batches": first.get("actor/micro_batches"), "grad_norm_first": first["actor/grad_norm"],
            "compute_dtype": str(eng.compute_dtype).replace("torch.", ""),
            "experts": getattr(eng.model.config, "_experts_implementation", None) if shape == "moe" else None}


def ep_experts_once(args, grouped: bool, reps: int = 20) -> dict:
    """EPExperts (the experts under EP > 1) alone, on a 1-rank EP mesh: forward + backward of the MoE
    shape's experts over one micro-batch's tokens, grouped GEMMs or the loop; the least of ``reps``."""
    from torch.distributed.device_mesh import init_device_mesh

    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.engines.native.parallel import EPExperts

    dims = dims_of("moe")
    model, _ = build_model(dims, seed=0)
    mod = EPExperts(model.model.layers[0].mlp.experts, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)),
                    grouped_mm=grouped)
    g = torch.Generator().manual_seed(0)
    n, k = args.budget, dims.experts_per_token
    x = torch.randn(n, dims.hidden_size, generator=g, requires_grad=True)
    idx = torch.randint(0, dims.num_experts, (n, k), generator=g)
    w = torch.rand(n, k, generator=g)
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        mod(x, idx, w).square().sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return {"tokens": n, "experts": dims.num_experts, "top_k": k, "step_s_min": round(min(times), 5),
            "step_s": round(statistics.median(times), 5)}


def choices(lines: list[dict]) -> list[dict]:
    """Per shape and option: the faster setting, from the least step seconds (all rounds) of the option set
    that changes only that option against the defaults (compile also with recompute on)."""
    best: dict[tuple, float] = {}
    for x in lines:
        key = (x["shape"], json.dumps(x["options"], sort_keys=True))
        if "step_s_min" in x:
            best[key] = min(best.get(key, float("inf")), x["step_s_min"])
    out = []
    for (shape, opts_json), t in sorted(best.items()):
        opts = json.loads(opts_json)
        if not opts:
            continue
        base = dict(opts)
        changed = [k for k in opts if not (k == "recompute" and "compile_layers" in opts)]
        for k in changed:
            base.pop(k)
        t_base = best.get((shape, json.dumps(base, sort_keys=True)))
        if t_base is None:
            continue
        out.append({"choice": label({k: opts[k] for k in changed}), "shape": shape, "against": label(base),
                    "step_s": t, "step_s_against": t_base, "ratio": round(t / t_base, 3),
                    "faster": label({k: opts[k] for k in changed}) if t < t_base else label(base)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda | npu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--shapes", default="dense,moe")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--budget", type=int, default=512, help="max_tokens_per_micro_batch")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--only", default=None, help="';'-separated option-set labels to run, 'ep_experts' for the "
                    "EPExperts measurement (default: all)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import torch.distributed as dist

    from rlrecipes import device as devmod

    dev = devmod.torch_device(args.device)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(devmod.comm_backend(dev.type), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    env = {"torch": torch.__version__, "device": devmod.device_name(dev), "threads": torch.get_num_threads()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(json.dumps({"bench": "train_options", **env, "argv": sys.argv[1:]}), flush=True)
    jobs = [(shape, opts) for shape in args.shapes.split(",") for opts in option_sets(shape)
            if args.only is None or label(opts) in args.only.split(";")]
    lines = []
    for r in range(args.rounds):
        for shape, opts in (jobs if r % 2 == 0 else jobs[::-1]):
            line = {"bench": "train_options", "round": r, "shape": shape, "options": opts, "name": label(opts)}
            try:
                line.update(run_once(shape, opts, args, dev))
            except Exception as e:  # noqa: BLE001 - one option set failing is recorded; the next runs
                line["error"] = f"{type(e).__name__}: {e}"[:500]
            print(json.dumps(line), flush=True)
            lines.append(line)
    for c in choices(lines):
        print(json.dumps({"bench": "train_options", **c}), flush=True)
    if "moe" in args.shapes.split(",") and args.only is None or (args.only and "ep_experts" in args.only):
        got = {}
        for r in range(args.rounds):
            for grouped in ((True, False) if r % 2 == 0 else (False, True)):
                line = {"bench": "train_options", "round": r, "part": "ep_experts", "moe_grouped_mm": grouped,
                        **ep_experts_once(args, grouped)}
                print(json.dumps(line), flush=True)
                got[grouped] = min(got.get(grouped, float("inf")), line["step_s_min"])
        print(json.dumps({"bench": "train_options", "choice": "moe_grouped_mm (EPExperts, EP > 1)", "shape": "moe",
                          "step_s_grouped": got[True], "step_s_loop": got[False],
                          "ratio": round(got[True] / got[False], 3),
                          "faster": "moe_grouped_mm=True" if got[True] < got[False] else "moe_grouped_mm=False"}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
