"""The native sampler's packed prefill (``prefill_layout="packed"``, ``engines/native/prefill.py``) against
the padded square (``"padded"``): the prompts as one row of their own tokens, attention restricted to
each prompt, K/V scattered to the buffer columns the padded layout gives them. Greedy tokens must be
identical and log-probs equal to 1e-5, for dense, GQA, MoE and MLA smoke models, very skewed prompt
lengths (1 token beside long ones), the static decode step, LoRA adapters, multi-turn sessions and
routing replay; a prompt's outputs must not depend on the prompts packed before it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rlrecipes import device as devmod
from rlrecipes.engines.base import SamplingParams
from rlrecipes.engines.native import prefill as prefill_mod
from rlrecipes.engines.native.rollout import DEFAULT_PREFILL_LAYOUT, NativeRolloutEngine, left_pad
from rlrecipes.models import SMOKE
from model_inputs import assert_same_rollout, engine_pair, random_prompts  # tests/model_inputs.py

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py

ATOL = 1e-5
#: the smoke models have as many KV heads as query heads: one GQA shape (4 query heads over 2 KV heads)
GQA = dataclasses.replace(SMOKE["qwen2"], num_heads=4, num_kv_heads=2, head_dim=16)
MODELS = {"qwen2": SMOKE["qwen2"], "qwen2_gqa": GQA, "qwen3_moe": SMOKE["qwen3_moe"],
          "deepseek_v3": SMOKE["deepseek_v3"]}
SKEWED = [(1, 40, 3, 17, 1), (1, 1, 60), (45, 1)]


_prompts = random_prompts


def _same(a, b, what=""):
    assert_same_rollout(a, b, what, atol=ATOL)


def _pair(model, lora=None, **kw):
    """A packed and a padded engine with the same weights (random adapters: B != 0)."""
    a, b = engine_pair(MODELS[model], {"prefill_layout": "packed"}, {"prefill_layout": "padded"}, lora, **kw)
    assert a.prefill_layout == "packed" and b.prefill_layout == "padded"
    return a, b


def _reference_varlen(q, k, v, lengths, scale):
    """Attention of each sequence alone, by hand: the restriction spelled out."""
    out, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        start += n
    return torch.cat(out)


# ------------------------------------------------------------------------------------- device API
def test_varlen_attention_on_the_host_is_per_sequence_attention():
    g = torch.Generator().manual_seed(0)
    lengths = [1, 9, 2, 1, 6]
    T = sum(lengths)
    q, k = torch.randn(T, 4, 8, generator=g), torch.randn(T, 2, 8, generator=g)
    v = torch.randn(T, 2, 6, generator=g)  # value heads narrower than the keys' (MLA)
    cu = torch.tensor([0, 1, 10, 12, 13, 19], dtype=torch.int32)
    for dev in (torch.device("cpu"), torch.device(devmod.SIMULATED_TORCH_TYPE, 0)):
        assert devmod.varlen_attention_backend(dev, torch.float32, 8) == "sdpa"
        assert devmod.varlen_attention_backend(dev, torch.bfloat16, 128) == "sdpa"
    got = devmod.varlen_attention(q, k, v, cu, lengths, scale=0.3)
    torch.testing.assert_close(got, _reference_varlen(q, k, v, lengths, 0.3), atol=1e-5, rtol=1e-5)


def _varlen_case(Dv=6):
    g = torch.Generator().manual_seed(1)
    lengths = [3, 1, 5]
    T = sum(lengths)
    q, k = torch.randn(T, 4, 8, generator=g), torch.randn(T, 2, 8, generator=g)
    v = torch.randn(T, 2, Dv, generator=g)
    return q, k, v, torch.tensor([0, 3, 4, 9], dtype=torch.int32), lengths


def test_varlen_attention_calls_the_cuda_kernel_as_read(monkeypatch):
    """The CUDA path's call (torch 2.13's ``varlen_attn``, docs/upstream_contracts.md) against a stand-in
    kernel that checks what it is given: int32 offsets, the causal window, GQA, value heads padded to D."""
    q, k, v, cu, lengths = _varlen_case()
    seen = {}

    def varlen_attn(q_, k_, v_, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
        seen.update(dtype=cu_q.dtype, same=cu_q is cu_k, max=(max_q, max_k), window=window_size, gqa=enable_gqa,
                    v=v_.shape[-1])
        out = _reference_varlen(q_, k_, v_, lengths, scale)
        return out

    monkeypatch.setattr(devmod, "varlen_attention_backend", lambda *a: "flash")
    monkeypatch.setattr(devmod, "_cuda_varlen", lambda: ("public", varlen_attn))
    got = devmod.varlen_attention(q, k, v, cu, lengths, scale=0.5)
    assert seen == {"dtype": torch.int32, "same": True, "max": (5, 5), "window": (-1, 0), "gqa": True, "v": 8}
    torch.testing.assert_close(got, _reference_varlen(q, k, v, lengths, 0.5), atol=1e-5, rtol=1e-5)
    # a kernel that raises (an unsupported GPU, a changed signature): the per-sequence SDPA, recorded, not a failure
    monkeypatch.setattr(devmod, "_VARLEN_FAILED", {})
    monkeypatch.setattr(devmod, "_cuda_varlen", lambda: ("aten", lambda *a, **kw: (_ for _ in ()).throw(
        RuntimeError("FlashAttention only supports Ampere GPUs or newer."))))
    got = devmod.varlen_attention(q, k, v, cu, lengths, scale=0.5)
    torch.testing.assert_close(got, _reference_varlen(q, k, v, lengths, 0.5), atol=1e-5, rtol=1e-5)
    assert "Ampere" in devmod._VARLEN_FAILED["cpu"]


def test_varlen_attention_calls_npu_fusion_attention_as_read(monkeypatch):
    """The Ascend path's call (op-plugin 26.0.0's ``npu_fusion_attention``, docs/upstream_contracts.md) against
    a stand-in: TND layout, cumulative sequence ends as host ints, rightDownCausal over the 2048 mask."""
    q, k, v, cu, lengths = _varlen_case()
    seen = {}

    def npu_fusion_attention(q_, k_, v_, head_num, input_layout, *, atten_mask, scale, actual_seq_qlen,
                             actual_seq_kvlen, sparse_mode):
        seen.update(heads=head_num, layout=input_layout, q=actual_seq_qlen, kv=actual_seq_kvlen, mode=sparse_mode,
                    mask=(tuple(atten_mask.shape), atten_mask.dtype, bool(atten_mask[0, 1]), bool(atten_mask[1, 0])))
        return (_reference_varlen(q_, k_, v_, lengths, scale), None, None, None, 0, 0, 0)

    monkeypatch.setattr(devmod, "varlen_attention_backend", lambda *a: "npu_fusion")
    monkeypatch.setattr(devmod, "_npu_fusion_attention", lambda: npu_fusion_attention)
    monkeypatch.setattr(devmod, "_NPU_CAUSAL_MASKS", {})
    got = devmod.varlen_attention(q, k, v, cu, lengths, scale=0.5)
    assert seen == {"heads": 4, "layout": "TND", "q": [3, 4, 9], "kv": [3, 4, 9], "mode": 3,
                    "mask": ((2048, 2048), torch.bool, True, False)}
    torch.testing.assert_close(got, _reference_varlen(q, k, v, lengths, 0.5), atol=1e-5, rtol=1e-5)


def test_packed_prompt_index():
    pk = prefill_mod.PackedPrompts([2, 1, 3], 3, torch.device("cpu"))
    assert pk.rows.tolist() == [0, 0, 1, 2, 2, 2] and pk.cols.tolist() == [1, 2, 2, 0, 1, 2]
    assert pk.last.tolist() == [1, 2, 5] and pk.cu.tolist() == [0, 2, 3, 6] and pk.T == 6
    assert list(zip(pk.pad_rows.tolist(), pk.pad_cols.tolist())) == [(0, 0), (1, 0), (1, 1)]
    ids, mask = left_pad([torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9, 4])], 0)
    assert ids[pk.rows, pk.cols].tolist() == [5, 6, 7, 8, 9, 4]  # the packed row: prompt after prompt
    assert not mask[pk.pad_rows, pk.pad_cols].any() and mask[pk.rows, pk.cols].all()


def test_options():
    assert DEFAULT_PREFILL_LAYOUT in prefill_mod.PREFILL_LAYOUTS
    assert NativeRolloutEngine(SMOKE["qwen2"], device="cpu").prefill_layout == DEFAULT_PREFILL_LAYOUT
    assert NativeRolloutEngine(SMOKE["qwen2"], device="cpu", prefill="hf", prefill_layout="packed").prefill_layout \
        == "padded"  # the HF prefill is the padded square
    with pytest.raises(ValueError, match="prefill_layout"):
        NativeRolloutEngine(SMOKE["qwen2"], device="cpu", prefill_layout="ragged")


def test_packed_runs_only_where_rows_are_padded(monkeypatch):
    """Equal lengths (nothing padded) run the square, which is then the same work; skewed ones the packed row."""
    a = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", prefill_layout="packed")
    calls = []
    real = a._fast._prefill_packed
    monkeypatch.setattr(a._fast, "_prefill_packed", lambda *x, **kw: calls.append(kw["lengths"]) or real(*x, **kw))
    a.sample(_prompts(0, (4, 4, 4)), max_new_tokens=2, temperature=0)
    assert calls == []
    a.sample(_prompts(0, (4, 1, 4)), max_new_tokens=2, temperature=0)
    assert calls == [[4, 1, 4]]


# ------------------------------------------------------------------------------------- one-shot sampling
@pytest.mark.parametrize("model", list(MODELS))
def test_packed_prefill_equals_padded(model):
    a, b = _pair(model)
    for j, lens in enumerate(SKEWED):
        prompts = _prompts(j, lens)
        _same(a.sample(prompts, max_new_tokens=6, temperature=0), b.sample(prompts, max_new_tokens=6, temperature=0),
              (lens, "greedy"))
        _same(a.sample(prompts, max_new_tokens=5, temperature=1.0, seed=3),
              b.sample(prompts, max_new_tokens=5, temperature=1.0, seed=3), (lens, "sampled"))
        _same(a.sample(prompts, max_new_tokens=1, temperature=0), b.sample(prompts, max_new_tokens=1, temperature=0))
    # the buffers after the prefill: the same K/V at every real column, zeros at the padded ones
    prompts = _prompts(7, SKEWED[0])
    ids, pmask = left_pad(prompts, 0)
    pos = (pmask.cumsum(-1) - 1).clamp(min=0)
    la, _ = a._prefill_fast(ids, pmask, pos, 4, lengths=list(SKEWED[0]))
    lb, _ = b._prefill_fast(ids, pmask, pos, 4)
    torch.testing.assert_close(la, lb, atol=ATOL, rtol=0)
    ba, bb = a._fast.buffers, b._fast.buffers
    assert ba.length == bb.length == ids.shape[1] and ba.capacity == bb.capacity
    real = pmask.bool()[:, None, :, None]
    P = ids.shape[1]
    for ka, kb in zip(ba.keys + ba.values, bb.keys + bb.values):
        assert ka.shape == kb.shape
        torch.testing.assert_close(ka[:, :, :P] * real, kb[:, :, :P] * real, atol=ATOL, rtol=0)
        assert not (ka[:, :, :P] * ~real).any()


@pytest.mark.parametrize("model", ["qwen2_gqa", "qwen3_moe"])
def test_static_decode_step_after_a_packed_prefill(model):
    """The static (capturable) decode step, run eagerly, after a packed prefill against the shaped step after
    a padded one: the buffers and keep-mask the static step reads are those of the padded prefill."""
    a = NativeRolloutEngine(MODELS[model], device="cpu", dtype="fp32", seed=0, prefill_layout="packed",
                            decode_graphs="eager")
    b = NativeRolloutEngine(MODELS[model], device="cpu", dtype="fp32", seed=0, prefill_layout="padded",
                            decode_graphs="off")
    assert a.decode_graphs == "static"
    for j, lens in enumerate(SKEWED):
        prompts = _prompts(20 + j, lens)
        _same(a.sample(prompts, max_new_tokens=7, temperature=0), b.sample(prompts, max_new_tokens=7, temperature=0))
        _same(a.sample(prompts, max_new_tokens=7, temperature=0.8, top_k=10, seed=5),
              b.sample(prompts, max_new_tokens=7, temperature=0.8, top_k=10, seed=5))


@pytest.mark.parametrize("model", ["qwen2", "qwen3_moe"])
def test_packed_prefill_with_lora_adapters(model):
    pytest.importorskip("peft")
    from rlrecipes.recipe.schema import LoraConfig

    a, b = _pair(model, lora=LoraConfig(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "down_proj", "lm_head"]))
    prompts = _prompts(8, (1, 30, 2, 9))
    _same(a.sample(prompts, max_new_tokens=6, temperature=0), b.sample(prompts, max_new_tokens=6, temperature=0))
    _same(a.sample(prompts, max_new_tokens=6, temperature=1.0, seed=2),
          b.sample(prompts, max_new_tokens=6, temperature=1.0, seed=2))


# ------------------------------------------------------------------------------------- the restriction
_VARLEN = devmod.varlen_attention


def _leaky(q, k, v, cu_seqlens, lengths, *, scale, causal=True):
    """What a packed prefill without the per-prompt restriction computes: causal attention over the whole row."""
    return _VARLEN(q, k, v, cu_seqlens[[0, -1]], [sum(lengths)], scale=scale, causal=causal)


@pytest.mark.parametrize("model", ["qwen2_gqa", "deepseek_v3"])
def test_a_prompt_does_not_see_the_prompts_packed_before_it(model, monkeypatch):
    """A short prompt after long ones in the packed row gives what it gives alone; with the restriction
    removed (``_leaky``) it does not, so this test catches a leak."""
    a = NativeRolloutEngine(MODELS[model], device="cpu", dtype="fp32", seed=0, prefill_layout="packed")
    first, mine = _prompts(30, (50, 23)), _prompts(31, (6,))
    alone = a.sample(mine, max_new_tokens=6, temperature=0)  # one prompt: nothing padded, nothing packed
    batch = first + mine + _prompts(32, (1,))

    def check(out):
        torch.testing.assert_close(out.log_probs[2], alone.log_probs[0], atol=ATOL, rtol=0)
        assert torch.equal(out.responses[2], alone.responses[0])

    check(a.sample(batch, max_new_tokens=6, temperature=0))
    monkeypatch.setattr(prefill_mod.devmod, "varlen_attention", _leaky)
    with pytest.raises(AssertionError):
        check(a.sample(batch, max_new_tokens=6, temperature=0))


def test_packed_prefill_on_a_simulated_device():
    """The packed prefill under device-strict mode (a simulated CUDA device): no operation mixes host and
    device tensors (that would raise), and the tokens are the padded host engine's."""
    from rlrecipes import device_strict

    prompts = _prompts(40, (1, 20, 3))
    want = NativeRolloutEngine(SMOKE["qwen3_moe"], device="cpu", dtype="fp32", seed=0, prefill_layout="padded")
    want = want.sample(prompts, max_new_tokens=5, temperature=0)
    with device_strict.simulate("cuda") as device:
        eng = NativeRolloutEngine(SMOKE["qwen3_moe"], device=device, dtype="fp32", seed=0, prefill_layout="packed")
        got = eng.sample(prompts, max_new_tokens=5, temperature=0)
    _same(got, want)


