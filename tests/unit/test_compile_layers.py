"""``compile_layers`` (issue 49): ``torch.compile`` of every decoder layer after FSDP2 wrapping gives
eager's log-probs, gradients and update, with activation recompute on and off, under FSDP2 and for an
MoE model's grouped experts; parameter names do not change; a device that cannot compile is a clear
error at construction.

The CPU tests compile with the ``aot_eager`` backend: dynamo's capture and AOTAutograd's forward /
backward split, which is what meets FSDP2's hooks, the activation checkpoint and the experts, without
inductor's C++ code generation, which costs 25-80 s per graph on this 2-core machine (measured: one
1-layer train step, a cold cache). Inductor itself is checked on an accelerator
(``tests/gpu/test_engine_accelerator.py``) and measured by ``benchmarks/train_options.py``.
"""
import dataclasses

import pytest
import torch

from rlrecipes.engines.native import compiled
from rlrecipes.models import SMOKE
from model_inputs import padded_micro_batch  # tests/model_inputs.py

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


_batch = padded_micro_batch


def _loss(logp, _ent, mb):
    m = mb["response_mask"].to(logp.dtype)
    return -(logp * m).sum() / m.sum(), {}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("family,recompute", [("qwen2", True), ("qwen3_moe", False)])
def test_compiled_layers_train_like_eager(family, recompute):
    """Under FSDP2 (a 1-rank group), recompute on (dense) and off (MoE, grouped experts)."""
    from rlrecipes.engines.native.train import NativeTrainEngine

    import torch._dynamo

    torch._dynamo.reset()  # no compiled graph left by another test: the count below is this test's
    dims = SMOKE[family]
    mbs = [_batch(dims.vocab_size, 1), _batch(dims.vocab_size, 2)]  # one shape: one compiled train graph
    got = {}
    for backend in (False, "aot_eager"):
        eng = NativeTrainEngine(dims, device="cpu", lr=1e-2, seed=0, recompute=recompute, fsdp=True,
                                compile_layers=backend)
        assert eng.fsdp and eng.compile_backend == (backend or None)
        before = _graphs()
        m = eng.train_micro_batches(mbs, _loss)
        assert m["actor/skipped_step"] == 0.0
        graphs = _graphs() - before
        if backend:  # every layer ran compiled, and the two layers (one class) shared one graph
            layers = compiled.text_layers(eng.model)
            assert len(layers) == 2 and all(getattr(layer, "_rlr_compiled", False) for layer in layers)
            assert graphs == 1, graphs
        else:
            assert graphs == 0
        got[bool(backend)] = (m["actor/grad_norm"], eng.full_state_dict())
    (n_e, sd_e), (n_c, sd_c) = got[False], got[True]
    assert sd_e.keys() == sd_c.keys()  # the same parameter names: no wrapper module
    assert abs(n_e - n_c) <= 1e-5 * max(1.0, n_e), (n_e, n_c)
    for k in sd_e:
        torch.testing.assert_close(sd_c[k], sd_e[k], rtol=1e-5, atol=1e-6, msg=k)


def test_compiled_layers_no_grad_forward_like_eager():
    from rlrecipes.engines.native.train import NativeTrainEngine

    dims = dataclasses.replace(SMOKE["qwen2"], num_layers=1)
    mb = _batch(dims.vocab_size, 3)
    lp = [NativeTrainEngine(dims, device="cpu", seed=0, compile_layers=b).log_probs(mb)[0]
          for b in (False, "aot_eager")]
    torch.testing.assert_close(lp[1], lp[0], rtol=1e-5, atol=1e-6)


def test_compile_layers_is_refused_where_it_is_not_supported(monkeypatch):
    from rlrecipes import device as devmod
    from rlrecipes.engines.native.train import NativeTrainEngine

    with pytest.raises(ValueError, match="compile_layers with TP2 EP1 SP1"):
        NativeTrainEngine(SMOKE["qwen2"], device="cpu", layout=(2, 1), compile_layers=True)
    with pytest.raises(ValueError, match="compile_layers=.*expected true / false"):
        compiled.backend_of(3)
    assert [compiled.backend_of(x) for x in (False, None, True, "aot_eager")] == [None, None, "inductor", "aot_eager"]
    # no C++ compiler for inductor on the CPU: named at construction, before any step
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/g++",))
    assert "C++ compiler" in devmod.compile_problem(torch.device("cpu"), "inductor")
    assert devmod.compile_problem(torch.device("cpu"), "aot_eager") is None
    with pytest.raises(RuntimeError, match="cannot run here: inductor on the CPU needs a C\\+\\+ compiler"):
        NativeTrainEngine(SMOKE["qwen2"], device="cpu", compile_layers=True)
