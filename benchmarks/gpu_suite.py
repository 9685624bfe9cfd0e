"""One GPU, a few minutes: the measurements the CPU cannot make, in one command (docs/gpu_suite.md).

    python benchmarks/gpu_suite.py                 # on a machine with one CUDA (or NPU) device
    python benchmarks/gpu_suite.py --cpu           # the same parts at tiny sizes, the fewest steps (CI)
    python benchmarks/gpu_suite.py --parts train,decode --out my.json

Parts, each run in subprocesses of its own (a crash, an out-of-memory or a timeout in one is
recorded as a JSON line with ``error`` and the suite goes on):

- ``env``: device name and type, memory, peak FLOP/s, torch / transformers / megatron-core versions;
- ``tests``: ``pytest tests/gpu`` and, where megatron-core imports, ``tests/megatron_tier/test_megatron_gpu.py``:
  passed / failed / skipped counts;
- ``train``: the native train engine's tokens/s, MFU and peak memory against ``rlrecipes plan``, at the
  Qwen2.5-1.5B shape and at a Qwen3-MoE shape that fits one device (the method and helpers of
  ``benchmarks/engine_throughput.py``), over the engine options that exist (activation recompute,
  the chunked log-softmax head, the micro-batch token budget); megatron-core through
  ``engine_throughput.py --engine megatron`` where it imports;
- ``decode``: the native sampler (``NativeRolloutEngine.sample``) against ``transformers``' ``generate``
  on the same model, weights and device: tokens/s at batch 64 and 256, 512-token prompts, 1,024-token
  responses; the sampler's decode / cache options at batch 256; first, its prefill packed vs padded
  (``prefill_layout``) on batches of skewed prompt lengths (``benchmarks/prefill_packed.py``);
- ``rl``: whole RL steps on one device with the native engines (the workflow's own worker, in this
  process tree, no Ray), one line per case of RL_CASES (GRPO, DAPO and PPO for 2 steps, multi-turn
  and LoRA for 1): seconds per stage, TPS, the share of the step outside model compute.

Every line with ``error`` carries ``traceback``: the last 30 lines of the traceback of the exception
the child caught (its root cause last), or of a dead or timed-out child's stderr.

It prints one JSON line per measurement, then a summary table, and writes every line with the device
name to ``benchmarks/results/gpu_suite-<device>-<date>.json`` (``--out`` to choose). The exit code is
non-zero when any part failed. Measurements only: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUITE_VERSION = 1

# issue 49's targets
TARGET_TRAIN_MFU = 0.40  # native train engine, Qwen2.5-1.5B shape, bf16
TARGET_MOE_MFU = 0.30  # native train engine, the Qwen3-MoE layer shape, bf16
TARGET_DECODE_SPEEDUP = 10.0  # native sampler over transformers' generate at batch 64
TARGET_BANDWIDTH_64 = 0.40  # a decode iteration's bytes / its seconds / the device's HBM bandwidth, batch 64
TARGET_BANDWIDTH_256 = 0.50  # the same at batch 256

# ----------------------------------------------------------------------------------------- sizes
# Dense shapes are Qwen2 configs written by benchmarks/engine_memory.write_folder (the folders
# engine_throughput.py writes too); MoE shapes are ModelDims changes of a pinned preset or smoke model.
TINY_DENSE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)
DENSE = {"qwen2.5-1.5b": "1.5b", "qwen2.5-0.5b": "0.5b", "tiny-dense": None}  # -> engine_throughput.SHAPES key
# Qwen3-30B-A3B's layer (hidden 2048, 32 heads of 128, 4 KV heads, experts of 768, top-8) with 8 layers and
# 32 experts: 1.98B parameters (1.08B touched per token), 32 GB of fp32 weights, gradients and Adam state
MOE = {"qwen3-moe-2b": ("preset", "qwen3-30b-a3b", dict(num_layers=8, num_experts=32)),
       "tiny-moe": ("smoke", "qwen3_moe", dict(vocab_size=512, max_position_embeddings=4096))}


def _train_sweep(big_budget: int, compile_backend: bool | str) -> list[dict]:
    """The train part's option sets: the defaults (no recompute, the profile's micro-batch budget,
    chunked head, eager layers), then one change each; the doubled budget only with recompute (without
    it plan puts the 1.5B peak at 69 GiB of an H100's 79); the compiled decoder layers last (their
    first step carries the compilation). The CPU mode sweeps the same sets at tiny sizes, compiling
    with ``aot_eager`` (dynamo and AOTAutograd without inductor's C++ code generation, minutes here)."""
    return [{}, {"recompute": True}, {"head_chunk_tokens": 0},
            {"max_tokens_per_micro_batch": big_budget, "recompute": True}, {"varied_lengths": True},
            {"compile_layers": compile_backend}]


def _moe_sweep(compile_backend: bool | str | None) -> list[dict]:
    """The MoE shape's option sets: the defaults (experts as grouped GEMMs), the loop over experts, and
    (GPU) the compiled decoder layers."""
    return [{}, {"moe_grouped_mm": False}] + ([{"compile_layers": compile_backend}] if compile_backend else [])


# after the default decode path and cache (captured static steps where the device has graphs): the
# per-call-shaped step uncaptured, the generic layer loop, the growing cache
DECODE_SWEEP = [{"decode_graphs": "off"}, {"decode": "layers"}, {"cache": "dynamic"}]
PROFILES = {
    "gpu": {
        "train": {"samples": 32, "prompt": 512, "response": 512, "budget": 8192, "steps": 3, "warmup": 1,
                  "shapes": {"qwen2.5-1.5b": _train_sweep(16384, True), "qwen3-moe-2b": _moe_sweep(True)},
                  "megatron_shape": "1.5b"},
        # batch 1 (latency) runs the sampler alone; 64 and 256 beside `generate`
        "decode": {"shape": "qwen2.5-1.5b", "batches": [1, 64, 256], "generate_batches": [64, 256], "prompt": 512,
                   "new": 1024, "warm_tokens": 16,
                   "sweep_batch": 256, "sweep": DECODE_SWEEP,
                   # the prefill alone, packed vs padded (prefill_packed.py): one engine, about 10 prefills a line
                   "prefill": {"batch": 64, "max_len": 2048, "dists": ["skewed", "spread"], "repeats": 3}},
        # RL_CASES' shapes: the 0.5B folder at 16 x 4 prompts, 128 / 128 tokens, and per case what differs;
        # GRPO at 64 x 8, 512 / 256 (docs/gpu_suite.md: the estimate of about 2.5 minutes for all five)
        "rl": {"shape": "qwen2.5-0.5b", "digits": 126, "max_prompt": 128, "new": 128, "prompts": 16, "n": 4,
               "budget": 16384,
               "cases": {"grpo": {"digits": 510, "max_prompt": 512, "new": 256, "prompts": 64, "n": 8},
                         "dapo": {"shape": "tiny-moe", "prompts": 32, "n": 8},
                         "multi_turn": {"digits": 3, "max_prompt": 16, "new": 32,
                                        "overrides": ["rollout.multi_turn.max_response_tokens=96",
                                                      "rollout.multi_turn.max_observation_tokens=16"]}}},
        "timeouts": {"env": 120, "tests": 180, "megatron_tests": 180, "train": 240, "megatron_train": 150,
                     "decode": 200, "rl_case": 150},
        "budget_s": 540,
    },
    "cpu": {
        "train": {"samples": 2, "prompt": 16, "response": 16, "budget": 64, "steps": 1, "warmup": 1,
                  "shapes": {"tiny-dense": _train_sweep(32, "aot_eager"), "tiny-moe": _moe_sweep(None)},
                  "megatron_shape": None},
        "decode": {"shape": "tiny-dense", "batches": [1, 2, 4], "generate_batches": [2, 4], "prompt": 8, "new": 8,
                   "warm_tokens": 2,
                   "sweep_batch": 4, "sweep": DECODE_SWEEP,
                   "prefill": {"batch": 4, "max_len": 32, "dists": ["skewed"], "repeats": 1}},
        "rl": {"shape": "tiny-dense", "digits": 14, "max_prompt": 16, "new": 8, "prompts": 2, "n": 2,
               "budget": 256,
               "cases": {"dapo": {"shape": "tiny-moe"},
                         "multi_turn": {"digits": 3, "max_prompt": 16,
                                        "overrides": ["rollout.multi_turn.max_response_tokens=24",
                                                      "rollout.multi_turn.max_observation_tokens=8"]}}},
        "timeouts": {"env": 120, "tests": 180, "megatron_tests": 180, "train": 240, "megatron_train": 150,
                     "decode": 180, "rl_case": 240},
        "budget_s": 600,
    },
}
PARTS = ("tests", "train", "decode", "rl")


# ================================================================================ child side
# Everything below runs in a subprocess started by the suite (``--child NAME --spec JSON``): it
# imports torch, prints JSON lines on stdout, and never touches the other parts.

def emit(line: dict) -> None:
    print(json.dumps(line, default=str), flush=True)


TRACEBACK_LINES = 30  # the tail of a traceback (or of a dead child's stderr) every error line carries


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def traceback_tail(e: BaseException, n: int = TRACEBACK_LINES) -> list[str]:
    """The last ``n`` lines of ``e``'s traceback, its chain ordered so that the root cause comes last.

    Python prints a chain cause first, so the tail of its usual text is the outermost exception
    (a ``StageFailure`` re-raised by the worker) and loses the frames where the error began; here
    each exception's own traceback follows the one it caused, and the tail ends where it was raised."""
    import traceback

    blocks, seen, x, link = [], set(), e, ""
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        blocks += [link, *traceback.format_exception(type(x), x, x.__traceback__, chain=False)]
        if x.__cause__ is not None:
            x, link = x.__cause__, "\nThe above exception was raised from this one (its direct cause):\n\n"
        else:
            x = None if x.__suppress_context__ else x.__context__
            link = "\nThe above exception was raised while handling this one:\n\n"
    return "".join(blocks).rstrip("\n").splitlines()[-n:]


class ChildFailed(RuntimeError):
    """A process this child started failed; ``lines`` is its stderr, which holds the traceback."""

    def __init__(self, message: str, lines: list[str]) -> None:
        super().__init__(message)
        self.lines = lines


def failure(e: BaseException) -> dict:
    """An error line's keys for an exception caught in a child: the message and its traceback's tail
    (for a process the child started, the tail of that process's stderr)."""
    tail = e.lines[-TRACEBACK_LINES:] if isinstance(e, ChildFailed) else traceback_tail(e)
    return {"error": _error(e), "traceback": tail}


def _device(spec: dict):
    from rlrecipes import device as devmod

    return devmod.torch_device(devmod.resolve(spec["device"]))


def _process_group(kind: str) -> None:
    sys.path.insert(0, str(HERE))
    from rollout_vs_generate import ensure_process_group  # a 1-process group, as the engines want

    ensure_process_group(kind)


def _cache_dir(spec: dict) -> Path:
    import tempfile

    return Path(spec.get("cache") or tempfile.gettempdir())


def prepare_model(name: str, spec: dict) -> tuple[Path, object, dict | None]:
    """``(folder, ModelDims, Qwen2 shape dict or None)`` of a named shape: a random bf16 HF folder,
    written once (tensor by tensor, from a seed) and reused by later runs."""
    sys.path.insert(0, str(HERE))
    from engine_memory import write_folder
    from engine_throughput import SHAPES

    from rlrecipes.models import dims_from_hf_config

    if name in DENSE:
        shape = SHAPES[DENSE[name]] if DENSE[name] else TINY_DENSE
        folder = _cache_dir(spec) / f"rlrecipes-bench-qwen2-{DENSE[name] or name}"  # engine_throughput's folder
        write_folder(folder, shape=shape)
        from transformers import AutoConfig

        return folder, dims_from_hf_config(AutoConfig.from_pretrained(str(folder), local_files_only=True)), shape
    if name in MOE:
        import dataclasses

        from rlrecipes.models import PRESETS, SMOKE

        kind, base, change = MOE[name]
        dims = dataclasses.replace((PRESETS if kind == "preset" else SMOKE)[base], **change)
        folder = _cache_dir(spec) / f"rlrecipes-bench-{name}"
        write_config_folder(folder, dims)
        return folder, dims, None
    raise ValueError(f"unknown shape {name!r}; known: {', '.join([*DENSE, *MOE])}")


def write_config_folder(folder: Path, dims, seed: int = 0) -> Path:
    """A random bf16 HF folder of ``dims`` (any family), written tensor by tensor; reused when present."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlrecipes.engines.native.loader import HFFolderWriter
    from rlrecipes.models import hf_config

    if (folder / "config.json").is_file():  # HFFolderWriter writes config.json last
        return folder
    cfg = hf_config(dims)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    w = HFFolderWriter(folder, cfg, dtype=torch.bfloat16, max_shard_bytes=256 << 20)
    for name, p in meta.named_parameters():
        w.add(name, torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02)
    w.close()
    return folder


def model_flops(dims, shape: dict | None, lengths: list[int]) -> float:
    """Model FLOPs of one train step (forward + backward): engine_throughput's count for Qwen2 shapes;
    for MoE 6 x the matmul parameters a token touches (routed experts top-k, router, head; the
    embedding lookup is no matmul) + causal attention 6 x layers x (heads x head_dim) x length^2 / 2."""
    if shape is not None:
        from engine_throughput import model_flops_per_step

        return model_flops_per_step(shape, lengths)
    matmul = dims.active_params() - dims.vocab_size * dims.hidden_size - dims.hidden_size
    q = dims.num_heads * dims.head_dim
    return sum(6 * matmul * n + 6 * dims.num_layers * q * n * n / 2 for n in lengths)


def option_label(opts: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in opts.items()) or "defaults"


def child_env(spec: dict) -> None:
    import importlib
    import importlib.metadata as md
    import importlib.util
    import platform

    import torch

    from rlrecipes import device as devmod

    kind = "cpu" if spec.get("cpu") else (spec.get("device") if spec.get("device") not in (None, "auto")
                                          else devmod.accelerator())
    line = {"part": "env", "name": "device", "python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "megatron-core", "flash-attn", "ray", "pytest"):
        try:
            line[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            line[pkg] = None
    megatron: bool | str | None = None
    if importlib.util.find_spec("megatron") is not None:
        try:
            importlib.import_module("megatron.core")
            megatron = True
        except Exception as e:  # noqa: BLE001 - reported, the megatron lines are not run
            megatron = _error(e)
    line["megatron_core_imports"] = megatron is True
    if megatron not in (None, True):
        line["megatron_import_error"] = megatron
    if kind is None:
        line.update(device_type=None, device_name=None, traceback=[],
                    error="no CUDA or NPU device is visible to torch here; run with --cpu for the reduced mode")
        emit(line)
        return
    dev = devmod.torch_device(kind)
    mem = devmod.memory_stats(dev)
    line.update(device_type=kind, device_name=devmod.device_name(dev), device_count=devmod.device_count(kind),
                memory_bytes=int(mem.total_bytes or 0), peak_flops=devmod.peak_flops(dev),
                bf16=devmod.supports_bf16(dev), cpu_count=os.cpu_count())
    emit(line)


def child_train(spec: dict) -> None:
    """One JSON line per option set of one shape (one process: the folder is written and the process
    group set up once; every engine is dropped and the allocator emptied before the next)."""
    import gc

    import torch.distributed as dist

    from rlrecipes import device as devmod

    dev = _device(spec)
    kind = dev.type
    t0 = time.perf_counter()
    try:
        folder, dims, shape = prepare_model(spec["shape"], spec)
    except Exception as e:  # noqa: BLE001 - no folder, no option set of this shape can run
        emit({"part": "train", "name": f"native {spec['shape']}", "shape": spec["shape"], **failure(e)})
        return
    write_s = time.perf_counter() - t0
    _process_group(kind)
    devmod.set_device(dev)
    for opts in spec["sweep"]:
        line = {"part": "train", "name": f"native {spec['shape']} {option_label(opts)}", "engine": "native",
                "shape": spec["shape"], "options": opts}
        t0 = time.perf_counter()
        try:
            line.update(train_once(spec, opts, folder, dims, shape, dev))
            line["write_s"] = round(write_s, 2)
        except Exception as e:  # noqa: BLE001 - one option set failing is recorded; the next runs
            line.update(failure(e))
        line["seconds"] = round(time.perf_counter() - t0, 2)
        gc.collect()
        devmod.empty_cache(dev)
        emit(line)
    if dist.is_initialized():
        dist.destroy_process_group()


def train_once(spec: dict, opts: dict, folder: Path, dims, shape: dict | None, dev) -> dict:
    """engine_throughput.py's measurement: load through the sharded loader, one warm-up step, then the
    median of ``steps`` timed train steps of ``samples`` sequences packed into token-budgeted micro-batches."""
    import torch
    from engine_memory import pg_loss
    from engine_throughput import plan_memory, timed_train_steps

    from rlrecipes import device as devmod
    from rlrecipes.engines.base import SeqBatch
    from rlrecipes.engines.native import COMPILE_LAYERS, MOE_GROUPED_MM
    from rlrecipes.engines.native.head import DEFAULT_CHUNK_TOKENS
    from rlrecipes.engines.native.train import NativeTrainEngine

    budget = int(opts.get("max_tokens_per_micro_batch", spec["budget"]))
    recompute = bool(opts.get("recompute", False))
    head_chunk = int(opts.get("head_chunk_tokens", DEFAULT_CHUNK_TOKENS))
    attn = opts.get("attn_implementation", "sdpa")
    grouped = bool(opts.get("moe_grouped_mm", MOE_GROUPED_MM))
    compile_layers = opts.get("compile_layers", COMPILE_LAYERS)
    devmod.reset_peak_memory(dev)
    t0 = time.perf_counter()
    eng = NativeTrainEngine(str(folder), layout=(1, 1), device=dev, dtype=spec.get("dtype", "auto"), lr=1e-5,
                            max_tokens_per_micro_batch=budget, recompute=recompute, head_chunk_tokens=head_chunk,
                            attn_implementation=attn, moe_grouped_mm=grouped, compile_layers=compile_layers)
    devmod.synchronize(dev)
    load_s = time.perf_counter() - t0
    loaded = devmod.memory_stats(dev).allocated_bytes
    n, p, r = spec["samples"], spec["prompt"], spec["response"]
    g = torch.Generator().manual_seed(0)
    v = dims.vocab_size
    varied = bool(opts.get("varied_lengths", False))
    # equal lengths (engine_throughput's batch): every packed row holds one sample; varied: responses of
    # r/8..r tokens, so rows hold several samples and attention runs under a block-diagonal mask
    rlens = ([int(x) for x in torch.randint(max(1, r // 8), r + 1, (n,), generator=g)] if varied else [r] * n)
    batch = SeqBatch(prompts=[torch.randint(0, v, (p,), generator=g) for _ in range(n)],
                     responses=[torch.randint(0, v, (k,), generator=g) for k in rlens],
                     per_sample={"advantages": torch.randn(n, generator=g)})
    t0 = time.perf_counter()  # the first step apart: with compile_layers it carries the compilation
    first = eng.train_step(batch, pg_loss)
    devmod.synchronize(dev)
    first_step_s = time.perf_counter() - t0
    step_s, metrics, stats = timed_train_steps(eng, batch, dev, warmup=max(0, spec["warmup"] - 1),
                                               steps=spec["steps"])
    lengths = [p + k for k in rlens]
    flops = model_flops(dims, shape, lengths)
    peak = devmod.peak_flops(dev)
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[eng.compute_dtype]
    mem = plan_memory(folder, dev.type, dtype, budget, p, r, recompute,
                      (stats.total_bytes or 64 * 2**30) / 2**30, "native")
    out = {"dtype": dtype, "params": sum(x.numel() for x in eng.model.parameters()),
           "active_params": int(dims.active_params()), "recompute": recompute, "head_chunk_tokens": head_chunk,
           "moe_grouped_mm": grouped, "experts_implementation": getattr(eng.config, "_experts_implementation", None)
           if dims.num_experts else None, "compile_layers": eng.compile_backend or False,
           "first_step_s": round(first_step_s, 3), "grad_norm_first": first.get("actor/grad_norm"),
           "attn_implementation": attn, "max_tokens_per_micro_batch": budget, "samples": n, "prompt": p,
           "response": r, "varied_lengths": varied, "tokens_per_step": sum(lengths),
           "micro_batches": metrics.get("actor/micro_batches"),
           "step_s": round(step_s, 4), "tokens_per_s": round(sum(lengths) / step_s, 1),
           "model_tflops_per_s": round(flops / step_s / 1e12, 3),
           "mfu": round(flops / step_s / peak, 4) if peak else None,
           "peak_bytes": int(stats.peak_bytes), "loaded_bytes": int(loaded), "plan_total_bytes": int(mem.total),
           "peak_over_plan": round(stats.peak_bytes / mem.total, 3) if mem.total else None,
           "plan_breakdown_gib": mem.gib(), "grad_norm": metrics.get("actor/grad_norm"), "load_s": round(load_s, 2),
           "steps": spec["steps"]}
    del eng
    return out


def child_decode(spec: dict) -> None:
    """The prefill packed vs padded, the native sampler vs ``generate`` at each batch size, then the
    sampler's options at one batch."""
    import gc

    from rlrecipes import device as devmod
    from rlrecipes.engines.native.rollout import NativeRolloutEngine

    dev = _device(spec)
    try:
        folder, _dims, _ = prepare_model(spec["shape"], spec)
    except Exception as e:  # noqa: BLE001
        emit({"part": "decode", "name": "decode", "shape": spec["shape"], **failure(e)})
        return
    _process_group(dev.type)
    hf_at: dict[int, float] = {}
    eng = None
    pre = spec.get("prefill")
    for dist_name in (pre or {}).get("dists", []):
        line = {"part": "decode", "name": f"prefill packed vs padded {dist_name} batch={pre['batch']}",
                "shape": spec["shape"], "dist": dist_name}
        t0 = time.perf_counter()
        try:
            if eng is None:
                eng = NativeRolloutEngine(str(folder), layout=(1, 1), device=dev, seed=0,
                                          dtype=spec.get("dtype", "auto"))
            line.update(prefill_once(eng, pre, dist_name))
        except Exception as e:  # noqa: BLE001
            line.update(failure(e))
        line["seconds"] = round(time.perf_counter() - t0, 2)
        emit(line)
    for batch in spec["batches"]:
        with_generate = batch in spec.get("generate_batches", spec["batches"])
        line = {"part": "decode", "name": f"native vs generate batch={batch}" if with_generate else
                f"native batch={batch}", "shape": spec["shape"], "batch": batch}
        t0 = time.perf_counter()
        try:
            if eng is None:
                eng = NativeRolloutEngine(str(folder), layout=(1, 1), device=dev, seed=0,
                                          dtype=spec.get("dtype", "auto"))
            line.update(decode_once(eng, batch, spec, with_generate=with_generate))
            if with_generate:
                hf_at[batch] = line["hf_generate_tokens_per_s"]
            if batch == 64:
                line["target_speedup"] = TARGET_DECODE_SPEEDUP
            line["target_bandwidth_share"] = {64: TARGET_BANDWIDTH_64, 256: TARGET_BANDWIDTH_256}.get(batch)
        except Exception as e:  # noqa: BLE001
            line.update(failure(e))
        line["seconds"] = round(time.perf_counter() - t0, 2)
        emit(line)
    del eng
    gc.collect()
    devmod.empty_cache(dev)
    batch = spec["sweep_batch"]
    for opts in spec["sweep"]:
        line = {"part": "decode", "name": f"native batch={batch} {option_label(opts)}", "shape": spec["shape"],
                "batch": batch, "options": opts}
        t0 = time.perf_counter()
        try:
            eng = NativeRolloutEngine(str(folder), layout=(1, 1), device=dev, seed=0, dtype=spec.get("dtype", "auto"),
                                      **opts)
            line.update(decode_once(eng, batch, spec, with_generate=False))
            if batch in hf_at:
                line["hf_generate_tokens_per_s"] = hf_at[batch]
                line["speedup"] = round(line["native_tokens_per_s"] / hf_at[batch], 3)
            del eng
        except Exception as e:  # noqa: BLE001
            line.update(failure(e))
        line["seconds"] = round(time.perf_counter() - t0, 2)
        gc.collect()
        devmod.empty_cache(dev)
        emit(line)


def prefill_once(eng, pre: dict, dist_name: str) -> dict:
    """``benchmarks/prefill_packed.py``'s measurement on the suite's engine: one prefill
    (``sample(..., max_new_tokens=1)``) of ``pre["batch"]`` prompts of the distribution's lengths, in
    each layout of the same engine (its ``prefill_layout`` switched between calls, the layouts taking
    turns), the median of ``repeats`` after a warm-up, with the greedy tokens' agreement."""
    sys.path.insert(0, str(HERE))
    from prefill_packed import lengths_of, measure

    out = {"batch": pre["batch"], "decode": eng.decode_path, "prefill": eng.prefill_path, "cache": eng.cache_kind,
           "dtype": str(eng.dtype).replace("torch.", "")}
    out.update(measure(eng, lengths_of(dist_name, pre["batch"], pre["max_len"]), repeats=pre["repeats"]))
    return out


def decode_bytes_per_iteration(model, batch: int, context: float) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) one decode iteration reads: every parameter but the input
    embedding (a gather of ``batch`` rows; the whole table when tied to the head, which streams it),
    and ``batch`` rows of ``context`` cached positions, a key and a value per KV head per layer."""
    cfg = model.config
    emb = model.get_input_embeddings().weight
    tied = emb is model.get_output_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not emb)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * emb.element_size()
    return int(weights), int(batch * context * per_token)


def bandwidth_share(eng, batch: int, prompt: int, new: int, warm: int, iteration_s: float) -> dict:
    """A decode iteration's bytes read over its seconds, as a share of the device's HBM bandwidth
    (its row of ``rlrecipes/hardware.py``; none for a device the table does not name)."""
    from rlrecipes import device as devmod
    from rlrecipes.hardware import HARDWARE, hardware_of_device

    weights, kv = decode_bytes_per_iteration(eng.model, batch, prompt + (new + warm) / 2)  # the mean context
    row = hardware_of_device(devmod.device_name(eng.device), eng.device.type)
    out = {"iteration_s": round(iteration_s, 6), "weight_bytes_per_iteration": weights,
           "kv_bytes_per_iteration": kv, "hardware": row}
    if row is not None and iteration_s > 0:
        hbm = HARDWARE[row].hbm_bytes_s
        out.update(hbm_bytes_s=hbm, bandwidth_share=round((weights + kv) / iteration_s / hbm, 4),
                   bandwidth_limit_iteration_s=round((weights + kv) / hbm, 6))
    return out


def decode_once(eng, batch: int, spec: dict, *, with_generate: bool) -> dict:
    """benchmarks/rollout_vs_generate.bench_vs_generate's method: the engine's own model object for both
    sides, the same ``batch`` random prompts (no padding), temperature 1 with no top-k / top-p and no
    EOS (``generate``: ``min_new_tokens = max_new_tokens``), so both produce ``batch x new`` tokens; the
    whole call is timed between device synchronizations. The warm-up is a short call of each
    (``warm_tokens``), then one timed call of each, native first."""
    import torch

    from rlrecipes import device as devmod

    P, N, seed = spec["prompt"], spec["new"], 0
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, eng.config.vocab_size, (P,), generator=g) for _ in range(batch)]
    ids = torch.stack(prompts).to(eng.device)
    am = torch.ones_like(ids)
    hf = eng.model

    def native(n: int) -> int:
        out = eng.sample(prompts, max_new_tokens=n, temperature=1.0, seed=seed)
        return sum(int(r.numel()) for r in out.responses)

    def generate(n: int) -> int:
        hf.generation_config.eos_token_id = None
        out = hf.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        return int(out[:, ids.shape[1]:].numel())

    def timed(fn) -> tuple[float, int, int]:
        fn(spec["warm_tokens"])
        devmod.synchronize(eng.device)
        devmod.reset_peak_memory(eng.device)
        t = time.perf_counter()
        tokens = fn(N)
        devmod.synchronize(eng.device)
        return time.perf_counter() - t, tokens, int(devmod.memory_stats(eng.device).peak_bytes)

    t_nat, tok_nat, peak_nat = timed(native)
    out = {"prompt_len": P, "new_tokens": N, "layers": eng.config.num_hidden_layers, "decode": eng.decode_path,
           "decode_graphs": eng.decode_graphs,
           "prefill": eng.prefill_path, "prefill_layout": eng.prefill_layout,
           "cache": eng.cache_kind, "dtype": str(eng.dtype).replace("torch.", ""), "native_s": round(t_nat, 4),
           "native_tokens": tok_nat, "native_tokens_per_s": round(tok_nat / t_nat, 1), "native_peak_bytes": peak_nat}
    # one decode iteration against the memory-bandwidth limit: a short call of W tokens timed too, so
    # the iteration is (t_N - t_W) / (N - W), prefill cancelled
    W = spec["warm_tokens"]
    devmod.synchronize(eng.device)
    t = time.perf_counter()
    native(W)
    devmod.synchronize(eng.device)
    out.update(bandwidth_share(eng, batch, P, N, W, (t_nat - (time.perf_counter() - t)) / max(1, N - W)))
    if with_generate:
        t_hf, tok_hf, peak_hf = timed(generate)
        out.update(hf_generate_s=round(t_hf, 4), hf_generate_tokens=tok_hf,
                   hf_generate_tokens_per_s=round(tok_hf / t_hf, 1), hf_generate_peak_bytes=peak_hf,
                   speedup=round((tok_nat / t_nat) / (tok_hf / t_hf), 3))
    return out


def rl_overrides(spec: dict, folder: Path, tokenizer: Path) -> list[str]:
    """``rlrecipes run <recipe> --smoke`` overrides: the model, lengths, batch and device of one case.

    The model is a random HF folder of the shape (``model.path``: with ``model.smoke`` also set, the
    folder is loaded and the smoke task and reward are kept). ``model.smoke.*`` dims cannot serve
    here: the smoke models have 256 positions (``max_position_embeddings``, which ``SmokeDims`` does
    not override) and ``plan`` refuses 512 + 1,024-token samples on them. ``model.tokenizer`` names
    the smoke tokenizer the run uses anyway, so that ``plan``'s multi-turn check reads it rather than
    the folder (which holds none)."""
    return [
        f"model.path={folder}", "model.preset=null", f"model.tokenizer={tokenizer}",
        f"data.synthetic_digits={spec['digits']}", f"data.max_prompt_length={spec['max_prompt']}",
        f"rollout.sampling.max_new_tokens={spec['new']}", f"trainer.global_batch={spec['prompts']}",
        f"trainer.mini_batch={spec['prompts']}", f"trainer.n_samples_per_prompt={spec['n']}",
        f"trainer.max_tokens_per_micro_batch={spec['budget']}", f"resources.device={spec['device']}",
        "resources.devices_per_node=1", "resources.nodes=1", "resources.dies_per_card=1",
        "actor.layout.tp=1", "actor.layout.ep=1",
        f"resources.device_memory_gb={spec.get('memory_gb') or 64}", "trainer.export_hf=false",
        "trainer.checkpoint_interval=0", f"trainer.steps={spec['steps']}"]


# The RL part's runs: name -> recipe (run with --smoke: its synthetic task, smoke reward and tokenizer),
# the overrides that select what the run exercises, and steps. The model, lengths and batch come from
# the profile's ``rl`` entry (PROFILES) and rl_overrides(); every case runs through run_rl_case().
RL_CASES = {
    "grpo": {"recipe": "qwen25_7b", "overrides": [], "steps": 2},
    "dapo": {"recipe": "qwen3_moe_30b", "overrides": [], "steps": 2},  # clip-higher, dynamic sampling, overlong
    "ppo": {"recipe": "qwen25_7b", "steps": 2,
            "overrides": ["algorithm.name=ppo", "algorithm.adv_estimator=gae", "algorithm.lam=0.95"]},
    "multi_turn": {"recipe": "qwen25_7b", "steps": 1,  # the calculator tool, the smoke tokenizer's call format
                   "overrides": ["data.synthetic=add", "rollout.multi_turn.enabled=true",
                                 "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.tool_format=smoke"]},
    "lora": {"recipe": "qwen25_7b", "overrides": ["actor.lora.rank=8"], "steps": 1},  # needs peft
}


def rl_case_spec(profile_rl: dict, case: str) -> dict:
    """A case's shape: the profile's RL defaults with the case's own changes (``cases[case]``)."""
    return {**{k: v for k, v in profile_rl.items() if k != "cases"},
            **profile_rl["cases"].get(case, {})}


