"""Native engines on 2 gloo ranks: TP2 / EP2-in-TP2 / DP2 equal the unsharded single-process model.

Each test spawns 2 processes once and runs several checks inside; a worker writes its failures
to a file so the parent reports them (the reference model is built unsharded inside each rank).
"""
from __future__ import annotations

import os

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.dist

WORLD = 2
# Adam's eps is raised so that fp32 reduction-order noise in near-zero grads is not amplified
# into lr-sized update differences (update = lr * g / (sqrt(v) + eps)).
EPS = 1e-4


def _batch(vocab: int, seed: int, B: int = 4, P: int = 6, R: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, P + R), generator=g)  # [B, T]
    am = torch.ones_like(ids)
    plen = torch.randint(2, P + 1, (B,), generator=g)
    rlen = torch.randint(1, R + 1, (B,), generator=g)
    for i in range(B):
        am[i, : P - plen[i]] = 0
        am[i, P + rlen[i]:] = 0
    ids = ids * am  # pads are token 0
    return {"input_ids": ids, "attention_mask": am, "response_mask": am[:, P:].clone()}


def _loss(logp, entropy, mb):
    m = mb["response_mask"].to(logp.dtype)
    return -(logp * m).sum() / m.sum(), {"tokens": float(m.sum())}


def _ref_logp(model, mb):
    ids, am = mb["input_ids"], mb["attention_mask"]
    T, R = ids.shape[1], mb["response_mask"].shape[1]
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
    logp = torch.log_softmax(logits[:, T - R - 1:T - 1].float(), -1)  # [B, R, V]
    return logp.gather(-1, ids[:, T - R:, None]).squeeze(-1)  # [B, R]


def _ref_step(dims, mbs, lr, clip, wd=0.01):
    """Single-process reference: plain HF model, mean loss over micro-batches, clip, AdamW."""
    from rlrecipes.engines.native.loader import build_model

    model, _ = build_model(dims, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, eps=EPS)
    for mb in mbs:
        (_loss(_ref_logp(model, mb), None, mb)[0] / len(mbs)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return model, float(norm)


def _close(a, b, what, atol=2e-5, rtol=1e-4):
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    if not torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol):
        raise AssertionError(f"{what}: max abs diff {(a.float() - b.float()).abs().max().item():.3g}")


# ------------------------------------------------------------------------------------- cases
def case_tp(rank):
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.engines.native.shards import convention_slice
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.models import SMOKE

    # (tp, ep, moe_grouped_mm): EP2's local experts as grouped GEMMs (the default) and as the loop over
    # experts, both equal to the unsharded model
    for fam, layouts in (("qwen2", [(2, 1, True)]), ("qwen3_moe", [(2, 1, True), (2, 2, True), (2, 2, False)]),
                         ("deepseek_v3", [(2, 2, True), (2, 2, False)])):
        dims = SMOKE[fam]
        ref, _ = build_model(dims, seed=0)
        full0 = {k: v.clone() for k, v in ref.state_dict().items()}
        mbs = [_batch(dims.vocab_size, 1), _batch(dims.vocab_size, 2)]
        with torch.no_grad():
            ref_lp = torch.cat([_ref_logp(ref, mb) for mb in mbs])
        ref_after, ref_norm = _ref_step(dims, mbs, lr=1e-2, clip=0.5)
        for tp, ep, grouped in layouts:
            tag = f"{fam} tp{tp} ep{ep}" + ("" if grouped else " (loop over experts)")
            eng = NativeTrainEngine(dims, layout=(tp, ep), device="cpu", lr=1e-2, weight_decay=0.01, grad_clip=0.5,
                                    seed=0, eps=EPS, moe_grouped_mm=grouped)
            ep_experts = [m for m in eng.model.modules() if type(m).__name__ == "EPExperts"]
            if ep > 1 and (not ep_experts or any(m.grouped_mm != grouped for m in ep_experts)):
                raise AssertionError(f"{tag}: EPExperts grouped_mm {[m.grouped_mm for m in ep_experts]}")
            shards = eng.local_shards()
            missing = set(full0) - set(shards)
            if missing:
                raise AssertionError(f"{tag}: local_shards misses {sorted(missing)[:3]}")
            for name, t in shards.items():
                want = convention_slice(full0[name], name, tp, eng.mesh.tp_rank, ep, eng.mesh.ep_rank)
                _close(t, want, f"{tag} local_shards[{name}]", atol=0, rtol=0)
            lp = torch.cat([eng.log_probs(mb)[0] for mb in mbs])
            mask = torch.cat([mb["response_mask"] for mb in mbs]).bool()
            _close(lp[mask], ref_lp[mask], f"{tag} log_probs")
            metrics = eng.train_micro_batches(mbs, _loss)
            if metrics["actor/skipped_step"]:
                raise AssertionError(f"{tag}: step skipped {metrics}")
            if abs(metrics["actor/grad_norm"] - ref_norm) > 1e-4 * max(1.0, ref_norm):
                raise AssertionError(f"{tag}: grad_norm {metrics['actor/grad_norm']} != reference {ref_norm}")
            after = eng.full_state_dict()
            for name, t in ref_after.state_dict().items():
                _close(after[name], t, f"{tag} updated {name}")


