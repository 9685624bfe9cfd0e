"""Ulysses sequence parallelism in the native train engine (``layout.sp``) on gloo: with SP = 2 and
SP = 4 the log-probs, entropy, loss and gradients equal a one-process SP = 1 run's, within 1e-5 in
fp32; padded and packed micro-batches, GQA with fewer KV heads than SP ranks, a dense and an MoE
model, replicated and FSDP2 gradients."""
from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch

from dist_harness import run_ranks

TOL = dict(atol=1e-5, rtol=1e-5)


def _dims(family: str):
    from rlrecipes.models import SMOKE

    # 4 query heads over 2 KV heads: SP 4 splits the query heads and repeats the KV heads
    return dataclasses.replace(SMOKE[family], num_heads=4, num_kv_heads=2, head_dim=16)


def _batch():
    from rlrecipes.engines.base import SeqBatch

    g = torch.Generator().manual_seed(0)
    plens, rlens = (5, 9, 3, 7), (6, 4, 11, 5)  # ragged: 11, 13, 14, 12 tokens
    return SeqBatch([torch.randint(3, 32, (p,), generator=g) for p in plens],
                    [torch.randint(3, 32, (r,), generator=g) for r in rlens],
                    per_sample={"advantages": torch.randn(len(plens), generator=g)})


def _loss(logp, ent, mb):
    m = mb["response_mask"].to(logp.device)
    adv = mb["advantages"].to(logp.device)  # [b, R]
    pg = -(torch.where(m.bool(), logp * adv, 0.0)).sum() / m.sum().clamp(min=1)
    return pg - 0.01 * (torch.where(m.bool(), ent, 0.0)).sum() / m.sum().clamp(min=1), {}


def _grads(eng) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in eng.model.named_parameters():
        g = p.grad
        if g is not None:
            out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _run(eng) -> dict:
    batch = _batch()
    logp, ent = eng.forward(batch, with_entropy=True)
    metrics = eng.train_step(batch, _loss, with_entropy=True)
    return {"logp": logp, "ent": ent, "loss": metrics["actor/loss"], "grad_norm": metrics["actor/grad_norm"],
            "grads": _grads(eng)}


# A budget of 28 tokens groups the samples alike at SP 1 (packed: 14 + 13, 12 + 11) and under SP (a
# sample per row, each row counted at its micro-batch's longest: 2 x 14, 2 x 12), so the per-micro-batch
# loss below, which is not invariant to the grouping, compares the same computation.
def _engine(family, sp, packed, fsdp, recompute=False):
    from rlrecipes.engines.native.train import NativeTrainEngine

    return NativeTrainEngine(_dims(family), role="actor", device="cpu", dtype="fp32", lr=1e-3, sp=sp,
                             fsdp=fsdp, max_tokens_per_micro_batch=28 if packed else None, micro_batch_size=2,
                             recompute=recompute)


def _reference(family, packed, path):
    """SP = 1 in this process (a one-rank group)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.save(_run(_engine(family, 1, packed, None)), path)
    finally:
        dist.destroy_process_group()


def _compare(rank, tmp, family, sp, packed, fsdp, path, recompute=False):
    want = torch.load(path, weights_only=False)
    eng = _engine(family, sp, packed, fsdp, recompute)
    shards = eng.local_shards()  # the train layout: whole tensors at TP1, FSDP over DP x SP gathered
    assert all(shards[n].shape == p.shape for n, p in eng.model.named_parameters())
    got = _run(eng)
    for key in ("logp", "ent"):
        for a, b in zip(got[key], want[key]):
            torch.testing.assert_close(a, b, **TOL)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert want["grads"].keys() == got["grads"].keys()
    for n, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, **TOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("family,sp,packed,fsdp,recompute", [
    ("qwen2", 2, False, None, False),   # replicated gradients (a small model), padded rows
    ("qwen2", 2, True, True, True),     # FSDP2 over the DP x SP ranks, packed rows, layers recomputed
    ("qwen2", 4, True, None, False),    # 4 ranks: KV heads (2) repeated to the query heads
    ("qwen3_moe", 2, True, None, True),
    ("qwen3_moe", 4, False, True, False),
])
def test_sp_matches_one_process(tmp_path, family, sp, packed, fsdp, recompute):
    path = str(tmp_path / "want.pt")
    _reference(family, packed, path)
    run_ranks(_compare, sp, family, sp, packed, fsdp, path, recompute)
