"""The chunked head (``engines/native/head.py``): log-probs, entropy and gradients straight from hidden
states equal the plain ``[tokens, vocab]`` logits path (fp32, 1e-5), on the smoke models."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from rlrecipes.engines.native.head import chunked_logprobs, head_hidden_states, unsupported
from rlrecipes.engines.native.loader import build_model
from rlrecipes.models import smoke_dims

ATOL = 1e-5
MODELS = [("qwen2", False), ("qwen2", True), ("qwen3_moe", False), ("deepseek_v3", False)]


def _close(a, b, what, atol=ATOL):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert diff <= atol, f"{what}: max abs diff {diff:.3g}"


def _plain(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The reference: full fp32 log-softmax of the whole logits."""
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    return logp_all.gather(-1, targets[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _data(vocab: int, seed: int = 0, B: int = 3, T: int = 13):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    return ids, torch.randn(B, T - 1, generator=g), torch.randn(B, T - 1, generator=g)


@pytest.fixture(scope="module")
def models():
    return {(fam, tied): build_model(smoke_dims(fam, tie_embeddings=tied), seed=0)[0] for fam, tied in MODELS}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("fam,tied", MODELS)
def test_model_logprobs_entropy_and_all_gradients_match_plain_head(models, fam, tied, temperature):
    model = models[(fam, tied)]
    ids, w_lp, w_ent = _data(model.config.vocab_size, seed=int(temperature * 10))
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied

    model.zero_grad()
    lp_ref, ent_ref = _plain(model(input_ids=ids, use_cache=False).logits[:, :-1], ids[:, 1:], temperature)
    ((lp_ref * w_lp).sum() + (ent_ref * w_ent).sum()).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    with head_hidden_states(model) as head:
        hidden = model(input_ids=ids, use_cache=False).logits[:, :-1]  # [B, T-1, H]
    assert hidden.shape == (*ids[:, 1:].shape, model.config.hidden_size)
    lp, ent = chunked_logprobs(hidden, head, ids[:, 1:], temperature=temperature, with_entropy=True,
                               chunk_tokens=5)  # 36 tokens: 7 full chunks and a short one
    assert lp.dtype == ent.dtype == torch.float32
    _close(lp, lp_ref, "logp")
    _close(ent, ent_ref, "entropy")
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    for n, p in model.named_parameters():
        _close(p.grad, want[n], f"grad {n}")
    assert model.get_output_embeddings() is head  # the head is back in place


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tied", [False, True])
def test_gradients_wrt_hidden_and_head_weight(models, tied, temperature):
    model = models[("qwen2", tied)]
    head = model.get_output_embeddings()
    g = torch.Generator().manual_seed(3)
    N = 29
    hidden = torch.randn(N, model.config.hidden_size, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (N,), generator=g)
    w_lp, w_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    for with_entropy in (True, False):
        grads = []
        for chunked in (False, True):
            h = hidden.clone().requires_grad_()
            head.zero_grad()
            if chunked:
                lp, ent = chunked_logprobs(h, head, targets, temperature=temperature, with_entropy=with_entropy,
                                           chunk_tokens=4)
                assert (ent is None) == (not with_entropy)
            else:
                lp, ent = _plain(head(h), targets, temperature)
            loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)
            loss.backward()
            grads.append((lp.detach(), h.grad, head.weight.grad.clone()))
        (lp0, gh0, gw0), (lp1, gh1, gw1) = grads
        _close(lp1, lp0, "logp")
        _close(gh1, gh0, "grad hidden")
        _close(gw1, gw0, "grad head weight")


@pytest.mark.parametrize("chunk", [1, 7, 29, 1000])
def test_chunk_sizes_and_no_grad(models, chunk):
    head = models[("qwen2", False)].get_output_embeddings()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(29, head.in_features, generator=g)
    targets = torch.randint(0, head.out_features, (29,), generator=g)
    ref_lp, ref_ent = _plain(head(hidden), targets, 0.7)
    with torch.no_grad():
        lp, ent = chunked_logprobs(hidden, head, targets, temperature=0.7, with_entropy=True, chunk_tokens=chunk)
    assert not lp.requires_grad
    _close(lp, ref_lp, "logp")
    _close(ent, ref_ent, "entropy")
    lp, ent = chunked_logprobs(hidden[:0], head, targets[:0], with_entropy=True)
    assert lp.shape == ent.shape == (0,)


def test_forward_keeps_no_vocab_sized_tensor_for_backward(models):
    """The chunks run under checkpoint: nothing of size [tokens, vocab] is saved for the backward
    (the plain path saves the whole logits)."""
    head = models[("qwen2", False)].get_output_embeddings()
    V = head.out_features
    hidden = torch.randn(64, head.in_features, requires_grad=True)
    targets = torch.randint(0, V, (64,))

    def saved_shapes(fn):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return shapes

    plain = saved_shapes(lambda: _plain(head(hidden), targets, 1.0))
    assert any(s[-1:] == (V,) for s in plain)
    chunked = saved_shapes(lambda: chunked_logprobs(hidden, head, targets, with_entropy=True, chunk_tokens=8))
    assert not [s for s in chunked if s[-1:] == (V,)], chunked


def test_low_precision_head_matches_plain_low_precision_path(models):
    """bf16 logits per chunk, fp32 softmax: the same as the engine's path on bf16 logits."""
    from rlrecipes.algos.logprobs import logprobs_and_entropy

    head = nn.Linear(64, 512, bias=False).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, 512, (40,), generator=g)
    lp_ref, ent_ref = logprobs_and_entropy(head(hidden), targets, temperature=0.7, with_entropy=True)
    lp, ent = chunked_logprobs(hidden, head, targets, temperature=0.7, with_entropy=True, chunk_tokens=8)
    _close(lp, lp_ref, "bf16 logp", atol=2e-2)
    _close(ent, ent_ref, "bf16 entropy", atol=2e-2)


def test_head_restored_and_refusals(models):
    model = models[("qwen2", False)]
    head = model.get_output_embeddings()
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    with pytest.raises(RuntimeError, match="boom"):
        with head_hidden_states(model):
            raise RuntimeError("boom")
    assert model.lm_head is head and "forward" not in head.__dict__
    assert model(input_ids=ids, use_cache=False).logits.shape[-1] == model.config.vocab_size

    hidden = torch.randn(4, head.in_features)
    with pytest.raises(ValueError, match="disagree"):
        chunked_logprobs(hidden, head, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="positive"):
        chunked_logprobs(hidden, head, torch.zeros(4, dtype=torch.long), chunk_tokens=0)
    assert unsupported(model) is None and unsupported(model, vocab_parallel=True) is None
    # a head with hooks other than FSDP2's (tensor parallelism registers some) needs group=
    handle = head.register_forward_hook(lambda m, a, out: out)
    try:
        assert "hooks" in unsupported(model)
        with pytest.raises(NotImplementedError, match="hooks"):
            chunked_logprobs(hidden, head, torch.zeros(4, dtype=torch.long))
    finally:
        handle.remove()
    assert "forward" not in head.__dict__
    # a model whose forward transforms the head's output
    model.config.final_logit_softcapping = 30.0
    try:
        assert "softcapping" in unsupported(model)
        with pytest.raises(NotImplementedError, match="softcapping"):
            with head_hidden_states(model):
                pass
    finally:
        model.config.final_logit_softcapping = None
    assert model.lm_head is head
