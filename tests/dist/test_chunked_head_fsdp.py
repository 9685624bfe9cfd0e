"""The chunked head (``engines/native/head.py``) on 2 gloo ranks.

* FSDP2 (DP2, the engine's ``parallel.parallelize(fsdp=True)`` wrapping: decoder layers, an untied
  head and embedding as units of their own, the root): log-probs, entropy and every parameter's
  gradient equal the unsharded single-process model's plain logits path; the very first forward
  of the model goes through ``head_hidden_states`` (FSDP2's lazy init still finds the head unit);
  the chunked path issues exactly as many all-gathers and reduce-scatters as the plain path
  (the head is gathered once, not once per chunk); tied and untied heads; the units all reshard.
  Under bf16 mixed precision, with units resharded after forward or held, it equals the plain
  path on the same sharded model.
* TP2 with the vocab-parallel head (``vocab_parallel_head=True``, no FSDP): the per-chunk
  vocab-parallel log-probs and the gradients of every local shard equal the unsharded model.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks

pytestmark = pytest.mark.dist

WORLD = 2
ATOL = 1e-5


def _close(a, b, what, atol=ATOL, rtol=1e-5):
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    if not torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol):
        raise AssertionError(f"{what}: max abs diff {(a.float() - b.float()).abs().max().item():.3g}")


def _data(vocab: int, seed: int, B: int = 2, T: int = 11):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    w_lp = torch.randn(B, T - 1, generator=g)
    w_ent = torch.randn(B, T - 1, generator=g)
    return ids, w_lp, w_ent


def _ref_terms(model, ids, temperature):
    """Plain path: full logits, fp32 log-softmax: (logp, entropy) [B, T-1]."""
    z = model(input_ids=ids, use_cache=False).logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(z, -1)
    lp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


def _chunked_terms(model, ids, temperature, chunk=4, **tp):
    from rlrecipes.engines.native.head import chunked_logprobs, head_hidden_states

    with head_hidden_states(model) as head:
        hidden = model(input_ids=ids, use_cache=False).logits[:, :-1]  # [B, T-1, H]
    return chunked_logprobs(hidden, head, ids[:, 1:], temperature=temperature, with_entropy=True,
                            chunk_tokens=chunk, **tp)


def _loss(lp, ent, w_lp, w_ent):
    return (lp * w_lp).sum() + (ent * w_ent).sum()


class _CountCollectives:
    """Counts FSDP2's all-gathers and reduce-scatters (``dist.all_gather_single`` / ``reduce_scatter_single``)."""

    def __enter__(self):
        import torch.distributed as dist

        self.counts = {"all_gather": 0, "reduce_scatter": 0}
        self._saved = (dist.all_gather_single, dist.reduce_scatter_single)
        ag, rs = self._saved

        def count_ag(*a, **k):
            self.counts["all_gather"] += 1
            return ag(*a, **k)

        def count_rs(*a, **k):
            self.counts["reduce_scatter"] += 1
            return rs(*a, **k)

        dist.all_gather_single, dist.reduce_scatter_single = count_ag, count_rs
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_gather_single, dist.reduce_scatter_single = self._saved


def case_fsdp(rank):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlrecipes.core.mesh import build_mesh
    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.engines.native import parallel as par
    from rlrecipes.engines.native.head import unsupported
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import smoke_dims

    mesh = build_mesh(ParallelLayout(world=dist.get_world_size()), "cpu")
    assert mesh.dp == WORLD
    for fam, tied in (("qwen2", False), ("qwen2", True), ("qwen3_moe", False)):
        dims = smoke_dims(fam, tie_embeddings=tied)
        tag = f"{fam} tied={tied}"
        ref, _ = build_model(dims, seed=0)
        plain, _ = build_model(dims, seed=0)
        model, _ = build_model(dims, seed=0)
        par.parallelize(plain, mesh, fsdp=True)
        par.parallelize(model, mesh, fsdp=True)
        if unsupported(model) is not None:
            raise AssertionError(f"{tag}: {unsupported(model)}")
        for temperature in (1.0, 0.7):
            data = [_data(dims.vocab_size, seed=10 * s + int(temperature * 10)) for s in range(WORLD)]
            ids, w_lp, w_ent = data[rank]
            # inference first: the model's very first forward runs through the pass-through head
            with torch.no_grad():
                lp0, ent0 = _chunked_terms(model, ids, temperature)
                rlp, rent = _ref_terms(ref, ids, temperature)
            _close(lp0, rlp, f"{tag} T={temperature} no-grad logp")
            _close(ent0, rent, f"{tag} T={temperature} no-grad entropy")
            model.reshard()  # the root stays gathered after an inference forward
            # training: DP2 averages the two ranks' gradients
            ref.zero_grad()
            for ids_i, wl, we in data:
                lp, ent = _ref_terms(ref, ids_i, temperature)
                (_loss(lp, ent, wl, we) / WORLD).backward()
            with torch.no_grad():  # the same history of no-grad forwards as the chunked model
                _ref_terms(plain, ids, temperature)
            plain.reshard()
            counts = []
            for step in range(2):  # the first step after no-grad forwards, then a steady one
                with _CountCollectives() as plain_n:
                    plain.zero_grad()
                    _loss(*_ref_terms(plain, ids, temperature), w_lp, w_ent).backward()
                with _CountCollectives() as chunked_n:
                    model.zero_grad()
                    lp, ent = _chunked_terms(model, ids, temperature, chunk=3)
                    _loss(lp, ent, w_lp, w_ent).backward()
                counts.append((plain_n.counts, chunked_n.counts))
            # the head is gathered once per forward and once per backward, not once per chunk; after
            # no-grad forwards FSDP2's stale forward order costs an untied head one more prefetch
            (p0, c0), (p1, c1) = counts
            extra = 0 if tied else 1
            if c1 != p1 or c0["reduce_scatter"] != p0["reduce_scatter"] or \
                    not p0["all_gather"] <= c0["all_gather"] <= p0["all_gather"] + extra:
                raise AssertionError(f"{tag}: chunked head collectives {counts[0][1]}, {counts[1][1]} != plain "
                                     f"{counts[0][0]}, {counts[1][0]}")
            _close(lp, _ref_terms(ref, ids, temperature)[0], f"{tag} T={temperature} logp")
            want = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                if not isinstance(p, DTensor):
                    raise AssertionError(f"{tag}: {name} still gathered after backward")
                if p.grad is None:
                    raise AssertionError(f"{tag}: {name} has no gradient")
                _close(p.grad.full_tensor(), want[name].grad, f"{tag} T={temperature} grad {name}")


