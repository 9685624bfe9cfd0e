"""LoRA adapters on the vLLM rollout engine (vLLM's CPU build), built on the worker from the tensors.

The trainer's side is what the native train engine holds: the smoke model built from the seed
(``build_model``, fp32) with PEFT's adapters injected (``inject``); the engine receives only the
adapters' tensors (``update_weights``), as the resharder sends them. Its sampled tokens' log-probs
must be the trainer's on the same adapters (fp32, temperature 1), before and after every sync.
"""
import copy

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from rlrecipes.engines.base import EngineSpec, SamplingParams  # noqa: E402
from rlrecipes.engines.registry import build_rollout_engine  # noqa: E402
from rlrecipes.engines.vllm.args import engine_args, lora_max_rank, lora_problem  # noqa: E402
from rlrecipes.models import SMOKE  # noqa: E402
from rlrecipes.recipe.schema import LoraConfig  # noqa: E402
from test_vllm_engine import hf_logprobs, run_smoke  # noqa: E402  (same folder)

DIMS = SMOKE["qwen2"]
SEED = 5
# the smoke recipes' targets: every projection and the head (which the engine merges)
LORA = LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj", "lm_head"])
PROMPTS = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8])]
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


@pytest.fixture(scope="module")
def setup():
    """The engine (no folder: the smoke base comes from the seed) and the trainer's model."""
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.engines.native.lora import inject

    eng = build_rollout_engine("vllm", EngineSpec(model=DIMS, role="rollout", dtype="fp32", seed=SEED,
                                                  max_model_len=64, lora=LORA))
    hf, _ = build_model(DIMS, dtype=torch.float32, seed=SEED)  # what the native actor builds
    return eng, inject(hf, LORA).eval()


def _adapters(model):
    from rlrecipes.engines.native.lora import is_lora_name

    return [(n, p.detach()) for n, p in model.named_parameters() if is_lora_name(n)]


def _randomize(model, seed: int, *, a_too: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n or (a_too and ".lora_A." in n):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _worst(model, out) -> float:
    return max((lp - hf_logprobs(model, p, r)).abs().max().item()
               for p, r, lp in zip(PROMPTS, out.responses, out.log_probs))


def test_adapter_sync_gives_the_trainers_log_probs(setup):
    from rlrecipes.engines.native.lora import adapters_off
    from rlrecipes.engines.vllm.lora import ADAPTER_ID, served_adapters

    eng, hf = setup
    # before the first sync: no LoRARequest, the seeded base (B = 0 adapters are the base model)
    assert eng._lora_request is None
    before = eng.generate(PROMPTS, PARAMS, seed=3)
    assert _worst(hf, before) < 1e-4

    _randomize(hf, 1)  # non-zero B: the adapters matter
    sent = _adapters(hf)
    kept = [t.clone() for _, t in sent]
    half = len(sent) // 2
    eng.update_weights([sent[:half], sent[half:]])  # two buckets, adapters only
    assert all(torch.equal(t, k) for (_, t), k in zip(sent, kept))  # the trainer's tensors untouched
    assert eng.llm.collective_rpc(served_adapters) == [[ADAPTER_ID]]
    out = eng.generate(PROMPTS, PARAMS, seed=3)
    assert all(len(r) == PARAMS.max_new_tokens for r in out.responses)
    assert _worst(hf, out) < 1e-4
    with adapters_off(hf):
        assert _worst(hf, out) > 1e-2  # far from the base's log-probs: the adapters are applied
    again = eng.generate(PROMPTS, PARAMS, seed=3)
    assert [r.tolist() for r in again.responses] == [r.tolist() for r in out.responses]  # seeded


def test_second_sync_replaces_the_adapter(setup):
    from rlrecipes.engines.vllm.lora import ADAPTER_ID, served_adapters

    eng, hf = setup
    _randomize(hf, 11)
    eng.update_weights([_adapters(hf)])
    old = copy.deepcopy(hf)
    _randomize(hf, 12, a_too=True)  # new A and B everywhere, the head's too
    eng.update_weights([_adapters(hf)])
    assert eng.llm.collective_rpc(served_adapters) == [[ADAPTER_ID]]  # replaced in place, one slot
    out = eng.generate(PROMPTS, PARAMS, seed=4)
    assert _worst(hf, out) < 1e-4
    assert _worst(old, out) > 1e-2  # nothing of the first adapter is left (nor of the first head merge)


def test_engine_args_and_limits():
    kw = engine_args(tp=1, ep=1, world=1, platform="cpu", dtype="float32", seed=0, load_format="auto", model="/m",
                     distributed=False, lora=LORA)
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"], kw["lora_dtype"]) == (True, 1, 8, "auto")
    assert "enable_lora" not in engine_args(tp=1, ep=1, world=1, platform="cpu", dtype="float32", seed=0,
                                            load_format="auto", model="/m", distributed=False)
    assert [lora_max_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    assert lora_problem(rank=8, target_modules=LORA.target_modules) is None
    assert "max_lora_rank 512" in lora_problem(rank=1024, target_modules=["q_proj"])
    assert "embed_tokens" in lora_problem(rank=8, target_modules=["q_proj", "embed_tokens"])
    assert "tied embeddings" in lora_problem(rank=8, target_modules=["lm_head"], tie_embeddings=True)
    assert "Triton" in lora_problem(rank=8, target_modules=["q_proj"], moe=True, platform="cpu")
    assert lora_problem(rank=8, target_modules=["q_proj"], moe=True, platform="cuda") is None
    # expert adapters (PEFT's fused 3-D mlp.experts / mlp.experts.base_layer): vLLM serves none for
    # Qwen3-MoE / DeepSeek, on any platform (issue 45, item 1)
    for platform in ("cuda", "ascend"):
        msg = lora_problem(rank=8, target_modules=LORA.target_modules, moe=True, platform=platform)
        assert "adapt the MoE experts" in msg and "target_modules=[q_proj,k_proj,v_proj,o_proj,lm_head]" in msg
    with pytest.raises(ValueError, match="tp: 1, ep: 1"):
        engine_args(tp=2, ep=1, world=2, platform="cpu", dtype="float32", seed=0, load_format="auto", model="/m",
                    lora=LORA)


def test_smoke_run_with_lora_on_vllm(tmp_path):
    out = tmp_path / "run"
    rows = run_smoke(out, 3, "actor.lora.rank=8")
    for r in rows:
        # the rollout serves the trainer's base and adapters: a dummy base or a missing adapter is ~1 off
        assert 0 <= r["rollout/logprob_diff_mean"] <= r["rollout/logprob_diff_max"] < 1e-3, r
    assert (out / "actor_adapter" / "adapter_config.json").is_file()


def test_module_check_passes_peft_fused_expert_names_with_vllms_parser():
    """The engine's check with vLLM's own ``parse_fine_tuned_lora_name``: PEFT's fused-expert names
    (``mlp.experts.base_layer`` = gate_up_proj, ``mlp.experts`` = down_proj) pass, as vLLM's
    ``check_unexpected_modules`` passes them (issue 45, item 1)."""
    from types import SimpleNamespace

    from rlrecipes.engines.vllm.lora import _check_modules

    t = torch.zeros(1)
    names = [f"base_model.model.model.layers.0.mlp.experts{p}.lora_{h}.weight" for p in (".base_layer", "") for h in "AB"]
    _check_modules({n: t for n in names}, {"q_proj", "experts"}, None, SimpleNamespace(modules_to_save=None))
    with pytest.raises(ValueError, match="does not adapt"):
        _check_modules({n: t for n in names}, {"q_proj"}, None, SimpleNamespace(modules_to_save=None))
