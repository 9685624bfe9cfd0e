"""Packed, token-budgeted micro-batches (dynamic batching) give the padded path's log-probs and,
with the real GRPO loss closure and global normalisers, the same gradients for every loss
aggregation mode: loss normalisation is split-invariant."""
import pytest
import torch

from rlrecipes.algos import LOSS_AGG_MODES
from rlrecipes.algos.spec import actor_loss_fn
from rlrecipes.engines.base import SeqBatch
from rlrecipes.engines.native.batching import micro_batches, packed_micro_batches, token_bins
from rlrecipes.recipe.schema import AlgorithmConfig


def test_token_bins_respect_the_budget_and_cover_every_sample_once():
    lengths = [7, 3, 12, 5, 5, 1, 9, 2]
    bins = token_bins(lengths, 12)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 12 for b in bins)
    assert len(bins) == 4  # first-fit decreasing: 12 | 9+3 | 7+5 | 5+2+1 (44 tokens, ceil(44/12) = 4)
    assert token_bins([20, 3], 8) == [[0], [1]]  # longer than the budget: a micro-batch of its own


def _batch(vocab, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.randint(2, 7, (n,), generator=g).tolist()
    R = torch.randint(1, 6, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (p,), generator=g) for p in P]
    responses = [torch.randint(1, vocab, (r,), generator=g) for r in R]
    return SeqBatch(prompts=prompts, responses=responses,
                    per_sample={"advantages": torch.randn(n, generator=g)},
                    per_token={"old_log_probs": [torch.randn(r, generator=g) * 0.1 - 3.0 for r in R],
                               "ref_log_probs": [torch.randn(r, generator=g) * 0.1 - 3.0 for r in R]})


@pytest.fixture(scope="module")
def engine(one_rank_group):
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.models import smoke_dims

    return NativeTrainEngine(smoke_dims("qwen2"), layout=(1, 1), seed=0, micro_batch_size=3)


def test_packed_forward_equals_padded(engine):
    batch = _batch(engine.dims.vocab_size)
    engine.max_tokens_per_micro_batch = 0
    padded, _ = engine.forward(batch)
    engine.max_tokens_per_micro_batch = 16
    packed, _ = engine.forward(batch)
    engine.max_tokens_per_micro_batch = 0
    mbs = packed_micro_batches(batch, 16, 0)
    assert len(mbs) > 1 and any(mb["input_ids"].shape[0] > 1 for mb in mbs)  # several micro-batches and rows
    for a, b in zip(padded, packed):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _grads(engine, mbs, loss_fn):
    engine.model.zero_grad(set_to_none=True)
    for mb in mbs:
        logp, ent = engine._forward(mb, 1.0, True)
        loss_fn(logp, ent, mb)[0].backward()
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_gradients_equal_padded(engine, mode):
    batch = _batch(engine.dims.vocab_size, seed=1)
    cfg = AlgorithmConfig(name="grpo", loss_agg_mode=mode, entropy_coef=0.01, kl_coef=0.1, use_kl_loss=True)
    tokens = sum(int(x.numel()) for x in batch.responses)
    agg = dict(global_tokens=tokens, global_seqs=len(batch), norm_len=5, dp_size=1)
    loss_fn = actor_loss_fn(cfg, agg=agg, kl_coef=0.1, use_ref=True, dp_size=1)
    padded = _grads(engine, micro_batches(batch, 3, 0), loss_fn)
    packed = _grads(engine, packed_micro_batches(batch, 13, 0), loss_fn)
    one_row = _grads(engine, packed_micro_batches(batch, 13, 0, varlen=True), loss_fn)  # [1, N] rows
    whole = _grads(engine, packed_micro_batches(batch, 10_000, 0), loss_fn)
    assert padded.keys() == packed.keys() == one_row.keys() == whole.keys()
    for k in padded:
        for got in (packed, one_row, whole):
            torch.testing.assert_close(got[k], padded[k], atol=1e-6, rtol=1e-4)


