"""Train-step memory at long length with Ulysses sequence parallelism (``layout.sp``), measured against
the planner: one JSON line per SP size.

Writes a random Qwen2-shaped HF folder (fp32 master weights in the engine; bf16 on disk; no
download), then for each SP size runs ``sp`` gloo ranks (one DP group: DP 1, FSDP2 over the SP
ranks) that load it with the native engine and take two train steps on one sample of
``--tokens`` tokens (a 1/16 prompt, the rest response). Per SP it prints:

- ``peak_bytes``: the largest rank's peak RSS over the two steps minus its RSS after loading
  (``engine_memory.py`` explains the measurement): the step's activations, logits, gradients, Adam
  state, FSDP's gathered units and temporaries, on that rank;
- ``plan_bytes``: what ``rlrecipes plan`` predicts for the same step on one device (gradients +
  optimizer + activations + transient of ``plan.train_memory``) for that recipe and ``actor.layout.sp``;
- ``peak_over_sp1``: ``peak_bytes`` over the SP = 1 row's, when it ran in the same invocation;
- ``step_s``, ``loss`` (the same at every SP: a check that the runs compute the same step).

``--short K`` adds ``K`` samples of ``tokens / K`` tokens beside the long one, with a micro-batch budget
of ``2 x tokens``: rows that would pack several samples, the case where a ``[rows, 1, T, T]`` attention
mask (and SDPA's bias made of it) appears without SP, and where the engine under SP gives each sample a
row of its own instead.

Usage: ``python benchmarks/long_context.py [--sp 1,2,4] [--tokens 8192] [--short 4]``
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

from engine_memory import pg_loss, write_folder

# A small Qwen2 whose step memory at 8K tokens is mostly per token (activations), as a real model's is at
# 32K. What does not shrink with SP is per rank: the head's one chunk of logits ([1024, vocab] and its
# softmax), the gathered FSDP units (the embedding and head above all) and the replicated log-probs. A
# large vocabulary on a small model makes those a large share: with vocab 32768 and 4 layers the peaks
# were 0.63x (SP2) and 0.46x (SP4) of SP1's, with vocab 8192 and 8 layers 0.57x and 0.35x; about 0.45 GB
# per rank did not shrink with SP.
SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=False, rope_theta=1000000.0,
             rms_norm_eps=1e-6)


def _lengths(tokens: int, short: int) -> list[int]:
    return [tokens] + [tokens // short] * short if short else [tokens]


def _batch(vocab: int, tokens: int, short: int = 0):
    from rlrecipes.engines.base import SeqBatch

    g = torch.Generator().manual_seed(0)  # every SP rank holds the same samples
    lengths = _lengths(tokens, short)
    prompts = [max(1, n // 16) for n in lengths]
    return SeqBatch(prompts=[torch.randint(0, vocab, (p,), generator=g) for p in prompts],
                    responses=[torch.randint(0, vocab, (n - p,), generator=g) for n, p in zip(lengths, prompts)],
                    per_sample={"advantages": torch.ones(len(lengths))})


def _rank(rank: int, world: int, port: int, folder: str, tokens: int, out: str, short: int = 0) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, 2 // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RLRECIPES_DEVICE="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from rlrecipes import device as devmod
    from rlrecipes.engines.native.train import NativeTrainEngine

    cpu = torch.device("cpu")
    budget = 2 * tokens if short else tokens
    eng = NativeTrainEngine(folder, device="cpu", lr=1e-5, sp=world, fsdp=True, max_tokens_per_micro_batch=budget)
    dist.barrier()
    devmod.reset_peak_memory(cpu)
    before = devmod.memory_stats(cpu).allocated_bytes
    t0 = time.perf_counter()
    for _ in range(2):
        metrics = eng.train_step(_batch(eng.dims.vocab_size, tokens, short), pg_loss)
    dist.barrier()
    step_s, peak = (time.perf_counter() - t0) / 2, devmod.memory_stats(cpu).peak_bytes - before
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": peak, "step_s": step_s,
                                                          "loss": metrics["actor/loss"]}))
    dist.destroy_process_group()


def plan_bytes(folder: Path, sp: int, tokens: int, short: int = 0) -> float:
    """The planner's per-device step memory above the weights for this folder, SP size and length."""
    from rlrecipes.plan import build_plan
    from rlrecipes.recipe import load_recipe

    prompt = tokens // 16
    budget = 2 * tokens if short else tokens
    recipe = load_recipe("qwen25_7b", overrides=[
        f"model.path={folder}", "model.preset=null", "actor.engine=native", "rollout.engine=native",
        "actor.layout.tp=1", "actor.layout.pp=1", "actor.layout.ep=1", f"actor.layout.sp={sp}",
        "rollout.layout.tp=1", "resources.device=cpu", "resources.nodes=1", f"resources.devices_per_node={sp}",
        "resources.device_memory_gb=64", "resources.dies_per_card=1", "actor.recompute=false",
        "actor.offload_optimizer=false", f"data.max_prompt_length={prompt}",
        f"rollout.sampling.max_new_tokens={tokens - prompt}", f"trainer.max_tokens_per_micro_batch={budget}",
        f"trainer.global_batch={1 + short}", f"trainer.mini_batch={1 + short}", "trainer.n_samples_per_prompt=1"])
    mem = build_plan(recipe).train_memory
    return mem.total - mem.weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sp", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt + response tokens of the one sample")
    ap.add_argument("--short", type=int, default=0, help="this many samples of tokens / short beside it")
    ap.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "rlrecipes-bench-qwen2-long"))
    args = ap.parse_args()
    import torch.multiprocessing as mp

    folder = write_folder(Path(args.folder), shape=SHAPE)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 << 20))  # see engine_memory.py
    sp1 = None
    for sp in (int(x) for x in args.sp.split(",")):
        with tempfile.TemporaryDirectory() as out, socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            mp.spawn(_rank, args=(sp, port, str(folder), args.tokens, out, args.short), nprocs=sp, join=True)
            ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(sp)]
        peak = max(r["peak"] for r in ranks)
        sp1 = peak if sp == 1 else sp1
        row = {"sp": sp, "tokens": args.tokens, "short": args.short, "peak_bytes": int(peak),
               "plan_bytes": int(plan_bytes(folder, sp, args.tokens, args.short)),
               "step_s": round(max(r["step_s"] for r in ranks), 2), "loss": ranks[0]["loss"]}
        row["peak_over_plan"] = round(row["peak_bytes"] / row["plan_bytes"], 3)
        if sp1 and sp != 1:
            row["peak_over_sp1"] = round(peak / sp1, 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
