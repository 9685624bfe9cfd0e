"""Static (capturable) decode steps of the native rollout engine against the per-call-shaped step.

``decode_graphs="auto"`` (the default) captures :class:`~rlrecipes.engines.native.static_step.StaticStep`
steps where the device has graphs (on the CPU it is ``"off"``); ``"eager"`` runs them uncaptured, which
is what these tests compare: batch padded to a power-of-two bucket, column / rotary step as device tensors, attention over
the whole K/V capacity with a mask; ``"off"`` is the step of before. Tokens must be identical and
log-probs equal to rounding (the masked attention sums over another length), greedy and seeded,
dense (qwen2) and MoE (qwen3_moe), with LoRA adapters on and in multi-turn sessions. On the host
nothing is captured; the capture / replay bookkeeping is checked with a stand-in graph.
"""
from __future__ import annotations

import pytest
import torch

from rlrecipes import device as devmod
from rlrecipes.engines.base import SamplingParams
from rlrecipes.engines.native import decode as dec
from rlrecipes.engines.native.rollout import NativeRolloutEngine
from rlrecipes.models import SMOKE
from model_inputs import assert_same_rollout, engine_pair, random_prompts  # tests/model_inputs.py

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py

FAMILIES = ["qwen2", "qwen3_moe"]
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 3},
            {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7}]
ATOL = 1e-5


_prompts = random_prompts


def _same(a, b, what=""):
    assert_same_rollout(a, b, what, atol=ATOL)


def _lora():
    pytest.importorskip("peft")
    from rlrecipes.recipe.schema import LoraConfig

    return LoraConfig(rank=4, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])


def _pair(family, lora=None, **kw):
    """The static-step engine and the per-call-shaped one, with the same weights (random adapters: B != 0)."""
    a, b = engine_pair(SMOKE[family], {"decode_graphs": "eager"}, {"decode_graphs": "off"}, lora, **kw)
    assert a.decode_graphs == "static" and b.decode_graphs == "off"
    return a, b


# ------------------------------------------------------------------------------------- device API
def test_device_reports_no_graph_capture_on_the_host():
    for d in (torch.device("cpu"), torch.device(devmod.SIMULATED_TORCH_TYPE, 0)):
        assert not devmod.graph_capture_supported(d)
        assert devmod.graph_class(d) is None
        with pytest.raises(RuntimeError, match="no device graphs"):
            devmod.capture_graph(d, lambda: None)


def test_bucket_rows_and_options():
    assert [dec.bucket_rows(b) for b in (1, 2, 3, 4, 5, 9, 512)] == [1, 2, 4, 4, 8, 16, 512]
    assert dec.bucket_rows(513) == 513 and dec.bucket_rows(6, max_bucket=4) == 6
    with pytest.raises(ValueError, match="decode_graphs"):
        NativeRolloutEngine(SMOKE["qwen2"], device="cpu", decode_graphs="nope")
    assert NativeRolloutEngine(SMOKE["qwen2"], device="cpu").decode_graphs == "off"  # the default on CPU: nothing captures
    assert NativeRolloutEngine(SMOKE["qwen2"], device="cpu", decode_graphs="eager").decode_graphs == "static"
    assert NativeRolloutEngine(SMOKE["qwen2"], device="cpu", decode="layers").decode_graphs == "off"
    assert NativeRolloutEngine(SMOKE["qwen2"], device="cpu", decode="hf").decode_graphs == "off"


