"""Ulysses sequence parallelism in the native train engine (``layout.sp``) on gloo: with SP = 2 and
SP = 4 the log-probs, entropy, loss and gradients equal a one-process SP = 1 run's, within 1e-5 in
fp32; padded and packed micro-batches, GQA with fewer KV heads than SP ranks, a dense, an MoE and a
vision-language model (its images and M-RoPE positions), replicated and FSDP2 gradients."""
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

    if family == "qwen2_5_vl":  # its own heads (M-RoPE's sections follow its head size)
        return SMOKE[family]
    # 4 query heads over 2 KV heads: SP 4 splits the query heads and repeats the KV heads
    return dataclasses.replace(SMOKE[family], num_heads=4, num_kv_heads=2, head_dim=16)


def _batch(family: str):
    from rlrecipes.engines.base import SeqBatch

    g = torch.Generator().manual_seed(0)
    plens, rlens = (5, 9, 3, 7), (6, 4, 11, 5)  # ragged: 11, 13, 14, 12 tokens
    prompts = [torch.randint(3, 30, (p,), generator=g) for p in plens]
    responses = [torch.randint(3, 30, (r,), generator=g) for r in rlens]
    images = None
    if family == "qwen2_5_vl":  # 56x56 shapes: 4 image tokens each; sample 1 has two images, sample 3 none
        import random

        from rlrecipes.data.images import COLORS, draw_shape
        from rlrecipes.models.vision import VisionSettings, cat_inputs

        d, vs, rng = _dims(family), VisionSettings(), random.Random(0)
        run = [d.vision_start_token_id] + [d.image_token_id] * 4 + [d.vision_end_token_id]
        images, marked = [], []
        for i, (p, k) in enumerate(zip(prompts, (1, 2, 1, 0))):
            images.append(cat_inputs([vs.process(draw_shape(rng, COLORS[(i + j) % len(COLORS)])) for j in range(k)]))
            marked.append(torch.cat([p[:2], torch.tensor(run * k, dtype=torch.long), p[2:]]))
        prompts = marked
    return SeqBatch(prompts, responses, per_sample={"advantages": torch.randn(len(plens), generator=g)},
                    images=images)


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


def _run(eng, family) -> dict:
    batch = _batch(family)
    logp, ent = eng.forward(batch, with_entropy=True)
    metrics = eng.train_step(batch, _loss, with_entropy=True)
    return {"logp": logp, "ent": ent, "loss": metrics["actor/loss"], "grad_norm": metrics["actor/grad_norm"],
            "grads": _grads(eng)}


# A budget of 28 tokens groups the samples alike at SP 1 (packed: 14 + 13, 12 + 11) and under SP (a
# sample per row, each row counted at its micro-batch's longest: 2 x 14, 2 x 12), so the per-micro-batch
# loss below, which is not invariant to the grouping, compares the same computation. The VL samples
# (25, 20, 17, 12 tokens) group alike at a budget of 50: 25 + 20, 17 + 12.
def _engine(family, sp, packed, fsdp, recompute=False):
    from rlrecipes.engines.native.train import NativeTrainEngine

    return NativeTrainEngine(_dims(family), role="actor", device="cpu", dtype="fp32", lr=1e-3, sp=sp,
                             fsdp=fsdp, max_tokens_per_micro_batch=(50 if family == "qwen2_5_vl" else 28)
                             if packed else None, micro_batch_size=2, recompute=recompute,
                             freeze_vision_tower=False)  # a VL model's tower trained: its gradients compared too


def _reference(family, packed, path):
    """SP = 1 in this process (a one-rank group)."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.save(_run(_engine(family, 1, packed, None), family), path)
    finally:
        dist.destroy_process_group()


def _compare(rank, tmp, family, sp, packed, fsdp, path, recompute=False):
    want = torch.load(path, weights_only=False)
    eng = _engine(family, sp, packed, fsdp, recompute)
    shards = eng.local_shards()  # the train layout: whole tensors at TP1, FSDP over DP x SP gathered
    assert all(shards[n].shape == p.shape for n, p in eng.model.named_parameters())
    got = _run(eng, family)
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
    # images scattered into the whole row, the decoder on each rank's columns (an image's tokens
    # straddle the two ranks' halves in some rows); padded, then packed rows with FSDP2 and recompute
    ("qwen2_5_vl", 2, False, None, False),
    ("qwen2_5_vl", 2, True, True, True),
])
def test_sp_matches_one_process(tmp_path, family, sp, packed, fsdp, recompute):
    path = str(tmp_path / "want.pt")
    _reference(family, packed, path)
    run_ranks(_compare, sp, family, sp, packed, fsdp, path, recompute)
