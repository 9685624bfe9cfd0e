"""The native train engine alone on one device (no Ray, one process): train tokens/s, MFU and peak
memory against ``rlrecipes plan``'s estimate. One JSON line.

Writes a randomly initialised HF folder of a published Qwen2.5 shape (default 1.5B, bf16,
safetensors, from config), loads it through the engine's sharded loader (meta build, sliced
reads), and times ``--steps`` train steps of ``--samples`` sequences (prompt + response tokens each)
packed into ``--budget``-token micro-batches, after one warm-up step.

- ``tokens_per_s``: trained tokens / median step seconds (forward, backward, optimizer);
- ``mfu``: model FLOPs (6 x matmul params per token + causal attention 6 x layers x hidden x
  sample length; recomputation not counted) / step seconds / the device's dense bf16 peak
  (``device.peak_flops``, or ``--peak-tflops``);
- ``peak_bytes``: the device allocator's peak over the timed steps (process RSS on CPU), against
  ``plan_total_bytes`` (``plan.train_memory.total`` for the same shape, dtype, token budget and
  recompute setting) and ``step_peak_extra_bytes`` / ``plan_estimate_bytes`` above the loaded weights.

Usage: ``python benchmarks/engine_throughput.py --device cuda [--shape 1.5b] [--recompute]``
(on CPU use ``--shape 0.5b`` and small ``--samples``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_memory import QWEN25_05B, pg_loss, write_folder  # noqa: E402

SHAPES = {
    "0.5b": QWEN25_05B,
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
}


def model_flops_per_step(shape: dict, lengths: list[int]) -> float:
    h, layers, v = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * shape["intermediate_size"]  # q, o, k, v, MLP
    matmul = layers * per_layer + v * h  # + the head (the embedding lookup is no matmul)
    return sum(6 * matmul * n + 6 * layers * h * n * n / 2 for n in lengths)


def timed_train_steps(eng, batch, dev, *, warmup: int, steps: int) -> tuple[float, dict, object]:
    """``warmup`` untimed train steps (kernels, allocator, Adam state), then the median seconds of
    ``steps`` timed ones, the last step's metrics and the device memory stats (peak since warm-up)."""
    from rlrecipes import device as devmod

    for _ in range(warmup):
        eng.train_step(batch, pg_loss)
    devmod.synchronize(dev)
    devmod.reset_peak_memory(dev)
    times, metrics = [], {}
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics = eng.train_step(batch, pg_loss)
        devmod.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), metrics, devmod.memory_stats(dev)


def plan_memory(folder: Path, device: str, dtype: str, budget: int, prompt: int, response: int,
                recompute: bool, memory_gb: float, engine: str = "native"):
    from rlrecipes.plan import build_plan
    from rlrecipes.recipe import load_recipe

    recipe = load_recipe("qwen25_7b", overrides=[
        f"model.path={folder}", "model.preset=null", f"model.dtype={dtype}", f"actor.engine={engine}",
        "rollout.engine=native", "actor.layout.tp=1", "actor.layout.pp=1", "actor.layout.ep=1",
        "rollout.layout.tp=1", f"resources.device={device}", "resources.nodes=1",
        "resources.devices_per_node=1", f"resources.device_memory_gb={memory_gb}", "resources.dies_per_card=1",
        f"actor.recompute={str(recompute).lower()}", "actor.offload_optimizer=false",
        f"data.max_prompt_length={prompt}", f"rollout.sampling.max_new_tokens={response}",
        f"trainer.max_tokens_per_micro_batch={budget}", f"trainer.micro_batch={max(1, budget // (prompt + response))}",
        "trainer.global_batch=8", "trainer.mini_batch=8"])
    return build_plan(recipe).train_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--device", default=None, help="cuda | npu | cpu (default: detected)")
    ap.add_argument("--dtype", default="auto", help="model.dtype: auto (bf16 on accelerators) | bf16 | fp32")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--budget", type=int, default=8192, help="trainer.max_tokens_per_micro_batch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--engine", choices=["native", "megatron"], default="native",
                    help="megatron: TP1 PP1 padded micro-batches of budget // (prompt + response) samples")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--folder", default=None)
    args = ap.parse_args()

    import torch.distributed as dist

    from rlrecipes import device as devmod
    from rlrecipes.engines.base import SeqBatch
    from rlrecipes.engines.native.train import NativeTrainEngine

    kind = devmod.resolve(args.device)
    dev = devmod.torch_device(kind)
    shape = SHAPES[args.shape]
    folder = Path(args.folder or os.path.join(tempfile.gettempdir(), f"rlrecipes-bench-qwen2-{args.shape}"))
    t0 = time.perf_counter()
    write_folder(folder, shape=shape)
    write_s = time.perf_counter() - t0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(devmod.comm_backend(kind), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    devmod.set_device(dev)
    t0 = time.perf_counter()
    if args.engine == "megatron":
        from rlrecipes.engines.megatron.train import MegatronTrainEngine

        eng = MegatronTrainEngine(str(folder), device=dev, dtype=args.dtype, lr=1e-5, recompute=args.recompute,
                                  micro_batch_size=max(1, args.budget // (args.prompt + args.response)))
    else:
        eng = NativeTrainEngine(str(folder), layout=(1, 1), device=dev, dtype=args.dtype, lr=1e-5,
                                max_tokens_per_micro_batch=args.budget, recompute=args.recompute)
    devmod.synchronize(dev)
    load_s = time.perf_counter() - t0
    loaded = devmod.memory_stats(dev).allocated_bytes

    g = torch.Generator().manual_seed(0)
    v = shape["vocab_size"]
    batch = SeqBatch(prompts=[torch.randint(0, v, (args.prompt,), generator=g) for _ in range(args.samples)],
                     responses=[torch.randint(0, v, (args.response,), generator=g) for _ in range(args.samples)],
                     per_sample={"advantages": torch.randn(args.samples, generator=g)})
    step_s, metrics, stats = timed_train_steps(eng, batch, dev, warmup=1, steps=args.steps)
    lengths = [args.prompt + args.response] * args.samples
    flops = model_flops_per_step(shape, lengths)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else devmod.peak_flops(dev)
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[eng.compute_dtype]
    mem = plan_memory(folder, kind, dtype_name, args.budget, args.prompt, args.response, args.recompute,
                      (stats.total_bytes or 64 * 2**30) / 2**30, args.engine)
    n_params = sum(p.numel() for p in eng.model.parameters())  # megatron: a tied head is one tensor too
    print(json.dumps({
        "engine": args.engine, "shape": f"qwen2.5-{args.shape}", "device": devmod.device_name(dev), "dtype": dtype_name,
        "params": n_params, "recompute": args.recompute, "tokens_per_step": sum(lengths),
        "micro_batches": metrics["actor/micro_batches"], "step_s": round(step_s, 4),
        "tokens_per_s": round(sum(lengths) / step_s, 1),
        "model_tflops_per_s": round(flops / step_s / 1e12, 1),
        "mfu": round(flops / step_s / peak, 4) if peak else None,
        "peak_bytes": int(stats.peak_bytes), "loaded_bytes": int(loaded),
        "plan_total_bytes": int(mem.total), "peak_over_plan": round(stats.peak_bytes / mem.total, 3),
        "step_peak_extra_bytes": int(stats.peak_bytes - loaded), "plan_estimate_bytes": int(mem.total - mem.weights),
        "plan_breakdown_gib": mem.gib(), "grad_norm": metrics["actor/grad_norm"],
        "load_s": round(load_s, 2), "write_s": round(write_s, 2), "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