# ------------------------------------------------------------------------------------- one-shot sampling
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lens", [(3, 7, 5), (4, 4, 4, 4), (2, 6, 4, 6, 3)])  # B = 3, 5: padding rows; 4: none
def test_static_step_equals_the_shaped_step(family, lens):
    a, b = _pair(family)
    prompts = _prompts(len(lens), lens)
    for kw in SAMPLING:
        _same(a.sample(prompts, max_new_tokens=9, **kw), b.sample(prompts, max_new_tokens=9, **kw), kw)
    rows = dec.bucket_rows(len(lens))
    assert a._fast.buffers.store_keys[0].shape[0] == rows and a._fast.buffers.keys[0].shape[0] == len(lens)
    assert b._fast.buffers.store_keys[0].shape[0] == len(lens)
    # EOS (the masked, every-step-checked loop) and a single token (no decode step)
    eos = int(b.sample(prompts, max_new_tokens=6, temperature=0).responses[0][2])
    _same(a.sample(prompts, max_new_tokens=12, temperature=0, eos_token_id=eos),
          b.sample(prompts, max_new_tokens=12, temperature=0, eos_token_id=eos))
    _same(a.sample(prompts, max_new_tokens=1, temperature=1.0, seed=2),
          b.sample(prompts, max_new_tokens=1, temperature=1.0, seed=2))


@pytest.mark.parametrize("family", FAMILIES)
def test_static_step_with_lora_adapters(family):
    a, b = _pair(family, lora=_lora())
    prompts = _prompts(8, (5, 2, 7))
    for kw in SAMPLING:
        _same(a.sample(prompts, max_new_tokens=8, **kw), b.sample(prompts, max_new_tokens=8, **kw), kw)


def test_only_the_current_bucket_and_capacitys_static_step_is_kept():
    a = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", decode_graphs="eager")
    a.sample(_prompts(0, (3, 3, 3)), max_new_tokens=4, temperature=0)
    a.sample(_prompts(1, (3, 3, 3, 3)), max_new_tokens=4, temperature=0)  # same bucket (4) and capacity
    assert list(a._fast._statics) == [(4, 7)]
    a.sample(_prompts(2, (3, 3)), max_new_tokens=4, temperature=0)
    assert sorted(a._fast._statics) == [(2, 7)]  # the 4-row step read storage that is gone
    a.sleep()
    assert not a._fast._statics and a._fast.buffers.nbytes() == 0


def test_prefill_hf_then_static_steps():
    """The HF prefill fallback (cache copied into the buffers) also feeds the static steps."""
    a = NativeRolloutEngine(SMOKE["qwen3_moe"], device="cpu", prefill="hf", decode_graphs="eager")
    b = NativeRolloutEngine(SMOKE["qwen3_moe"], device="cpu", prefill="hf", decode_graphs="off")
    prompts = _prompts(3, (2, 6, 4))
    for kw in SAMPLING:
        _same(a.sample(prompts, max_new_tokens=7, **kw), b.sample(prompts, max_new_tokens=7, **kw), kw)


# ------------------------------------------------------------------------------------- multi-turn sessions
def _turns(eng, prompts, params, seed):
    """A fixed schedule of turn calls: all rows, then subsets with observations (rows sit calls out,
    the buffers grow and compact); every call's output."""
    g = torch.Generator().manual_seed(seed)
    session = eng.open_session(prompts, params, seed=seed)
    B = len(prompts)
    outs = [session.generate(range(B), [None] * B, [5] * B)]
    for call in range(12):  # one row per call: holes in the others' columns, then compaction
        r = call % B
        outs.append(session.generate([r], [torch.randint(4, 32, (2,), generator=g)], [3]))
    for call in range(8):
        rows = [r for r in range(B) if (r + call) % 3 != 0] or [0]
        obs = [torch.randint(4, 32, (1 + (r + call) % 3,), generator=g) for r in rows]
        outs.append(session.generate(rows, obs, [3 + (r % 2) for r in rows]))
    compactions = session.compactions
    session.close()
    return outs, compactions


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lora", [False, True])
def test_multi_turn_session_static_equals_shaped(family, lora):
    a, b = _pair(family, lora=_lora() if lora else None)
    prompts = _prompts(11, (3, 6, 4, 5, 2))  # B = 5: bucket 8
    for kw in ({"temperature": 0.0}, {"temperature": 1.0}):
        params = SamplingParams(max_new_tokens=5, eos_token_id=None, pad_token_id=0, **kw)
        xs, ca = _turns(a, prompts, params, seed=4)
        ys, cb = _turns(b, prompts, params, seed=4)
        assert ca == cb and ca >= 1
        for i, (x, y) in enumerate(zip(xs, ys)):
            _same(x, y, (kw, "call", i))