# ---- the batched micro-batch builders equal the obvious per-sample loops (bit for bit)
def _loop_pad_sequences(prompts, responses, pad_id):
    P, R = max(p.numel() for p in prompts), max(max(x.numel() for x in responses), 1)
    ids = torch.full((len(prompts), P + R), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), P + R), dtype=torch.long)
    rmask = torch.zeros((len(prompts), R))
    for i, (p, x) in enumerate(zip(prompts, responses)):
        ids[i, P - p.numel():P], ids[i, P:P + x.numel()] = p, x
        attn[i, P - p.numel():P + x.numel()] = 1
        rmask[i, :x.numel()] = 1
    return {"input_ids": ids, "attention_mask": attn, "response_mask": rmask}


def _loop_packed(batch, pad_id, row_tokens):
    lengths = [p.numel() + x.numel() for p, x in zip(batch.prompts, batch.responses)]
    rows_of = token_bins(lengths, row_tokens) if row_tokens else [list(range(len(batch)))]
    L = max(sum(lengths[i] for i in r) for r in rows_of)
    ids = torch.full((len(rows_of), L), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows_of), L), dtype=torch.long)
    routed = torch.full((len(rows_of), L, *batch.routed_experts[0].shape[1:]), -1, dtype=torch.int32)
    kr, kc, tg, ur, uc = [], [], [], [], []
    for r, members in enumerate(rows_of):
        off = 0
        for i in members:
            p, x = batch.prompts[i], batch.responses[i]
            P, R = p.numel(), x.numel()
            ids[r, off:off + P], ids[r, off + P:off + P + R] = p, x
            pos[r, off:off + P + R] = torch.arange(P + R)
            rec = batch.routed_experts[i][:P + R]
            routed[r, off:off + rec.shape[0]] = rec
            kr.append(torch.full((R,), r, dtype=torch.long))
            kc.append(torch.arange(off + P - 1, off + P + R - 1))
            tg.append(x.long())
            ur.append(torch.full((R,), i, dtype=torch.long))
            uc.append(torch.arange(R))
            off += P + R
        pos[r, off:] = torch.arange(L - off)
    cols = torch.cat(kc)
    union = torch.unique(cols)
    return {"input_ids": ids, "position_ids": pos, "logit_index": union, "keep_rows": torch.cat(kr),
            "keep_cols": torch.searchsorted(union, cols), "targets": torch.cat(tg), "unpack_rows": torch.cat(ur),
            "unpack_cols": torch.cat(uc), "routed_experts": routed}


def _uneven_batch(seed):
    """Prompts of 1-12 tokens, responses of 0-6 (empty ones included), float64 and float32 columns,
    routing records one token short of some samples."""
    g = torch.Generator().manual_seed(seed)
    P = torch.randint(1, 13, (9,), generator=g).tolist()
    R = torch.randint(0, 7, (9,), generator=g).tolist()
    R[0] = 6
    return SeqBatch(prompts=[torch.randint(1, 32, (p,), generator=g) for p in P],
                    responses=[torch.randint(1, 32, (r,), generator=g) for r in R],
                    per_sample={"advantages": torch.randn(9, generator=g)},
                    per_token={"old": [torch.randn(r, generator=g, dtype=torch.float64) for r in R],
                               "ref": [torch.randn(r, generator=g) for r in R]},
                    routed_experts=[torch.randint(0, 8, (p + r - (i % 2), 2, 2), generator=g, dtype=torch.int32)
                                    for i, (p, r) in enumerate(zip(P, R))])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_builders_equal_per_sample_loops(seed):
    from rlrecipes.engines.native.batching import packed_micro_batch, pad_rows, pad_sequences

    batch = _uneven_batch(seed)
    for key, val in _loop_pad_sequences(batch.prompts, batch.responses, 7).items():
        got = pad_sequences(batch.prompts, batch.responses, 7)[key]
        assert got.dtype == val.dtype and torch.equal(got, val), key
    want = torch.full((9, 8), -1.0)
    for i, t in enumerate(batch.per_token["old"]):
        want[i, :t.numel()] = t.float()
    assert torch.equal(pad_rows(batch.per_token["old"], 8, -1.0), want)
    with pytest.raises(ValueError, match="does not fit"):
        pad_rows(batch.per_token["old"], 3)
    for row_tokens in (None, 12, 18, 40):
        mb = packed_micro_batch(batch, 7, row_tokens)
        for key, val in _loop_packed(batch, 7, row_tokens).items():
            assert mb[key].dtype == val.dtype and torch.equal(mb[key], val), (row_tokens, key)
        assert torch.equal(mb["old"], pad_rows(batch.per_token["old"], 6))
