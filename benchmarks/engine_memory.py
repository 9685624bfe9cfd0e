"""Native train engine memory at real size, measured against the planner: one JSON line per layout.

Writes a randomly initialised Qwen2.5-0.5B-shaped HF folder (safetensors, bf16, from config: no
download), then on 4 gloo ranks (no Ray) loads it with the native engine in each layout and runs
two train steps (the second is the steady state: Adam's moments exist while it runs). Per layout it
prints:

- ``full_model_bytes``: the whole model in the engine's master dtype (fp32 here);
- ``load_peak_extra_bytes``: max over ranks of (peak RSS during load - RSS before it);
- ``step_peak_extra_bytes``: max over ranks of (peak RSS over the two train steps - RSS after
  loading): gradients, Adam state, FSDP's gathered units, activations, logits, optimizer temporaries;
- ``plan_estimate_bytes``: what ``rlrecipes plan`` predicts for the step on top of the loaded
  weights (gradients + optimizer + activations + transient, ``plan.train_memory``) for the same
  recipe, layout and dtype; ``plan_total_bytes`` adds the weights;
- ``load_s``, ``step_s``.

The ``dp4-lora`` row is the same model and layout with LoRA adapters (``actor.lora.rank``, 8 by
default, on the schema's default ``target_modules``): the base frozen in the engine's fp32 master
dtype, gradients and Adam state for the adapters only, and the plan of that recipe
(``actor.lora.rank=8``). It also prints ``lora_params`` (what PEFT created) and
``step_over_full_param_step`` (its step peak over the full-parameter row's of the same layout, when
that row ran in the same invocation). Its peak is the root unit's all-gather at the start of the
second step's forward: the tied embedding (136M parameters, frozen, fp32) twice over (FSDP2's
all-gather output and the unsharded parameter it is copied into) beside the previous step's
activation memory, which the allocator still holds; ``plan`` models exactly that.

Peak RSS is the kernel's high-water mark (``VmHWM``), reset before each phase by writing ``5`` to
``/proc/self/clear_refs``; the loader reads with positioned reads (no mmap), so page cache is not
counted. Linux only. The ranks run with a fixed glibc mmap threshold (``MALLOC_MMAP_THRESHOLD_``,
4 MiB): glibc's default raises the threshold as large blocks are freed, after which every freed
gathered weight (17 MB here) stays resident in the heap, and RSS would measure the allocator's
fragmentation (about +1 GB over a forward) rather than what the engine holds; an accelerator's
caching allocator has no such effect.

Usage: ``python benchmarks/engine_memory.py [--layouts dp4,tp2dp2,dp4-lora] [--tokens 128] [--lora-rank 8]``
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

# Qwen2.5-0.5B's published shape (tied embeddings)
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
LAYOUTS = {"dp4": (1, False), "tp2dp2": (2, False), "dp4-lora": (1, True)}  # name -> (TP over 4 ranks, LoRA)
WORLD = 4


def write_folder(folder: Path, seed: int = 0, shape: dict = QWEN25_05B) -> Path:
    """A random bf16 HF Qwen2 folder of ``shape``, written tensor by tensor (never the whole model in
    memory); an existing folder is reused."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlrecipes.engines.native.loader import HFFolderWriter

    if (folder / "config.json").is_file():
        return folder
    cfg = Qwen2Config(**shape, architectures=["Qwen2ForCausalLM"])
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    w = HFFolderWriter(folder, cfg, dtype=torch.bfloat16, max_shard_bytes=256 << 20)
    for name, p in meta.named_parameters():
        t = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02
        w.add(name, t)
    w.close()
    return folder


def _batch(vocab: int, tokens: int, rank: int):
    from rlrecipes.engines.base import SeqBatch

    g = torch.Generator().manual_seed(rank)
    n = 2
    half = tokens // (2 * n)
    return SeqBatch(prompts=[torch.randint(0, vocab, (half,), generator=g) for _ in range(n)],
                    responses=[torch.randint(0, vocab, (half,), generator=g) for _ in range(n)],
                    per_sample={"advantages": torch.randn(n, generator=g)})


def pg_loss(logp, _ent, mb):
    m = mb["response_mask"].to(logp.device)
    adv = mb["advantages"].to(logp.device)
    return -(torch.where(m.bool(), logp * adv, 0.0)).sum() / m.sum().clamp(min=1), {}


def _lora(rank: int):
    from rlrecipes.recipe.schema import LoraConfig

    return LoraConfig(rank=rank) if rank > 0 else None