def case_dp(rank):
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.models import SMOKE

    # FSDP2, and the replication a small model gets by default (one gradient all-reduce a step)
    for fam, fsdp in (("qwen2", True), ("qwen3_moe", True), ("qwen2", None), ("qwen3_moe", None)):
        dims = SMOKE[fam]
        mbs = [_batch(dims.vocab_size, 3), _batch(dims.vocab_size, 4)]
        ref_after, ref_norm = _ref_step(dims, mbs, lr=1e-2, clip=0.5)
        eng = NativeTrainEngine(dims, layout=(1, 1), device="cpu", lr=1e-2, weight_decay=0.01, grad_clip=0.5, seed=0,
                                eps=EPS, fsdp=fsdp)
        if eng.fsdp != bool(fsdp) or eng._replicated == bool(fsdp) or eng.mesh.dp != 2:
            raise AssertionError(f"fsdp={fsdp}: engine fsdp={eng.fsdp} replicated={eng._replicated}")
        fam = f"{fam} {'fsdp' if fsdp else 'replicated'}"
        metrics = eng.train_micro_batches([mbs[rank]], _loss)  # each DP rank its own micro-batch
        if abs(metrics["actor/grad_norm"] - ref_norm) > 1e-4 * max(1.0, ref_norm):
            raise AssertionError(f"{fam} dp2: grad_norm {metrics['actor/grad_norm']} != reference {ref_norm}")
        after = eng.full_state_dict()
        for name, t in ref_after.state_dict().items():
            _close(after[name], t, f"{fam} dp2 updated {name}")
        shards = eng.local_shards()  # DP dim gathered: full tensors at tp=1
        for name, t in ref_after.state_dict().items():
            _close(shards[name], t, f"{fam} dp2 local_shards {name}")
        # NaN loss: the update is skipped on every rank (only rank 1 sees it)
        before = eng.full_state_dict()

        def nan_loss(lp, ent, mb):
            loss, m = _loss(lp, ent, mb)
            return (loss * float("nan") if rank == 1 else loss), m

        metrics = eng.train_micro_batches([mbs[rank]], nan_loss)
        if metrics["actor/skipped_step"] != 1.0:
            raise AssertionError(f"{fam} dp2: NaN loss not reported as skipped: {metrics}")
        for name, t in eng.full_state_dict().items():
            _close(t, before[name], f"{fam} dp2 skipped step changed {name}", atol=0, rtol=0)

    # A small model under FSDP stays gathered for a whole call (small_model_bytes) ==
    # gathered around each use (0): two micro-batches per rank, the same step bit for bit, and
    # every parameter is sharded again after the call.
    from torch.distributed.tensor import DTensor

    dims = SMOKE["qwen2"]
    mine = [_batch(dims.vocab_size, 10 + 2 * rank), _batch(dims.vocab_size, 11 + 2 * rank)]
    got = []
    # and explicit prefetch (fsdp_prefetch=2: each layer gathers the next two ahead): the same step;
    # and the decoder layers compiled after FSDP2 wrapping (compile_layers, with prefetch and
    # recompute; the aot_eager backend, tests/unit/test_compile_layers.py says why): the same step
    from rlrecipes.engines.native.parallel import _decoder_layers

    for hold, prefetch, comp in ((1 << 30, 0, False), (0, 0, False), (0, 2, False), (0, 2, "aot_eager")):
        eng = NativeTrainEngine(dims, layout=(1, 1), device="cpu", lr=1e-2, seed=0, eps=EPS, fsdp=True,
                                small_model_bytes=hold, fsdp_prefetch=prefetch, compile_layers=comp,
                                recompute=bool(comp))
        if bool(eng._fsdp_units) != bool(hold):
            raise AssertionError(f"small_model_bytes={hold}: held units {len(eng._fsdp_units)}")
        ahead = [len(m._get_fsdp_state()._states_to_forward_prefetch) for m in _decoder_layers(eng.model)]
        n = len(ahead)
        if ahead != [min(prefetch, n - 1 - i) for i in range(n)]:
            raise AssertionError(f"fsdp_prefetch={prefetch}: forward prefetch per layer {ahead}")
        m = eng.train_micro_batches(mine, _loss)
        unsharded = [n for n, p in eng.model.named_parameters() if not isinstance(p, DTensor)]
        if unsharded:
            raise AssertionError(f"small_model_bytes={hold}: still gathered after the step: {unsharded[:4]}")
        got.append((m["actor/grad_norm"], eng.full_state_dict()))
    for base, other, what in ((got[0], got[1], "held vs per-use FSDP"),
                              (got[1], got[2], "per-use vs prefetching FSDP")):
        if base[0] != other[0]:
            raise AssertionError(f"{what}: grad_norm {base[0]} != {other[0]}")
        for name, t in other[1].items():
            _close(base[1][name], t, f"{what} {name}", atol=0, rtol=0)
    if abs(got[3][0] - got[2][0]) > 1e-5 * max(1.0, got[2][0]):
        raise AssertionError(f"compiled layers under FSDP2 dp2: grad_norm {got[3][0]} != eager {got[2][0]}")
    for name, t in got[3][1].items():
        _close(t, got[2][1][name], f"compiled vs eager layers under FSDP2 dp2: {name}", atol=1e-6, rtol=1e-5)


