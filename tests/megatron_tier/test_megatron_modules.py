"""megatron-core tier (its own venv: bash scripts/setup_megatron_cpu.sh): the modules megatron-core
really builds on CPU (use_cpu_initialization) through the engine's own path (``model.build_gpt``:
the engine's config keywords, megatron's decoder block spec with the engine's norm and MLA attention)
have exactly the names and shapes the converter produces, converted HF weights load into them bit for
bit, dense and MoE layers sit where the HF config puts them, and the engine's rows and log-prob code
give the HF model's log-probs (forward on CPU through cpu_shims). Skipped where megatron-core is not
installed."""
import dataclasses

import pytest
import torch

megatron = pytest.importorskip("megatron.core")

from cpu_shims import engine_logprobs, engine_pieces, hf_logprobs, megatron_on_cpu  # noqa: E402

from rlrecipes.engines.megatron.convert import hf_to_megatron  # noqa: E402
from rlrecipes.engines.megatron.model import RMSNorm, build_gpt, decoder_block_spec, load_hf_state  # noqa: E402
from rlrecipes.engines.megatron.shard import Ranks  # noqa: E402
from rlrecipes.engines.native.loader import build_model  # noqa: E402
from rlrecipes.models import SMOKE  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def model_parallel(one_rank_group):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    with megatron_on_cpu():
        yield
    parallel_state.destroy_model_parallel()


CASES = {"qwen2": SMOKE["qwen2"], "qwen2_tied": dataclasses.replace(SMOKE["qwen2"], tie_embeddings=True),
         "qwen3_moe": SMOKE["qwen3_moe"], "deepseek_v3": SMOKE["deepseek_v3"]}
# the all-to-all dispatcher allocates a CUDA stream when built; the all-gather one builds and runs on
# CPU, and the parameters are the same (dispatchers hold none)
CPU = {"moe_token_dispatcher_type": "allgather"}


def _build(dims, hf_model, **kw):
    return build_gpt(dims, hf_config=hf_model.config, cpu_init=True, overrides=CPU if dims.is_moe else None, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_converted_names_and_shapes_are_megatrons(model_parallel, case):
    dims = CASES[case]
    hf_model, _ = build_model(dims, seed=2)
    mg = hf_to_megatron(hf_model.state_dict(), dims)
    model = _build(dims, hf_model)
    real = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert real == {k: tuple(v.shape) for k, v in mg.items()}
    load_hf_state(model, hf_model.state_dict(), dims)
    for k, v in model.state_dict().items():
        if not k.endswith("_extra_state"):
            assert torch.equal(v, mg[k]), k


@pytest.mark.parametrize("case", list(CASES))
def test_every_norm_is_the_engines_rmsnorm(model_parallel, case):
    """Layer, final and q/k (MLA: q/kv) norms are the engine's RMSNorm (torch's RMSNorm, tagged for
    sequence parallelism), never apex's FusedLayerNorm nor an IdentityOp where HF has a norm."""
    from megatron.core.transformer.identity_op import IdentityOp

    dims = CASES[case]
    hf_model, _ = build_model(dims, seed=2)
    model = _build(dims, hf_model)
    norms = {n: m for n, m in model.named_modules() if n.endswith(("layernorm", "norm"))}
    hf_norms = [k for k in hf_model.state_dict() if k.endswith(("norm.weight",))]
    assert sum(isinstance(m, RMSNorm) for m in norms.values()) == len(hf_norms)
    assert all(isinstance(m, (RMSNorm, IdentityOp)) for m in norms.values())
    if dims.is_mla:
        for i in range(dims.num_layers):
            att = model.decoder.layers[i].self_attention
            assert isinstance(att.q_layernorm, RMSNorm) and isinstance(att.kv_layernorm, RMSNorm)
            assert type(att.core_attention).__name__ == "MLADotProductAttention"


def test_apex_norm_in_megatrons_spec_is_replaced(model_parallel, monkeypatch):
    """Where apex imports, megatron's block spec takes apex's FusedLayerNorm for the final norm, which
    asserts LayerNorm; the engine's spec puts its RMSNorm there."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from rlrecipes.engines.megatron.layout import engine_config_kwargs
    from rlrecipes.engines.megatron.model import transformer_config

    monkeypatch.setattr(gpt_layer_specs, "LNImpl", FusedLayerNorm)  # as gpt_layer_specs sets it with apex
    dims = SMOKE["qwen2"]
    config = transformer_config(dims, engine_config_kwargs(dims, None, Ranks(), torch.float32), cpu_init=True)
    raw = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    assert raw.layer_norm is FusedLayerNorm
    with pytest.raises(AssertionError, match="RMSNorm.*not supported in FusedLayerNorm"):
        FusedLayerNorm(config=config, hidden_size=dims.hidden_size)
    spec = decoder_block_spec(config)
    assert spec.layer_norm is RMSNorm
    hf_model, _ = build_model(dims, seed=2)
    model = _build(dims, hf_model)
    assert isinstance(model.decoder.final_layernorm, RMSNorm)


def test_deepseek_dense_and_moe_layers_per_pipeline_stage(model_parallel):
    """DeepSeek's first_k_dense_replace dense layers are dense in megatron (moe_layer_freq through the
    decoder block spec), per pipeline stage: the smoke model whole and split (1, 2), and the full
    671B layout of the recipe (61 layers, 7,7,8,8,8,8,8,7: stage 0 holds the 3 dense layers)."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from rlrecipes.engines.megatron.layout import engine_config_kwargs
    from rlrecipes.engines.megatron.model import transformer_config
    from rlrecipes.models import PRESETS

    dims = SMOKE["deepseek_v3"]
    hf_model, _ = build_model(dims, seed=2)
    model = _build(dims, hf_model)
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    assert kinds == [MLP] * dims.first_k_dense + [MoELayer] * (dims.num_layers - dims.first_k_dense)

    def stage_kinds(d, pp_layers):
        r = Ranks(tp=1, pp_layers=pp_layers)
        config = transformer_config(d, engine_config_kwargs(d, None, r, torch.bfloat16), cpu_init=True)
        out = []
        for k in range(len(pp_layers)):
            spec = decoder_block_spec(config, pp_rank=k)
            out.append(["moe" if s.submodules.mlp.module is MoELayer else "dense" for s in spec.layer_specs])
        return out

    assert stage_kinds(dims, (1, 2)) == [["dense"], ["moe", "moe"]]
    full = stage_kinds(PRESETS["deepseek-v3-671b"], (7, 7, 8, 8, 8, 8, 8, 7))
    assert full[0] == ["dense"] * 3 + ["moe"] * 4 and all(k == ["moe"] * len(k) for k in full[1:])
    assert [len(k) for k in full] == [7, 7, 8, 8, 8, 8, 8, 7]


@pytest.mark.parametrize("case", list(CASES))
def test_engine_logprobs_equal_hf(model_parallel, case, random_seq_batch):
    """megatron's modules with the engine's rows (right-aligned, megatron's causal mask) and logit
    gather give the HF model's log-probs and entropies (fp32, CPU)."""
    dims = CASES[case]
    hf_model, _ = build_model(dims, seed=4)
    hf_model.eval()
    model = _build(dims, hf_model).eval()
    load_hf_state(model, hf_model.state_dict(), dims)
    batch = random_seq_batch(dims.vocab_size)
    got, ent = engine_logprobs(engine_pieces(model, dims, Ranks()), batch)
    want, went = hf_logprobs(hf_model, batch)
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-4
    assert max(float((a - b).abs().max()) for a, b in zip(ent, went)) < 1e-4
