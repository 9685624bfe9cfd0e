"""megatron-core tier (its own venv: bash scripts/setup_megatron_cpu.sh): the modules megatron-core
really builds (on CPU, use_cpu_initialization) have exactly the names and shapes the converter
produces, and converted HF weights load into them. Skipped where megatron-core is not installed."""
import dataclasses

import pytest
import torch

megatron = pytest.importorskip("megatron.core")

from rlrecipes.engines.megatron.convert import hf_to_megatron  # noqa: E402
from rlrecipes.engines.megatron.model import build_gpt, load_hf_state  # noqa: E402
from rlrecipes.engines.native.loader import build_model  # noqa: E402
from rlrecipes.models import SMOKE  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def model_parallel(one_rank_group):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


CASES = {"qwen2": SMOKE["qwen2"], "qwen2_tied": dataclasses.replace(SMOKE["qwen2"], tie_embeddings=True),
         "qwen3_moe": SMOKE["qwen3_moe"]}


@pytest.mark.parametrize("case", list(CASES))
def test_converted_names_and_shapes_are_megatrons(model_parallel, case):
    dims = CASES[case]
    hf_model, _ = build_model(dims, seed=2)
    mg = hf_to_megatron(hf_model.state_dict(), dims)
    # the all-to-all dispatcher allocates a CUDA stream when built; the all-gather one builds on
    # CPU and the parameters are the same (dispatchers hold none)
    model = build_gpt(dims, hf_config=hf_model.config, cpu_init=True, **({"moe_token_dispatcher_type": "allgather"} if dims.is_moe else {}))
    real = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert real == {k: tuple(v.shape) for k, v in mg.items()}
    load_hf_state(model, hf_model.state_dict(), dims)
    for k, v in model.state_dict().items():
        if not k.endswith("_extra_state"):
            assert torch.equal(v, mg[k]), k


def test_mla_needs_transformer_engine_attention_in_this_release(model_parallel):
    """DeepSeek-V3's MLA does not build with megatron-core's local attention (it needs
    TransformerEngine on CUDA, MindSpeed's on Ascend): the converter's MLA names are checked
    against megatron's module attributes instead."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    fields = {f.name for f in dataclasses.fields(MLASelfAttentionSubmodules)}
    model, dims = build_model(SMOKE["deepseek_v3"], seed=2)
    names = {k.split(".")[4] for k in hf_to_megatron(model.state_dict(), dims) if ".self_attention." in k}
    assert names - {"q_layernorm", "kv_layernorm"} <= fields and {"q_layernorm", "kv_layernorm"} <= fields
