"""The native train engine's fixed cost against the same HF model called plainly, on the smoke shapes.

One JSON line per (layout, op): the engine's median seconds, the plain call's median seconds and
their ratio, for

- ``forward``: ``engine.forward(batch)`` (per-sample log-probs on the host) against a plain
  ``model(input_ids, attention_mask, position_ids)`` on the whole batch left-padded into one
  ``[B, T]`` block, then ``log_softmax`` + ``gather`` of the response tokens;
- ``train_step``: ``engine.train_step(batch, pg_loss)`` (forward + backward + clip + AdamW) against
  the same plain forward, a policy-gradient loss, ``loss.backward()``,
  ``torch.nn.utils.clip_grad_norm_`` and ``AdamW.step()``.

Layouts: ``dp1`` (one process, TP1) and ``tp2`` (two gloo processes, TP2, timed on rank 0). The TP2
"plain" reference is the *same DTensor TP model* (``parallel.parallelize``: the same TP plan, no
FSDP, the head gathered to full logits) called plainly on both ranks; the ratio is then the engine's
own wrapping (batching, packing, vocab-parallel head, grad norm, collectives it adds), not TP itself.

The batch is the smoke recipe's per-rank share: ``--samples`` (64) sequences of a 12-24 token prompt
and a 4-8 token response (``rollout.sampling.max_new_tokens: 8``), on the family's smoke dimensions
(``rlrecipes.models.SMOKE``), fp32 on CPU, micro-batched as the smoke recipe does (token budget
``--budget`` 2048, packed; ``--budget 0`` uses padded micro-batches of ``--micro-batch`` samples).
Engine and plain calls alternate, ``--repeats`` of each after ``--warmup``; ``*_cpu_s`` are the
medians of this (rank 0) process's CPU seconds, less sensitive than wall seconds to other processes'
load on a shared machine (under TP2 they leave out time spent waiting for the peer). Compare
medians of several runs.

Usage: ``python benchmarks/engine_overhead.py [--layouts dp1,tp2] [--family qwen2] [--repeats 30]``.
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


def make_batch(vocab: int, n: int, seed: int = 0):
    from rlrecipes.engines.base import SeqBatch

    g = torch.Generator().manual_seed(seed)
    lens = [(int(torch.randint(12, 25, (1,), generator=g)), int(torch.randint(4, 9, (1,), generator=g)))
            for _ in range(n)]
    return SeqBatch(prompts=[torch.randint(1, vocab, (p,), generator=g) for p, _ in lens],
                    responses=[torch.randint(1, vocab, (r,), generator=g) for _, r in lens],
                    per_sample={"advantages": torch.randn(n, generator=g)})


def pg_loss(logp, _ent, mb):
    m = mb["response_mask"].to(logp.device)
    return -(torch.where(m.bool(), logp * mb["advantages"].to(logp.device), 0.0)).sum() / m.sum().clamp(min=1), {}


class Plain:
    """The HF model called plainly: the whole batch as one left-padded block."""

    def __init__(self, model: torch.nn.Module, batch, lr: float, tp: bool = False):
        from rlrecipes.engines.native.batching import pad_sequences

        self.model, self.tp = model, tp
        mb = pad_sequences(batch.prompts, batch.responses, 0)
        self.ids, self.attn, self.rmask = mb["input_ids"], mb["attention_mask"], mb["response_mask"]
        self.pos = (self.attn.cumsum(-1) - 1).clamp(min=0)
        self.R = self.rmask.shape[1]
        self.adv = batch.per_sample["advantages"][:, None]
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def _logp(self) -> torch.Tensor:
        R = self.R
        logits = self.model(input_ids=self.ids, attention_mask=self.attn, position_ids=self.pos, use_cache=False,
                            logits_to_keep=R + 1).logits[:, :-1]  # [B, R, V]
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        return torch.log_softmax(logits.float(), -1).gather(-1, self.ids[:, -R:, None])[..., 0]  # [B, R]

    def forward(self):
        self.model.eval()
        with torch.no_grad():
            out = self._logp()
        self.model.train()
        return out

    def train_step(self):
        self.opt.zero_grad(set_to_none=True)
        logp = self._logp()
        loss = -(torch.where(self.rmask.bool(), logp * self.adv, 0.0)).sum() / self.rmask.sum()
        loss.backward()
        if self.tp:  # DTensor and plain (replicated norm) grads mixed: clip_grad_norm_ refuses them
            from rlrecipes.engines.native import grads as grad_ops

            params = list(self.model.parameters())
            norm = float(grad_ops.global_grad_norm(params, self.ids.device))
            if norm > 1.0:
                grad_ops.scale_grads_(params, 1.0 / (norm + 1e-6))
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())


def _time(fn, barrier) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    c1 = time.process_time()
    barrier()
    return time.perf_counter() - t0, c1 - c0


def measure(layout: str, tp: int, args) -> list[dict]:
    import torch.distributed as dist

    from rlrecipes.core.mesh import build_mesh
    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.engines.native import parallel as par
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.models import SMOKE

    dims = SMOKE[args.family]
    batch = make_batch(dims.vocab_size, args.samples)
    eng = NativeTrainEngine(dims, layout=(tp, 1), lr=1e-4, seed=0, micro_batch_size=args.micro_batch,
                            max_tokens_per_micro_batch=args.budget or None)
    model, _ = build_model(dims, seed=0)
    if tp > 1:
        model = par.parallelize(model, build_mesh(ParallelLayout(tp=tp, world=dist.get_world_size()), "cpu"), fsdp=False)
    plain = Plain(model, batch, lr=1e-4, tp=tp > 1)
    barrier = dist.barrier if dist.get_world_size() > 1 else (lambda: None)
    ops = {"forward": (lambda: eng.forward(batch), plain.forward),
           "train_step": (lambda: eng.train_step(batch, pg_loss), plain.train_step)}
    rows = []
    for op, (engine_fn, plain_fn) in ops.items():
        e, p, ec, pc = [], [], [], []
        for i in range(args.warmup + args.repeats):
            (te, tec), (tpl, tpc) = _time(engine_fn, barrier), _time(plain_fn, barrier)
            if i >= args.warmup:
                e.append(te)
                p.append(tpl)
                ec.append(tec)
                pc.append(tpc)
        me, mp_ = statistics.median(e), statistics.median(p)
        mec, mpc = statistics.median(ec), statistics.median(pc)
        rows.append({"layout": layout, "op": op, "engine_s": round(me, 6), "plain_s": round(mp_, 6),
                     "ratio": round(me / mp_, 3), "engine_min_s": round(min(e), 6), "plain_min_s": round(min(p), 6),
                     "engine_cpu_s": round(mec, 6), "plain_cpu_s": round(mpc, 6), "cpu_ratio": round(mec / mpc, 3),
                     "family": args.family, "samples": args.samples, "repeats": args.repeats,
                     "micro_batching": f"packed budget {args.budget}" if args.budget else f"padded {args.micro_batch}",
                     "engine_fsdp": eng.fsdp,
                     "plain": "same DTensor TP model, no engine wrapping" if tp > 1 else "plain HF model"})
    return rows


def _rank(rank: int, world: int, port: int, out: str, layout: str, tp: int, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RLRECIPES_DEVICE="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = measure(layout, tp, args)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="dp1,tp2")
    ap.add_argument("--family", default="qwen2")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048, help="max_tokens_per_micro_batch (0: padded)")
    ap.add_argument("--micro-batch", type=int, default=64, help="samples per padded micro-batch (--budget 0)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args(argv)
    os.environ.setdefault("RLRECIPES_DEVICE", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch.multiprocessing as mp

    for layout in args.layouts.split(","):
        tp = {"dp1": 1, "tp2": 2}[layout]
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "rows.json")
            mp.spawn(_rank, args=(tp, _port(), out, layout, tp, args), nprocs=tp, join=True)
            for row in json.loads(Path(out).read_text()):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