def rl_case_name(case: str, shape: dict) -> str:
    return f"{case} {shape['shape']} {shape['prompts']}x{shape['n']} {shape['max_prompt']}/{shape['new']}"


def child_rl(spec: dict) -> None:
    """The RL cases ``spec["cases"]`` in order, one line each. After a case that fails this process
    stops, and the suite starts a fresh one for the cases left: a failed step can leave the device
    unusable (a device-side assert poisons a CUDA context), and the next case must not inherit it."""
    for case in spec["cases"]:
        line = run_rl_case(case, {**spec, **spec["shapes"][case]})
        emit(line)
        if line.get("error"):
            return


def run_rl_case(case: str, spec: dict) -> dict:
    """One named case of RL_CASES: its steps on one device with the native engines (the in-process
    driver, or ``rlrecipes run`` with ``--rl-driver cli``); the line summarises the last step, the
    first carrying the warm-up."""
    c = RL_CASES[case]
    line = {"part": "rl", "name": rl_case_name(case, spec), "case": case, "driver": spec["driver"],
            "algorithm": None, "recipe": f"{c['recipe']} --smoke", "shape": spec["shape"],
            "prompts": spec["prompts"], "samples_per_prompt": spec["n"], "prompt_len": spec["max_prompt"],
            "max_new_tokens": spec["new"]}
    t0 = time.perf_counter()
    run_dir = Path(spec["run_dir"]) / case
    try:
        from rlrecipes.data import build_smoke_tokenizer
        from rlrecipes.recipe import load_recipe
        from rlrecipes.workflow.local import run_local

        folder, dims, _ = prepare_model(spec["shape"], spec)
        line["params"] = int(dims.total_params())
        tokenizer = build_smoke_tokenizer(run_dir / "tokenizer")
        overrides = [*rl_overrides({**spec, "steps": c["steps"]}, folder, tokenizer), *c["overrides"],
                     *spec.get("overrides", [])]
        line["overrides"] = overrides
        r = load_recipe(c["recipe"], smoke=True, overrides=overrides)
        line.update(algorithm=r.algorithm.name, multi_turn=r.rollout.multi_turn.enabled, lora_rank=r.actor.lora.rank)
        if spec["driver"] == "cli":
            cmd = [sys.executable, "-m", "rlrecipes", "run", c["recipe"], "--smoke", "--quiet", "-d", "1",
                   "--keep-batch", "--out", str(run_dir), *overrides]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if p.returncode != 0:
                raise ChildFailed(f"rlrecipes run exited {p.returncode}", p.stderr.splitlines())
        else:
            run_local(c["recipe"], overrides, c["steps"], run_dir)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        if not rows:
            raise RuntimeError(f"{run_dir}/metrics.jsonl has no rows")
        line.update(rl_summary(rows))
        line["run_dir"] = str(run_dir)
    except Exception as e:  # noqa: BLE001 - recorded; the suite starts the next case in a fresh process
        line.update(failure(e))
    line["seconds"] = round(time.perf_counter() - t0, 2)
    return line