# ------------------------------------------------------------------------------------- multi-turn, routing
def _turns(eng, prompts, params, seed):
    """All rows first (the packed prefill), then single rows and subsets with observations (extend, grow, compact)."""
    g = torch.Generator().manual_seed(seed)
    session = eng.open_session(prompts, params, seed=seed)
    B = len(prompts)
    outs = [session.generate(range(B), [None] * B, [4] * B)]
    for call in range(8):
        r = call % B
        outs.append(session.generate([r], [torch.randint(4, 32, (1 + call % 3,), generator=g)], [3]))
    for call in range(4):
        rows = [r for r in range(B) if (r + call) % 3 != 0] or [0]
        outs.append(session.generate(rows, [torch.randint(4, 32, (2,), generator=g) for _ in rows], [3] * len(rows)))
    compactions = session.compactions
    session.close()
    return outs, compactions


@pytest.mark.parametrize("model", ["qwen2_gqa", "qwen3_moe"])
def test_multi_turn_session_packed_equals_padded(model):
    a, b = _pair(model)
    prompts = _prompts(11, (1, 24, 3, 1))
    for kw in ({"temperature": 0.0}, {"temperature": 1.0}):
        params = SamplingParams(max_new_tokens=4, eos_token_id=None, pad_token_id=0, **kw)
        xs, ca = _turns(a, prompts, params, seed=4)
        ys, cb = _turns(b, prompts, params, seed=4)
        assert ca == cb
        for i, (x, y) in enumerate(zip(xs, ys)):
            _same(x, y, (kw, "call", i))