# ------------------------------------------------------------------------------------- capture bookkeeping
class _StandInGraph:
    """What a device graph does, on the host: ``replay`` re-runs the recorded step into the captured output."""

    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        self.out.copy_(self.fn())
        self.replays += 1

    def pool(self):
        return "pool"


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_steps_replay_the_static_step(monkeypatch, family):
    """The capture protocol (one eager warm-up step, capture once per bucket and storage, replay into the
    captured output, re-armed counters across calls) with a stand-in graph: the same tokens."""
    a, b = _pair(family)
    a._fast.capture = True
    assert a.decode_graphs == "captured"
    captures = []

    def capture(device, fn, *, pool=None, warmup=0):
        st = a._fast._st
        col, t = st.col.clone(), st.t.clone()
        out = fn()  # recording stands in for: run once, then undo what a recording would not have done
        st.col.copy_(col)
        st.t.copy_(t)
        captures.append((st.rows, pool))
        return _StandInGraph(fn, out), out

    monkeypatch.setattr(dec.devmod, "capture_graph", capture)
    prompts = _prompts(12, (3, 7, 5))
    for kw in SAMPLING:
        _same(a.sample(prompts, max_new_tokens=8, **kw), b.sample(prompts, max_new_tokens=8, **kw), kw)
    assert [c[0] for c in captures] == [4] and captures[0][1] is None  # one capture: same bucket and storage
    st = a._fast._statics[(4, 15)]
    assert st.graph is not None and st.graph.replays == 3 * 7 - 1  # every step but the warm-up one
    _same(a.sample(prompts[:2], max_new_tokens=8, temperature=0),
          b.sample(prompts[:2], max_new_tokens=8, temperature=0))
    assert [c[0] for c in captures] == [4, 2] and captures[1][1] == "pool"  # a new bucket shares the pool
    params = SamplingParams(max_new_tokens=5, eos_token_id=None, pad_token_id=0, temperature=1.0)
    xs, _ = _turns(a, prompts, params, seed=4)
    ys, _ = _turns(b, prompts, params, seed=4)
    for x, y in zip(xs, ys):
        _same(x, y)


def test_a_failed_capture_leaves_the_bucket_eager(monkeypatch):
    a, b = _pair("qwen2")
    a._fast.capture = True

    def refuse(device, fn, *, pool=None, warmup=0):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(dec.devmod, "capture_graph", refuse)
    prompts = _prompts(13, (4, 2, 6))
    _same(a.sample(prompts, max_new_tokens=6, temperature=1.0, seed=1),
          b.sample(prompts, max_new_tokens=6, temperature=1.0, seed=1))
    st = a._fast._st
    assert st.failed and st.graph is None


def test_the_recipes_enforce_eager_turns_static_steps_off_and_an_moe_model_is_never_captured(monkeypatch):
    from types import SimpleNamespace

    from rlrecipes.engines.base import EngineSpec

    monkeypatch.setattr(devmod, "graph_capture_supported", lambda device: True)  # as on a GPU
    for eager, want in ((False, "captured"), (True, "off")):
        eng = NativeRolloutEngine.create(EngineSpec(model=SMOKE["qwen2"], role="rollout", device="cpu",
                                                    inference=SimpleNamespace(enforce_eager=eager)))
        assert eng.decode_graphs == want
    moe = NativeRolloutEngine(SMOKE["qwen3_moe"], device="cpu")
    assert moe.decode_graphs == "off"  # its expert routing syncs with the host: no capture to fail