def case_rollout_ckpt(rank, tmp):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.engines.native.shards import convention_slice
    from rlrecipes.engines.native.rollout import NativeRolloutEngine, left_pad
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.models import SMOKE

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 32, (n,), generator=g) for n in (3, 6, 4)]
    for fam, layout in (("qwen2", (2, 1)), ("qwen3_moe", (2, 2)), ("deepseek_v3", (2, 2))):
        dims = SMOKE[fam]
        ref, _ = build_model(dims, seed=0)
        ids, am = left_pad(prompts, 0)
        want = ref.generate(input_ids=ids, attention_mask=am, do_sample=False, max_new_tokens=8, min_new_tokens=8,
                            pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
        # weights come in through load_shards (engine built with other weights: seed 1)
        eng = NativeRolloutEngine(dims, layout=layout, device="cpu", seed=0)
        if fam != "qwen2":
            eng2 = NativeRolloutEngine(dims, layout=layout, device="cpu", seed=1)
            full = ref.state_dict()
            n = eng2.load_shards((k, convention_slice(v, k, layout[0], eng2.mesh.tp_rank, layout[1], eng2.mesh.ep_rank))
                                 for k, v in full.items())
            assert n == len(full)
            eng = eng2
        if eng.decode_path != "fast" or eng.prefill_path != "fast":
            raise AssertionError(f"{fam}: rollout decode/prefill paths {eng.decode_path!r}/{eng.prefill_path!r}, "
                                 f"expected the fast paths")
        out = eng.sample(prompts, max_new_tokens=8, temperature=0)
        for i in range(len(prompts)):
            if not torch.equal(out.responses[i], want[i]):
                raise AssertionError(f"{fam} rollout tp{layout} greedy {out.responses[i].tolist()} != "
                                     f"HF tp1 {want[i].tolist()}")
        # sampled tokens are identical on both TP ranks
        s = eng.sample(prompts, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
        flat = torch.cat(s.responses)
        other = [torch.zeros_like(flat) for _ in range(2)]
        dist.all_gather(other, flat)
        if not torch.equal(other[0], other[1]):
            raise AssertionError(f"{fam}: TP ranks sampled different tokens")
        # the fast prefill (TP DTensor modules, K/V straight into the buffers) == HF forward prefill
        hfp = NativeRolloutEngine(dims, layout=layout, device="cpu", seed=0, prefill="hf")
        hfp.load_shards(eng.local_shards().items())
        s2 = hfp.sample(prompts, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
        for a, b in zip(s.responses, s2.responses):
            if not torch.equal(a, b):
                raise AssertionError(f"{fam}: fast prefill {a.tolist()} != HF prefill {b.tolist()} under TP")
        for a, b in zip(s.log_probs, s2.log_probs):
            _close(a, b, f"{fam}: fast vs HF prefill log-probs under TP", atol=1e-5, rtol=1e-5)
        # the static decode step (batch padded to its bucket: 3 -> 4 rows, through the TP/EP collectives)
        # == the per-call-shaped step
        static = NativeRolloutEngine(dims, layout=layout, device="cpu", seed=0, decode_graphs="eager")
        static.load_shards(eng.local_shards().items())
        off = NativeRolloutEngine(dims, layout=layout, device="cpu", seed=0, decode_graphs="off")
        off.load_shards(eng.local_shards().items())
        if static.decode_graphs != "static" or off.decode_graphs != "off":
            raise AssertionError(f"{fam}: decode_graphs {static.decode_graphs!r} / {off.decode_graphs!r} under TP")
        for kw in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}):
            s3, s4 = static.sample(prompts, max_new_tokens=8, **kw), off.sample(prompts, max_new_tokens=8, **kw)
            for a, b in zip(s3.responses, s4.responses):
                if not torch.equal(a, b):
                    raise AssertionError(f"{fam} {kw}: static step {a.tolist()} != shaped step {b.tolist()} under TP")
            for a, b in zip(s3.log_probs, s4.log_probs):
                _close(a, b, f"{fam}: static vs shaped step log-probs under TP", atol=1e-5, rtol=1e-5)

    # checkpoint (DCP) + export under TP2 EP2
    dims = SMOKE["qwen3_moe"]
    eng = NativeTrainEngine(dims, layout=(2, 2), device="cpu", lr=1e-2, seed=0)
    eng.train_micro_batches([_batch(dims.vocab_size, 5)], _loss)
    ckpt = os.path.join(tmp, "ckpt")
    eng.save(ckpt)
    trained = eng.full_state_dict()
    eng.train_micro_batches([_batch(dims.vocab_size, 6)], _loss)  # moves away from the checkpoint
    eng.load(ckpt)
    for k, v in eng.full_state_dict().items():
        _close(v, trained[k], f"DCP reload {k}", atol=0, rtol=0)
    if eng.step != 1:
        raise AssertionError(f"DCP reload: step {eng.step} != 1")
    fresh = NativeTrainEngine(dims, layout=(2, 2), device="cpu", lr=1e-2, seed=9)
    fresh.load(ckpt)
    m1 = eng.train_micro_batches([_batch(dims.vocab_size, 6)], _loss)
    m2 = fresh.train_micro_batches([_batch(dims.vocab_size, 6)], _loss)  # same optimizer state -> same step
    b = fresh.full_state_dict()
    for k, v in eng.full_state_dict().items():
        _close(v, b[k], f"fresh engine after DCP load + step {k}")
    assert abs(m1["actor/grad_norm"] - m2["actor/grad_norm"]) < 1e-5
    folder = os.path.join(tmp, "export")
    eng.export_hf(folder)
    if rank == 0:
        hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        mb = _batch(dims.vocab_size, 8)
        with torch.no_grad():
            _close(_ref_logp(hf, mb)[mb["response_mask"].bool()], eng.log_probs(mb)[0][mb["response_mask"].bool()],
                   "exported model log-probs")
        gen = hf.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                            pad_token_id=0)
        assert gen.shape == (1, 7)
    else:
        eng.log_probs(_batch(dims.vocab_size, 8))  # the TP peer of rank 0's forward