def test_routing_replay_records_of_a_packed_prefill():
    from rlrecipes.engines.native.routing import per_sample_routing

    # packed prefill records: prompt after prompt (2 + 3 tokens), P = 3; the last layer: last positions only
    col = lambda *v: torch.tensor(v, dtype=torch.int32)[:, None]  # noqa: E731
    got = per_sample_routing([[col(1, 2, 3, 4, 5), col(6, 7)], [col(20, 50), col(60, 70)]], prompt_lens=[2, 3],
                             padded_prompt_len=3, response_lens=[2, 1])
    assert got[0][:, 0, 0].tolist() == [1, 2, 6, -1] and got[1][:, 0, 0].tolist() == [3, 4, 5, -1]
    assert got[0][:, 1, 0].tolist() == [-1, 20, 60, -1] and got[1][:, 1, 0].tolist() == [-1, -1, 50, -1]
    a, b = _pair("qwen3_moe")
    a.record_routing()
    b.record_routing()
    prompts = _prompts(12, (1, 9, 4))
    params = SamplingParams(max_new_tokens=4, temperature=0)
    x, y = a.generate(prompts, params, seed=1), b.generate(prompts, params, seed=1)
    _same(x, y)
    for ra, rb in zip(x.routed_experts, y.routed_experts):
        assert torch.equal(ra, rb)