def case_fsdp_bf16_held(rank):
    """FSDP2 bf16 mixed precision (fp32 masters), units left gathered between forward and backward
    (the engine's small-model mode) or not: the chunked head equals the plain head on the same
    sharded model (bf16 logits either way; gradients to bf16 rounding)."""
    import torch.distributed as dist

    from rlrecipes.core.mesh import build_mesh
    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.engines.native import parallel as par
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import smoke_dims

    mesh = build_mesh(ParallelLayout(world=dist.get_world_size()), "cpu")
    for tied in (False, True):
        dims = smoke_dims("qwen2", tie_embeddings=tied)
        ids, w_lp, w_ent = _data(dims.vocab_size, seed=20 + rank)
        for hold in (False, True):
            tag = f"bf16 tied={tied} held={hold}"
            got = []
            for chunked in (False, True):
                model, _ = build_model(dims, seed=0)
                par.parallelize(model, mesh, fsdp=True, mp_dtype=torch.bfloat16)
                units = [m for m in model.modules() if m is not model and hasattr(m, "reshard")]
                for m in units:
                    m.set_reshard_after_forward(not hold, recurse=False)
                for _ in range(2):
                    model.zero_grad()
                    lp, ent = _chunked_terms(model, ids, 0.7) if chunked else _ref_terms(model, ids, 0.7)
                    _loss(lp, ent, w_lp, w_ent).backward()
                for m in units:
                    m.reshard()
                got.append((lp.detach(), ent.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
            (lp0, ent0, g0), (lp1, ent1, g1) = got
            _close(lp1, lp0, f"{tag} logp", atol=1e-4)
            _close(ent1, ent0, f"{tag} entropy", atol=1e-4)
            for n, g in g0.items():
                _close(g1[n], g, f"{tag} grad {n}", atol=2e-2 * float(g.abs().max()), rtol=0)


def case_tp(rank):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlrecipes.engines.native.head import unsupported

    from rlrecipes.core.mesh import build_mesh
    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.engines.native import parallel as par
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import smoke_dims

    mesh = build_mesh(ParallelLayout(tp=2, world=dist.get_world_size()), "cpu")
    assert mesh.tp == WORLD
    for fam, tied in (("qwen2", False), ("qwen2", True)):
        dims = smoke_dims(fam, tie_embeddings=tied)
        tag = f"{fam} tp2 tied={tied}"
        ref, _ = build_model(dims, seed=0)
        model, _ = build_model(dims, seed=0)
        par.parallelize(model, mesh, fsdp=False, vocab_parallel_head=True)
        why = (unsupported(model, vocab_parallel=True), unsupported(model))
        if why[0] is not None or why[1] is None:
            raise AssertionError(f"{tag}: unsupported() {why}")
        vocab_start = mesh.tp_rank * -(-dims.vocab_size // mesh.tp)
        tp = dict(vocab_start=vocab_start, group=mesh.tp_mesh.get_group())
        ids, w_lp, w_ent = _data(dims.vocab_size, seed=5)  # TP peers see the same batch
        for temperature in (1.0, 0.7):
            ref.zero_grad()
            model.zero_grad()
            rlp, rent = _ref_terms(ref, ids, temperature)
            _loss(rlp, rent, w_lp, w_ent).backward()
            lp, ent = _chunked_terms(model, ids, temperature, chunk=3, **tp)
            _close(lp, rlp, f"{tag} T={temperature} logp")
            _close(ent, rent, f"{tag} T={temperature} entropy")
            _loss(lp, ent, w_lp, w_ent).backward()
            want = dict(ref.named_parameters())
            for name, p in model.named_parameters():
                g = p.grad
                if g is None:
                    raise AssertionError(f"{tag}: {name} has no gradient")
                g = g.full_tensor() if isinstance(g, DTensor) else g
                if par.tp_partial_grad(name):  # pragma: no cover - qwen2 has none
                    dist.all_reduce(g)
                _close(g, want[name].grad, f"{tag} T={temperature} grad {name}")
        # a gathered (non-vocab-parallel) call of a TP head is refused, not silently wrong
        from rlrecipes.engines.native.head import chunked_logprobs, head_hidden_states

        with head_hidden_states(model) as head:
            hidden = model(input_ids=ids, use_cache=False).logits[:, :-1]
        try:
            chunked_logprobs(hidden, head, ids[:, 1:])
        except NotImplementedError:
            pass
        else:
            raise AssertionError(f"{tag}: a TP head without group= was accepted")


def _run(rank, tmp, case):
    if case == "fsdp":
        case_fsdp(rank)
        case_fsdp_bf16_held(rank)
    else:
        case_tp(rank)


def test_chunked_head_fsdp2_dp2_matches_single_process():
    run_ranks(_run, WORLD, "fsdp")


def test_chunked_head_tp2_vocab_parallel_matches_single_process():
    run_ranks(_run, WORLD, "tp")


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-x", "-q"])