def case_shards(rank):
    """local_shards gathers plain dim-0 FSDP shards in one collective per dtype (uneven chunks at DP3)
    and the rest one by one: both give exactly what each tensor's own redistribute gives."""
    from rlrecipes.engines.native import shards as shard_ops
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.models import SMOKE

    for fam in ("qwen2", "qwen3_moe"):  # DP3 (TP+FSDP layouts: case_tp)
        eng = NativeTrainEngine(SMOKE[fam], layout=(1, 1), device="cpu", lr=1e-3, seed=1, fsdp=True)
        got = shard_ops.local_shards(eng.model)
        want = {n: shard_ops.train_layout_shard(t) for n, t in shard_ops.named_tensors(eng.model)}
        assert list(got) == list(want)
        for n in want:
            assert torch.equal(got[n], want[n]), (fam, n)


# ------------------------------------------------------------------------------------- harness
def _run(rank, tmp, case):
    cases = {"tp": case_tp, "dp": case_dp, "shards": case_shards}
    cases[case](rank) if case != "rollout_ckpt" else case_rollout_ckpt(rank, tmp)


def _spawn(case):
    run_ranks(_run, WORLD, case)


def test_train_tp2_and_ep2_match_single_process():
    """TP2 (+EP2 in TP2) log-probs, local_shards and one train step equal the unsharded model."""
    _spawn("tp")


def test_train_dp2_fsdp_matches_single_process_and_skips_nan():
    _spawn("dp")


def test_rollout_tp2_greedy_load_shards_checkpoint_export():
    _spawn("rollout_ckpt")


def test_local_shards_batched_fsdp_gather_is_exact():
    run_ranks(_run, 3, "shards")


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-x", "-q"])
