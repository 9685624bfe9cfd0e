"""``moe_grouped_mm`` (issue 49): MoE experts as grouped GEMMs compute what the loop over experts
computes, at EP 1 (transformers' ``grouped_mm`` / ``eager`` experts, selected by the engines) and in
:func:`rlrecipes.engines.native.experts.local_experts` (EPExperts' path under EP; EP 2 itself runs in
``tests/dist/test_engine_native_dist.py``): outputs, gradients of the hidden states, of every
parameter and of experts no token reached (zero), and the router's auxiliary loss."""
import pytest
import torch

from rlrecipes.engines.native import experts as ex
from rlrecipes.models import SMOKE
from model_inputs import padded_micro_batch  # tests/model_inputs.py

pytestmark = [pytest.mark.usefixtures("one_rank_group"),  # tests/conftest.py
              pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped GEMM")]

MOE = ["qwen3_moe", "deepseek_v3"]


_batch = padded_micro_batch


def _loss(logp, mb):
    m = mb["response_mask"].to(logp.dtype)
    return -(logp * m).sum() / m.sum()


def _grads(eng, mbs):
    """Log-probs and the gradient of every parameter for ``mbs`` (no optimizer step)."""
    eng.model.zero_grad(set_to_none=True)
    out = []
    for mb in mbs:
        logp, _ = eng._forward(mb, 1.0, False)
        _loss(logp, mb).backward()
        out.append(logp.detach().flatten())
    return torch.cat(out), {n: p.grad.clone() for n, p in eng.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", MOE)
def test_train_engine_grouped_experts_equal_the_loop(family):
    from rlrecipes.engines.native.train import NativeTrainEngine

    dims = SMOKE[family]
    mbs = [_batch(dims.vocab_size, 1), _batch(dims.vocab_size, 2, B=2, P=4, R=7)]
    got = {}
    for grouped in (True, False):
        eng = NativeTrainEngine(dims, device="cpu", seed=0, moe_grouped_mm=grouped)
        assert eng.model.config._experts_implementation == ("grouped_mm" if grouped else "eager")
        assert ex.fused_experts(eng.model)  # transformers' experts, not EPExperts, at EP 1
        got[grouped] = _grads(eng, mbs)
    (lp_g, g_g), (lp_l, g_l) = got[True], got[False]
    torch.testing.assert_close(lp_g, lp_l, rtol=1e-5, atol=1e-5)
    assert g_g.keys() == g_l.keys() and any("experts.gate_up_proj" in n for n in g_g)
    for n in g_g:
        torch.testing.assert_close(g_g[n], g_l[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_experts_grouped_equal_loop_with_unrouted_experts(family, dtype):
    """transformers' experts module under both implementations, some experts getting no token."""
    from rlrecipes.engines.native.loader import build_model

    model, dims = build_model(SMOKE[family], seed=0)
    model.to(dtype)
    experts = ex.fused_experts(model)[0]
    g = torch.Generator().manual_seed(3)
    n, k, H = 24, dims.experts_per_token, dims.hidden_size
    x = torch.randn(n, H, generator=g).to(dtype)
    idx = torch.randint(0, dims.num_experts - 3, (n, k), generator=g)  # the last three experts get none
    w = torch.rand(n, k, generator=g).to(dtype)
    target = torch.randn(n, H, generator=g).to(dtype)
    res = {}
    for impl in ("grouped_mm", "eager"):
        ex.select_implementation(model, impl == "grouped_mm")
        assert model.config._experts_implementation == impl
        experts.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = experts(xi, idx, w)
        (out.float() * target.float()).sum().backward()
        res[impl] = (out.detach().float(), xi.grad.float(), experts.gate_up_proj.grad.float(),
                     experts.down_proj.grad.float())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b, what in zip(res["grouped_mm"], res["eager"], ("out", "d hidden", "d gate_up", "d down")):
        torch.testing.assert_close(a, b, **tol, msg=what)
    for impl, r in res.items():
        assert r[2][-3:].abs().sum() == 0 and r[3][-3:].abs().sum() == 0, impl  # no token, no gradient


def test_router_aux_loss_does_not_depend_on_the_experts_implementation():
    from rlrecipes.engines.native.loader import build_model

    model, dims = build_model(SMOKE["qwen3_moe"], seed=0)
    ids = torch.randint(1, dims.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    out = {}
    for grouped in (True, False):
        ex.select_implementation(model, grouped)
        o = model(input_ids=ids, output_router_logits=True)
        out[grouped] = (o.aux_loss.detach(), o.logits.detach())
    assert out[True][0].ndim == 0 and torch.isfinite(out[True][0])
    assert torch.equal(out[True][0], out[False][0])  # the router runs before (and apart from) the experts
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-5, atol=1e-5)


def _routed(n, k, e, seed, skip=2):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, e - skip, (n, k), generator=g)  # [n, k]; the last `skip` experts get none
    tok, slot = torch.ones_like(idx, dtype=torch.bool).nonzero(as_tuple=True)
    e_of = idx[tok, slot]
    order = torch.argsort(e_of, stable=True)
    return tok[order], slot[order], e_of[order]


@pytest.mark.parametrize("hidden", [64, 6])  # 6 fp32 values = 24 bytes a row: not 16-byte strides
def test_local_experts_grouped_equals_loop_and_falls_back(hidden):
    g = torch.Generator().manual_seed(0)
    n, k, E, inter = 30, 2, 6, 8
    x = torch.randn(n, hidden, generator=g)
    w = torch.rand(n, k, generator=g)
    gate_up = torch.randn(E, 2 * inter, hidden, generator=g)
    down = torch.randn(E, hidden, inter, generator=g)
    fits = ex.grouped_mm_fits(x, gate_up.transpose(-2, -1), down.transpose(-2, -1))
    assert fits == (hidden == 64)
    tok, slot, e_of = _routed(n, k, E, 1)
    res = []
    for grouped in (True, False):
        xi, gu, dn = (t.clone().requires_grad_(True) for t in (x, gate_up, down))
        out = ex.local_experts(xi, w, tok, slot, e_of, gu, dn, torch.nn.functional.silu, grouped=grouped)
        out.square().sum().backward()
        res.append((out.detach(), xi.grad, gu.grad, dn.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert res[0][2][-2:].abs().sum() == 0  # unrouted experts: zero gradient
    # nothing routed here: zeros, and no op runs
    none = ex.local_experts(x, w, tok[:0], slot[:0], e_of[:0], gate_up, down, torch.nn.functional.silu,
                            grouped=True)
    assert torch.equal(none, torch.zeros_like(x))


def test_rollout_engine_takes_the_option():
    from rlrecipes.engines.native.rollout import NativeRolloutEngine

    prompts = [torch.tensor([3, 5, 7, 2]), torch.tensor([1, 4])]
    outs = {}
    for grouped in (True, False):
        eng = NativeRolloutEngine(SMOKE["qwen3_moe"], device="cpu", moe_grouped_mm=grouped)
        assert eng.model.config._experts_implementation == ("grouped_mm" if grouped else "eager")
        outs[grouped] = eng.sample(prompts, max_new_tokens=6, temperature=0)
    for a, b in zip(outs[True].responses, outs[False].responses):
        assert torch.equal(a, b)
    for a, b in zip(outs[True].log_probs, outs[False].log_probs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_model_that_cannot_switch_is_an_error():
    class NoSwitch(torch.nn.Module):  # fused experts, but no transformers switch
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.experts = torch.nn.Module()
            self.mlp.experts.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 4, 4))

    with pytest.raises(NotImplementedError, match="cannot switch its experts implementation"):
        ex.select_implementation(NoSwitch(), True)
    assert ex.select_implementation(torch.nn.Linear(2, 2), True) is None  # a dense model: nothing to set


def test_lora_wrapped_experts_are_switched_too():
    """PEFT's LoRA wraps ``mlp.experts`` when its targets match the experts' parameter names
    (``down_proj``): the option still reaches transformers' experts inside the wrapper."""
    pytest.importorskip("peft")
    from rlrecipes.engines.native.train import NativeTrainEngine
    from rlrecipes.recipe.schema import LoraConfig

    for grouped in (False, True):
        eng = NativeTrainEngine(SMOKE["qwen3_moe"], device="cpu", lora=LoraConfig(rank=4), moe_grouped_mm=grouped)
        assert ex.fused_experts(eng.model)
        assert eng.model.config._experts_implementation == ("grouped_mm" if grouped else "eager")
