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