def rl_summary(rows: list[dict]) -> dict:
    """The last row's step seconds per stage, model-compute seconds per stage, TPS and the share outside
    model compute (the run's own ``perf/overhead_share``, and step - compute seconds)."""
    last = rows[-1]
    stage_s = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("timing_s/") and k != "timing_s/step"}
    compute_s = {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("compute_s/")}
    step_s = last.get("timing_s/step")
    out = {"steps": len(rows), "measured_step": last.get("step"), "step_s": step_s, "stage_s": stage_s,
           "compute_s": compute_s, "tps_per_card": last.get("perf/tps_per_card"), "tokens": last.get("perf/tokens"),
           "samples": last.get("samples"), "response_length_mean": last.get("response_length/mean"),
           "overhead_share": last.get("perf/overhead_share"),
           "outside_compute_s": round(step_s - sum(compute_s.values()), 4) if step_s is not None else None,
           "mem_peak_gb": last.get("mem/peak_gb"), "reshard_bytes": last.get("reshard/bytes"),
           "reward_mean": last.get("reward/mean")}
    if len(rows) > 1:
        out["first_step_s"] = rows[0].get("timing_s/step")
        out["first_stage_s"] = {k.split("/", 1)[1]: v for k, v in rows[0].items()
                                if k.startswith("timing_s/") and k != "timing_s/step"}
    return out


