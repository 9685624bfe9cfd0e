"""Native rollout engine vs ``transformers`` ``model.generate`` on the same model and batch.

Usage: ``python benchmarks/rollout_vs_generate.py [--family qwen2] [--batch 16] [--new 128]``; prints
one JSON line. ``benchmarks/e2e.py`` calls :func:`bench_vs_generate` too. Measurements only.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from rlrecipes import device as devmod
from rlrecipes.engines.native.rollout import NativeRolloutEngine
from rlrecipes.engines.native.train import resolve_device


def ensure_process_group(device_type: str | None = None) -> bool:
    """Initialise a 1-process group when none exists (benchmarks, notebooks). True if it did."""
    if dist.is_initialized():
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(devmod.comm_backend(device_type), rank=0, world_size=1)
    return True


def bench_vs_generate(model, *, batch: int = 16, prompt_len: int = 32, max_new_tokens: int = 128,
                      device: torch.device | str | None = None, dtype: str | torch.dtype = "auto",
                      cache: str = "static", seed: int = 0, repeats: int = 2, warmup: bool = True) -> dict:
    """Tokens/s of :class:`NativeRolloutEngine` vs ``transformers`` ``model.generate`` on the same model and batch.

    Method (fair by construction):

    * the same model object (``eng.model``: same weights, dtype, device, attention backend) and
      the same ``batch`` random prompts of ``prompt_len`` tokens, no padding;
    * the same sampling: temperature 1, no top-k / top-p, no EOS (HF: ``eos_token_id=None`` and
      ``min_new_tokens = max_new_tokens``), so both produce exactly ``batch * max_new_tokens``
      tokens; both use a KV cache (native: its ``cache`` kind; HF: ``generate``'s default);
    * the timed region is the whole call (prefill + decode + sampling + output assembly), with a
      device synchronize on both sides; tokens/s = ``batch * max_new_tokens / seconds``;
    * one warm-up call of each, then ``repeats`` rounds, each running native then HF back to back
      (interleaved, so a noisy shared host slows both alike); the best (minimum) time of each
      side is reported and ``speedup = t_hf / t_native``.

    Single process (tp=1); initialises a 1-process group if needed. For stable numbers on CPU run
    with one thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``) on a quiet machine.
    Returns ``{"native_tokens_per_s", "hf_generate_tokens_per_s", "speedup", ...}``.
    """
    created = ensure_process_group(None if device is None else resolve_device(device).type)
    try:
        eng = NativeRolloutEngine(model, layout=(1, 1), device=device, seed=seed, dtype=dtype, cache=cache)
        g = torch.Generator().manual_seed(seed)
        vocab = eng.config.vocab_size
        prompts = [torch.randint(1, vocab, (prompt_len,), generator=g) for _ in range(batch)]
        ids = torch.stack(prompts).to(eng.device)  # [B, P]
        am = torch.ones_like(ids)
        hf = eng.model
        n_tok = batch * max_new_tokens

        def run_native():
            return eng.sample(prompts, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)

        def run_hf():
            hf.generation_config.eos_token_id = None
            return hf.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0, top_k=0,
                               top_p=1.0, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                               pad_token_id=0, eos_token_id=None)

        def once(fn):
            devmod.synchronize(eng.device)
            t = time.perf_counter()
            fn()
            devmod.synchronize(eng.device)
            return time.perf_counter() - t

        if warmup:
            run_native()
            run_hf()
        t_native = t_hf = float("inf")
        for _ in range(repeats):  # interleaved, best of each: fair under a noisy shared host
            t_native = min(t_native, once(run_native))
            t_hf = min(t_hf, once(run_hf))
        return {"native_tokens_per_s": n_tok / t_native, "hf_generate_tokens_per_s": n_tok / t_hf,
                "speedup": t_hf / t_native, "batch": batch, "prompt_len": prompt_len,
                "max_new_tokens": max_new_tokens, "cache": cache, "device": str(eng.device),
                "dtype": str(eng.dtype).replace("torch.", ""), "family": eng.dims.family,
                "decode": eng.decode_path, "repeats": repeats}
    finally:
        if created:
            dist.destroy_process_group()


def main() -> None:
    from rlrecipes.models import SMOKE

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--family", default="qwen2", choices=sorted(SMOKE))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    a = ap.parse_args()
    print(json.dumps(bench_vs_generate(SMOKE[a.family], batch=a.batch, prompt_len=a.prompt_len,
                                       max_new_tokens=a.new)))


if __name__ == "__main__":
    main()