def _rank(rank: int, port: int, folder: str, tp: int, tokens: int, out: str, lora_rank: int = 0) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RLRECIPES_DEVICE="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from rlrecipes import device as devmod
    from rlrecipes.engines.native.train import NativeTrainEngine

    cpu = torch.device("cpu")

    def reset() -> int:
        devmod.reset_peak_memory(cpu)
        return devmod.memory_stats(cpu).allocated_bytes

    before = reset()
    t0 = time.perf_counter()
    eng = NativeTrainEngine(folder, layout=(tp, 1), device="cpu", lr=1e-5, max_tokens_per_micro_batch=tokens,
                            lora=_lora(lora_rank))
    dist.barrier()
    load_s, load_extra = time.perf_counter() - t0, devmod.memory_stats(cpu).peak_bytes - before
    before = reset()
    t0 = time.perf_counter()
    for _ in range(2):
        metrics = eng.train_step(_batch(eng.dims.vocab_size, tokens, rank), pg_loss)
    dist.barrier()
    step_s, step_extra = (time.perf_counter() - t0) / 2, devmod.memory_stats(cpu).peak_bytes - before
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"load_extra": load_extra, "step_extra": step_extra, "load_s": load_s, "step_s": step_s,
         "grad_norm": metrics["actor/grad_norm"], "params": sum(p.numel() for p in eng.model.parameters()),
         "trainable": sum(p.numel() for p in eng.model.parameters() if p.requires_grad)}))
    dist.destroy_process_group()


def plan_estimate(folder: Path, tp: int, tokens: int, lora_rank: int = 0):
    """The planner's per-device training memory for this folder, layout, dtype (fp32 on CPU) and LoRA rank."""
    from rlrecipes.plan import build_plan
    from rlrecipes.recipe import load_recipe

    half = tokens // 4
    recipe = load_recipe("qwen25_7b", overrides=[
        f"model.path={folder}", "model.preset=null", "actor.engine=native", "rollout.engine=native",
        f"actor.layout.tp={tp}", "actor.layout.pp=1", "actor.layout.ep=1", "rollout.layout.tp=1",
        "resources.device=cpu", "resources.nodes=1", f"resources.devices_per_node={WORLD}",
        "resources.device_memory_gb=64", "resources.dies_per_card=1", "actor.recompute=false",
        "actor.offload_optimizer=false", f"data.max_prompt_length={half}", f"rollout.sampling.max_new_tokens={half}",
        f"trainer.max_tokens_per_micro_batch={tokens}", "trainer.global_batch=8", "trainer.mini_batch=8",
        f"actor.lora.rank={lora_rank}"])
    return build_plan(recipe).train_memory


def _total_params(folder: Path) -> int:
    from transformers import AutoConfig

    from rlrecipes.models import dims_from_hf_config

    return int(dims_from_hf_config(AutoConfig.from_pretrained(folder, local_files_only=True)).total_params())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="dp4,tp2dp2,dp4-lora")
    ap.add_argument("--tokens", type=int, default=128, help="prompt + response tokens per rank in the step")
    ap.add_argument("--lora-rank", type=int, default=8, help="adapter rank of the -lora rows")
    ap.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "rlrecipes-bench-qwen2-0.5b"))
    args = ap.parse_args()
    import torch.multiprocessing as mp

    folder = write_folder(Path(args.folder))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 << 20))  # read by the spawned ranks' glibc
    step_peaks: dict[int, int] = {}  # TP -> the full-parameter row's step peak
    for name in args.layouts.split(","):
        tp, lora = LAYOUTS[name]
        lora_rank = args.lora_rank if lora else 0
        with tempfile.TemporaryDirectory() as out, socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            mp.spawn(_rank, args=(port, str(folder), tp, args.tokens, out, lora_rank), nprocs=WORLD, join=True)
            ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
        mem = plan_estimate(folder, tp, args.tokens, lora_rank)
        n_params = _total_params(folder)
        full = n_params * 4
        load_extra = max(r["load_extra"] for r in ranks)
        step_extra = max(r["step_extra"] for r in ranks)
        est = mem.total - mem.weights
        extra = {}
        if lora:
            extra = {"lora_rank": lora_rank, "lora_params": ranks[0]["trainable"]}
            if tp in step_peaks:
                extra["step_over_full_param_step"] = round(step_extra / step_peaks[tp], 3)
        else:
            step_peaks[tp] = step_extra
        print(json.dumps({
            "layout": name, "world": WORLD, "tp": tp, "dp": WORLD // tp, "dtype": "fp32", "params": n_params,
            "full_model_bytes": int(full), "load_peak_extra_bytes": int(load_extra),
            "load_over_full": round(load_extra / full, 3), "step_peak_extra_bytes": int(step_extra),
            "plan_estimate_bytes": int(est), "step_over_plan": round(step_extra / est, 3),
            "plan_total_bytes": int(mem.total), "plan_breakdown_gib": mem.gib(),
            "load_s": round(max(r["load_s"] for r in ranks), 2), "step_s": round(max(r["step_s"] for r in ranks), 2),
            "tokens_per_rank": args.tokens, **extra}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