CHILDREN = {"env": child_env, "train": child_train, "decode": child_decode, "rl": child_rl}


# ================================================================================ suite side
# The orchestrator imports no torch: it starts the parts, streams their lines, applies the time budget,
# prints the table and writes the results file.

class Ran(NamedTuple):
    """What Suite.run saw of one subprocess."""

    rc: int | None  # None: not started, or timed out
    lines: list[dict]  # its JSON lines, as emitted
    out: str  # its other stdout lines
    err: list[str]  # the last 200 lines of its stderr
    why: str | None  # why it failed (not started, timed out, exited non-zero), or None


_SIGNALS = {int(x) for x in signal.Signals}


def stop_process(proc: subprocess.Popen) -> None:
    """End a timed-out child: SIGABRT to it first (faulthandler, enabled in every child through
    PYTHONFAULTHANDLER, writes each thread's Python stack to stderr before the abort), then SIGTERM
    and SIGKILL to its process group, which holds whatever it started."""
    try:
        os.kill(proc.pid, signal.SIGABRT)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        t = time.time()
        while time.time() - t < 5 and _group_alive(proc):
            time.sleep(0.1)
    proc.wait()


def no_core_files() -> None:
    """No core files from the children (inherited): a timed-out child is ended with SIGABRT, and a core
    of a process holding a device can be tens of GiB."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ImportError, ValueError, OSError):
        pass


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the child itself, so that only live processes keep its group
    try:
        os.killpg(proc.pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.mode = "cpu" if args.cpu else "gpu"
        self.profile = PROFILES[self.mode]
        self.lines: list[dict] = []
        self.t0 = time.time()
        self.budget_s = args.budget_s if args.budget_s is not None else self.profile["budget_s"]
        self.env: dict = {}

    # ------------------------------------------------------------------ plumbing
    def emit(self, line: dict) -> None:
        self.lines.append(line)
        print(json.dumps(line, default=str), flush=True)

    def child_env(self, device_type: str | None) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        env["PYTHONFAULTHANDLER"] = "1"  # a crash, or the SIGABRT of a timeout, writes the Python stacks to stderr
        if device_type:
            env["RLRECIPES_DEVICE"] = device_type
        return env

    def remaining(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def run(self, cmd: list[str], *, part: str, name: str, cap: float, env: dict, parse_json: bool = True,
            tag: dict | None = None, line_cap: float | None = None, report: bool = True) -> Ran:
        """Run one subprocess with a timeout (its cap, or what is left of the budget; with ``line_cap``
        also at most that long without a JSON line); stream its JSON lines (``tag``'s keys added to
        each). A child that times out first gets SIGABRT, on which Python's faulthandler (enabled in
        every child) writes where each of its threads stood to stderr, then its process group is
        ended. When it times out or exits non-zero, an error line with the last TRACEBACK_LINES lines
        of its stderr is emitted (unless ``report`` is False: the caller names the failure itself)."""
        left = self.remaining()
        if left < 5:
            why = f"not started: the suite's time budget ({self.budget_s:.0f} s, --budget-s) ran out"
            if report:
                self.emit({"part": part, "name": name, "error": why, "traceback": []})
            return Ran(None, [], "", [], why)
        timeout = min(cap, left)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                                start_new_session=True)
        got: list[dict] = []
        out_text: list[str] = []
        err_tail: collections.deque = collections.deque(maxlen=200)
        last_line = [time.time()]

        def read_out() -> None:
            for raw in proc.stdout:
                s = raw.rstrip("\n")
                if parse_json and s.startswith("{"):
                    try:
                        line = json.loads(s)
                    except ValueError:
                        out_text.append(s)
                        continue
                    if tag:
                        line = {**tag, **line}
                    got.append(line)
                    last_line[0] = time.time()
                    self.emit(line)
                else:
                    out_text.append(s)

        def read_err() -> None:
            for raw in proc.stderr:
                err_tail.append(raw.rstrip("\n"))

        readers = [threading.Thread(target=read_out, daemon=True), threading.Thread(target=read_err, daemon=True)]
        for t in readers:
            t.start()
        end = time.time() + timeout
        why = None
        while True:
            limit = min(end, last_line[0] + line_cap) if line_cap else end
            try:
                rc = proc.wait(timeout=max(0.05, min(limit - time.time(), 1.0)))
                break
            except subprocess.TimeoutExpired:
                if time.time() >= limit:
                    rc = None
                    why = (f"timed out after {timeout:.0f} s" if limit >= end else
                           f"timed out: no line for {line_cap:.0f} s")
                    break
        if rc is None:
            stop_process(proc)
        for t in readers:
            t.join(timeout=5)
        if rc is not None and rc != 0:
            why = f"exited {rc}" + (f" ({signal.Signals(-rc).name})" if rc < 0 and -rc in _SIGNALS else "")
        err = list(err_tail)
        if why and report and (rc is None or parse_json):
            self.emit({"part": part, "name": name, "error": why, "traceback": err[-TRACEBACK_LINES:]})
        return Ran(rc, got, "\n".join(out_text), err, why)

    def child(self, kind: str, spec: dict, *, part: str, name: str, cap: float, device_type: str | None,
              **kw) -> Ran:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--spec", json.dumps(spec)]
        return self.run(cmd, part=part, name=name, cap=cap, env=self.child_env(device_type), **kw)

    # ------------------------------------------------------------------ parts
    def part_env(self) -> str | None:
        spec = {"cpu": self.args.cpu, "device": self.args.device}
        got = self.child("env", spec, part="env", name="device", cap=self.profile["timeouts"]["env"],
                         device_type="cpu" if self.args.cpu else None).lines
        self.env = got[0] if got else {}
        return self.env.get("device_type")

    def jobs(self, kind: str, parts: list[str]) -> list:
        """The measurements in the order they run: what the targets and the diagnosis need first (GPU
        tests, the 1.5B train sweep, the RL cases, decode), then the MoE shape and megatron, so that
        a run cut short by the time budget loses the least. The RL cases run before decode: they are
        short, and decode at batch 256 is the part that runs long. The table groups them by part again."""
        t, shapes = self.profile["timeouts"], list(self.profile["train"]["shapes"])
        out = []
        if "tests" in parts:
            out.append(lambda: self.pytest(["tests/gpu"], "tests/gpu", t["tests"]))
        if "train" in parts and shapes:
            out.append(lambda: self.train_native(kind, shapes[0]))
        if "rl" in parts:
            out.append(lambda: self.rl(kind))
        if "decode" in parts:
            out.append(lambda: self.decode(kind))
        if "train" in parts:
            out += [lambda sh=sh: self.train_native(kind, sh) for sh in shapes[1:]]
            out.append(lambda: self.train_megatron(kind))
        if "tests" in parts:
            out.append(self.megatron_tests)
        return out

    def megatron_tests(self) -> None:
        name = "tests/megatron_tier/test_megatron_gpu.py"
        if self.env.get("megatron_core_imports"):
            self.pytest([name], name, self.profile["timeouts"]["megatron_tests"])
        else:
            why = self.env.get("megatron_import_error") or "megatron-core is not installed"
            self.emit({"part": "tests", "name": name, "not_run": why})

    def pytest(self, paths: list[str], name: str, cap: float) -> None:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", *paths]
        t0 = time.time()
        env = self.child_env(None)
        env.pop("RLRECIPES_DEVICE", None)  # the GPU tests find the accelerator themselves
        ran = self.run(cmd, part="tests", name=name, cap=cap, env=env, parse_json=False)
        rc, out = ran.rc, ran.out
        if rc is None:
            return
        counts = pytest_counts(out)
        line = {"part": "tests", "name": name, "returncode": rc, **counts, "seconds": round(time.time() - t0, 2),
                "summary": (out.strip().splitlines() or [""])[-1][:300]}
        if rc not in (0, 5) or counts["failed"] or counts["errors"]:
            failing = [s for s in out.splitlines() if s.startswith(("FAILED", "ERROR"))][:20]
            line["error"] = f"pytest exited {rc}: {counts['failed']} failed, {counts['errors']} errors"
            line["failing"] = failing or (out.strip().splitlines()[-20:] + ran.err[-10:])
            line["traceback"] = pytest_traceback(out) or ran.err[-TRACEBACK_LINES:]
        self.emit(line)

    def train_native(self, kind: str, shape: str) -> None:
        p = self.profile["train"]
        sweep = list(p["shapes"][shape])
        if self.env.get("flash-attn") and shape in DENSE and self.mode == "gpu":
            # the engine's varlen path (one packed row per micro-batch), only where flash-attn is installed
            sweep += [{"attn_implementation": "flash_attention_2"},
                      {"attn_implementation": "flash_attention_2", "varied_lengths": True}]
        spec = {**{k: v for k, v in p.items() if k not in ("shapes", "megatron_shape")}, "device": kind,
                "shape": shape, "sweep": sweep, "cache": self.args.cache}
        self.child("train", spec, part="train", name=f"native {shape}", cap=self.profile["timeouts"]["train"],
                   device_type=kind)
        if shape in DENSE:
            # the third option of issue 49's item 3: FSDP2 explicit prefetch acts between ranks only
            self.emit({"part": "train", "name": f"native {shape} fsdp_prefetch", "not_run":
                       "fsdp_prefetch acts at DP > 1 only; this part trains one process on one device "
                       f"({self.env.get('device_count')} visible); tests/dist checks its values on gloo"})

    def train_megatron(self, kind: str) -> None:
        """megatron-core through ``engine_throughput.py --engine megatron`` (TP1 PP1, padded micro-batches
        of budget // (prompt + response) samples), at the dense shape only: that script writes Qwen2 folders."""
        p = self.profile["train"]
        mshape = p.get("megatron_shape")
        name = f"megatron qwen2.5-{mshape}" if mshape else "megatron"
        if not mshape:
            self.emit({"part": "train", "name": name, "not_run": "megatron-core computes on CUDA or NPU only"})
            return
        if not self.env.get("megatron_core_imports"):
            self.emit({"part": "train", "name": name,
                       "not_run": self.env.get("megatron_import_error") or "megatron-core is not installed"})
            return
        cmd = [sys.executable, str(HERE / "engine_throughput.py"), "--engine", "megatron", "--device", kind,
               "--shape", mshape, "--samples", str(p["samples"]), "--prompt", str(p["prompt"]),
               "--response", str(p["response"]), "--budget", str(p["budget"]), "--steps", str(p["steps"])]
        if self.args.cache:
            cmd += ["--folder", str(Path(self.args.cache) / f"rlrecipes-bench-qwen2-{mshape}")]
        ran = self.run(cmd, part="train", name=name, cap=self.profile["timeouts"]["megatron_train"],
                       env=self.child_env(kind), tag={"part": "train", "name": name, "options": {}})
        if ran.rc == 0 and not ran.lines:
            self.emit({"part": "train", "name": name, "error": "engine_throughput.py printed no JSON line",
                       "traceback": ran.err[-TRACEBACK_LINES:]})

    def decode(self, kind: str) -> None:
        spec = {**self.profile["decode"], "device": kind, "cache": self.args.cache}
        self.child("decode", spec, part="decode", name="decode", cap=self.profile["timeouts"]["decode"],
                   device_type=kind)

    def rl(self, kind: str) -> None:
        """RL_CASES (or --rl-cases) in one child, in order. A case that fails ends that child and a
        fresh one runs the cases left; a child that dies or stops answering is recorded against the
        case it was running (the first without a line), with its stderr's tail, and the rest go on."""
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(self.args.run_dir or (ROOT / "runs" / f"gpu_suite-rl-{stamp}"))
        mem = self.env.get("memory_bytes") or 0
        p = self.profile["rl"]
        shapes = {c: rl_case_spec(p, c) for c in self.rl_cases()}
        base = {"device": kind, "driver": self.args.rl_driver, "run_dir": str(run_dir), "cache": self.args.cache,
                "memory_gb": round(mem / 2**30, 1) if kind != "cpu" and mem else 64}
        cap = self.profile["timeouts"]["rl_case"]
        left = list(shapes)
        while left:
            ran = self.child("rl", {**base, "cases": left, "shapes": shapes}, part="rl", name="rl",
                             cap=cap * len(left), line_cap=cap, device_type=kind, report=False)
            done = {x.get("case") for x in ran.lines}
            failed_last = bool(ran.lines) and bool(ran.lines[-1].get("error"))
            left = [c for c in left if c not in done]
            if left and not failed_last:  # the child ended while running left[0]
                c = left.pop(0)
                self.emit({"part": "rl", "name": rl_case_name(c, shapes[c]), "case": c,
                           "error": ran.why or "the child ended without a line for this case",
                           "traceback": ran.err[-TRACEBACK_LINES:]})
            if ran.rc is None and ran.why and ran.why.startswith("not started"):
                for c in left:
                    self.emit({"part": "rl", "name": rl_case_name(c, shapes[c]), "case": c, "error": ran.why,
                               "traceback": []})
                return

    def rl_cases(self) -> list[str]:
        if not self.args.rl_cases:
            return list(RL_CASES)
        cases = [c.strip() for c in self.args.rl_cases.split(",") if c.strip()]
        unknown = sorted(set(cases) - set(RL_CASES))
        if unknown:
            raise SystemExit(f"--rl-cases: unknown {unknown}; choose from {', '.join(RL_CASES)}")
        return cases

    # ------------------------------------------------------------------ whole
    def main(self) -> int:
        parts = [p.strip() for p in self.args.parts.split(",") if p.strip()]
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            raise SystemExit(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
        rl_cases = self.rl_cases() if "rl" in parts else []
        no_core_files()
        self.emit({"part": "suite", "name": "start", "mode": self.mode, "parts": parts, "budget_s": self.budget_s,
                   "rl_cases": rl_cases, "argv": sys.argv[1:], "version": SUITE_VERSION})
        kind = self.part_env()
        if kind is not None:
            for job in self.jobs(kind, parts):
                job()
        return self.finish(parts)

    def finish(self, parts: list[str]) -> int:
        failed = [f"{x.get('part')}: {x.get('name')}" for x in self.lines if x.get("error")]
        targets = check_targets(self.lines, self.mode)
        name = self.env.get("device_name") or ("cpu" if self.args.cpu else "unknown")
        out = Path(self.args.out) if self.args.out else (
            HERE / "results" / f"gpu_suite-{slug(name)}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
        summary = {"part": "suite", "name": "summary", "device": name, "mode": self.mode, "parts": parts,
                   "failed": failed, "targets": targets, "seconds": round(time.time() - self.t0, 1),
                   "results_file": str(out)}
        self.emit(summary)
        result = {"suite": "gpu_suite", "version": SUITE_VERSION, "device": name,
                  "device_type": self.env.get("device_type"), "mode": self.mode,
                  "started": _dt.datetime.fromtimestamp(self.t0).isoformat(timespec="seconds"),
                  "seconds": summary["seconds"], "argv": sys.argv[1:], "commit": git_commit(), "failed": failed,
                  "targets": targets, "lines": self.lines}
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        except OSError as e:
            print(f"gpu_suite: cannot write {out}: {e}", file=sys.stderr)
            failed.append(f"results file: {e}")
        if not self.args.no_table:
            print(render_table(self.lines, targets, name, out), flush=True)
        return 1 if failed else 0


def pytest_counts(text: str) -> dict:
    """passed / failed / skipped / errors ... from pytest's closing line (``-q``)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "xfailed": 0, "xpassed": 0, "deselected": 0}
    lines = [s for s in text.strip().splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)|"
                                                               r"no tests ran", s)]
    if lines:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", lines[-1]):
            counts["errors" if word.startswith("error") else word] = int(n)
    return counts


def pytest_traceback(text: str, n: int = TRACEBACK_LINES) -> list[str]:
    """The last ``n`` lines of the tracebacks in pytest's FAILURES / ERRORS sections (``--tb=short``),
    without the captured-output subsections that follow each one."""
    out, keep, captured = [], False, False
    for s in text.splitlines():
        if re.match(r"^=+ (FAILURES|ERRORS) =+$", s):
            keep, captured = True, False
            continue
        if re.match(r"^=+ .* =+$", s):  # short test summary info, warnings summary, the closing line
            keep = False
            continue
        if not keep:
            continue
        if re.match(r"^_+ .* _+$", s):  # the next test's header
            captured = False
        elif re.match(r"^-+ Captured .* -+$", s):
            captured = True
        if not captured:
            out.append(s)
    return out[-n:]


def check_targets(lines: list[dict], mode: str) -> dict:
    """Issue 49's targets, read off the lines: met / missed on a GPU run, not applicable on --cpu.
    Each is the best value any line reached (the best train options, the faster decode path)."""
    def best(part: str, key: str, **match) -> tuple[float | None, dict | None]:
        hits = [x for x in lines if x.get("part") == part and x.get(key) is not None
                and all(x.get(k) == v for k, v in match.items())]
        top = max(hits, key=lambda x: x[key], default=None)
        return (top[key], top.get("options")) if top else (None, None)

    found = {
        "train_mfu_qwen2.5-1.5b_bf16": (TARGET_TRAIN_MFU, *best("train", "mfu", engine="native", shape="qwen2.5-1.5b",
                                                               dtype="bf16")),
        "train_mfu_qwen3-moe-2b_bf16": (TARGET_MOE_MFU, *best("train", "mfu", engine="native", shape="qwen3-moe-2b",
                                                             dtype="bf16")),
        "decode_speedup_batch64": (TARGET_DECODE_SPEEDUP, *best("decode", "speedup", batch=64, new_tokens=1024)),
        "decode_bandwidth_share_batch64": (TARGET_BANDWIDTH_64, *best("decode", "bandwidth_share", batch=64,
                                                                      new_tokens=1024)),
        "decode_bandwidth_share_batch256": (TARGET_BANDWIDTH_256, *best("decode", "bandwidth_share", batch=256,
                                                                        new_tokens=1024)),
    }
    na = mode == "cpu"
    return {name: {"target": target, "value": value, "options": options,
                   "met": None if na or value is None else value >= target}
            for name, (target, value, options) in found.items()}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def git_commit() -> str | None:
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10)
        return p.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _gib(n) -> str:
    return f"{n / 2**30:.2f}" if isinstance(n, (int, float)) else "-"


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-"


def result_text(x: dict) -> str:
    part = x.get("part")
    if part == "env":
        return (f"{x.get('device_name')} ({x.get('device_type')}), {_gib(x.get('memory_bytes'))} GiB, torch "
                f"{x.get('torch')}, transformers {x.get('transformers')}, megatron-core {x.get('megatron-core')}")
    if part == "tests" and "passed" in x:
        return f"{x['passed']} passed, {x['failed']} failed, {x['skipped']} skipped, {x['errors']} errors"
    if part == "train" and "tokens_per_s" in x:
        return (f"{x['tokens_per_s']:.0f} tok/s, MFU {_pct(x.get('mfu'))}, peak {_gib(x.get('peak_bytes'))} GiB "
                f"vs plan {_gib(x.get('plan_total_bytes'))} GiB ({x.get('dtype')})")
    if part == "decode" and "packed_s" in x:
        return (f"prefill of {x['tokens']} tokens ({x['padded_tokens']} padded): packed {x['packed_s']:.3f} s, "
                f"padded {x['padded_s']:.3f} s, x{x.get('speedup')} ({x.get('attention_backend')})")
    if part == "decode" and "native_tokens_per_s" in x:
        s = f"native {x['native_tokens_per_s']:.0f} tok/s ({x.get('decode')}/{x.get('cache')})"
        if x.get("hf_generate_tokens_per_s"):
            s += f", generate {x['hf_generate_tokens_per_s']:.0f} tok/s, x{x.get('speedup')}"
        if x.get("bandwidth_share") is not None:
            s += (f", {1000 * x['iteration_s']:.2f} ms/iteration = {_pct(x['bandwidth_share'])} of "
                  f"{x['hardware']}'s bandwidth ({1000 * x['bandwidth_limit_iteration_s']:.2f} ms at the limit)")
        return s
    if part == "rl" and "step_s" in x:
        stages = " ".join(f"{k} {v:.2f}" for k, v in sorted((x.get("stage_s") or {}).items()))
        return (f"step {x['step_s']:.2f} s [{stages}], TPS/card {x.get('tps_per_card') or 0:.0f}, outside compute "
                f"{_pct(x.get('overhead_share'))}")
    return ""


def render_table(lines: list[dict], targets: dict, device: str, out: Path) -> str:
    rows = []
    order = {p: i for i, p in enumerate(("env", *PARTS))}
    for x in sorted(lines, key=lambda x: order.get(x.get("part"), len(order))):  # stable: run order within a part
        if x.get("part") == "suite":
            continue
        if x.get("error"):
            status = "FAILED"
            text = str(x["error"]).splitlines()[0][:110]
        elif x.get("not_run"):
            status = "not run"
            text = str(x["not_run"])[:110]
        else:
            status = "ok"
            text = result_text(x)
        rows.append((x.get("part", ""), str(x.get("name", ""))[:64], status, text))
    w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("part", "name", "status", "result"))]
    fmt = "  ".join(f"{{:<{n}}}" for n in w)
    bar = "-" * (sum(w) + 6)
    body = [f"gpu_suite on {device}", bar, fmt.format("part", "name", "status", "result"), bar]
    body += [fmt.format(*r) for r in rows]
    body.append(bar)
    for key, t in targets.items():
        val = t["value"]
        share = "mfu" in key or "bandwidth" in key  # a share of the hardware's peak; else a speed-up
        shown = (_pct(val) if share else (f"x{val}" if val is not None else "-"))
        verdict = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        goal = _pct(t["target"]) if share else f"x{t['target']}"
        body.append(f"target {key}: {shown} (>= {goal}) {verdict}")
    body.append(f"results: {out}")
    return "\n".join(body)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the reduced mode: tiny shapes, the fewest steps, on the CPU")
    ap.add_argument("--device", default="auto", help="auto (the accelerator torch sees) | cuda | npu")
    ap.add_argument("--out", default=None,
                    help="results file (default benchmarks/results/gpu_suite-<device>-<date>.json)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--rl-driver", choices=["inprocess", "cli"], default="inprocess",
                    help="inprocess: the workflow's worker in a subprocess without Ray (default); cli: `rlrecipes run` "
                         "(needs Ray)")
    ap.add_argument("--rl-cases", default=None,
                    help=f"comma-separated subset of the RL part's runs (default all: {','.join(RL_CASES)})")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget of the whole suite (gpu 540, cpu 600)")
    ap.add_argument("--cache", default=None, help="folder for the random model folders (default: the temp dir)")
    ap.add_argument("--run-dir", default=None, help="the rl part's run folder (default runs/gpu_suite-rl-<time>)")
    ap.add_argument("--no-table", action="store_true", help="JSON lines only")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        sys.path.insert(0, str(HERE))
        CHILDREN[args.child](json.loads(args.spec or "{}"))
        return 0
    return Suite(args).main()


if __name__ == "__main__":
    sys.exit(main())
