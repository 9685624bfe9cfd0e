"""megatron-core tier: the configs the engine builds for each shipped recipe's planned actor layout,
at FULL size, constructed by megatron-core itself (``TransformerConfig`` / ``MLATransformerConfig``,
``OptimizerConfig``, ``DistributedDataParallelConfig``: their ``__post_init__`` checks run; no device
or process group needed), from the same pure functions the engine calls (layout.py). Skipped where
megatron-core is not installed."""
import importlib.util

import pytest
import torch

pytest.importorskip("megatron.core")

from rlrecipes.engines.megatron.layout import (ddp_config_kwargs, engine_config_kwargs,  # noqa: E402
                                               layout_problems, optimizer_config_kwargs)
from rlrecipes.engines.megatron.shard import Ranks  # noqa: E402

pytestmark = pytest.mark.megatron

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

# the published DeepSeek-V3 / R1 config.json routing and RoPE (rlrecipes.models.hf_config keeps the
# HF class defaults for these; vLLM and the engine read them from the checkpoint's config.json)
DEEPSEEK_CONFIG = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                   "rope_theta": 10000, "rms_norm_eps": 1e-6,
                   "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}


def _planned_actor(name, nodes):
    from rlrecipes.models import hf_config
    from rlrecipes.plan import build_plan
    from rlrecipes.recipe.loading import load_recipe

    recipe = load_recipe(name)
    a = build_plan(recipe, nodes).roles["actor"]
    dims = recipe.model.dims()
    hf = hf_config(dims).to_dict()
    if dims.family == "deepseek_v3":
        hf.update(DEEPSEEK_CONFIG)
    return recipe, dims, hf, Ranks(tp=a.tp, pp_layers=tuple(a.pp_layers or ()) if a.pp > 1 else (), ep=a.ep,
                                   etp=a.tp)


RECIPES = [("qwen25_7b", None), ("qwen3_moe_30b", None), ("deepseek_r1_671b", 48)]


@pytest.mark.parametrize("name,nodes", RECIPES)
def test_full_size_transformer_config_of_each_recipe(name, nodes):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    recipe, dims, hf, r = _planned_actor(name, nodes)
    kw = engine_config_kwargs(dims, hf, r, torch.bfloat16, recompute=recipe.actor.recompute)
    config = (MLATransformerConfig if dims.is_mla else TransformerConfig)(**kw)
    assert config.sequence_parallel and config.tensor_model_parallel_size == r.tp
    assert config.expert_tensor_parallel_size == r.tp and config.recompute_granularity == "full"
    if r.pp > 1:
        assert isinstance(config.pipeline_model_parallel_layout, PipelineParallelLayerLayout)
    if dims.is_moe:
        assert config.moe_token_dispatcher_type == "alltoall" and config.num_moe_experts == dims.num_experts
    if dims.is_mla:
        assert config.qk_layernorm and config.kv_channels == dims.v_head_dim == config.v_head_dim
        assert config.rope_type == "yarn" and config.rotary_scaling_factor == 40
        assert config.moe_router_num_groups == 8 and config.moe_router_group_topk == 4
        assert config.moe_router_topk_scaling_factor == 2.5 and config.moe_router_score_function == "sigmoid"
        assert config.moe_layer_freq[:4] == [0, 0, 0, 1]


@pytest.mark.parametrize("name,nodes", RECIPES)
def test_optimizer_and_ddp_config_of_each_recipe(name, nodes):
    """The engine's OptimizerConfig for the recipe. The DeepSeek recipe offloads the optimizer: the
    host optimizer needs the precision-aware path, whose config check reads TransformerEngine's
    version; megatron-core 0.16.1 fails there without TE, which ``layout_problems`` names."""
    import megatron.core as mc
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    recipe, dims, _hf, r = _planned_actor(name, nodes)
    DistributedDataParallelConfig(**ddp_config_kwargs())
    kw = optimizer_config_kwargs(lr=1e-6, weight_decay=0.01, grad_clip=1.0, dtype=torch.bfloat16,
                                 offload=recipe.actor.offload_optimizer)
    problems = layout_problems(dims, tp=r.tp, pp=r.pp, ep=r.ep, etp=r.etp, device="cuda", have_te=HAVE_TE,
                               have_mindspeed=False, pp_layers=r.pp_layers or None,
                               offload_optimizer=recipe.actor.offload_optimizer, megatron_core=mc.__version__)
    if problems:
        assert recipe.actor.offload_optimizer and any("offload_optimizer" in p for p in problems)
        with pytest.raises(TypeError):  # megatron-core 0.16.1: None >= Version("2.1.0")
            OptimizerConfig(**kw)
    else:
        cfg = OptimizerConfig(**kw)
        assert cfg.use_distributed_optimizer and cfg.bf16
        if recipe.actor.offload_optimizer:
            assert cfg.optimizer_cpu_offload and cfg.optimizer_offload_fraction == 1.0


def test_fp16_optimizer_config_has_the_dynamic_loss_scaler():
    from megatron.core.optimizer import OptimizerConfig

    cfg = OptimizerConfig(**optimizer_config_kwargs(lr=1e-6, weight_decay=0.0, grad_clip=1.0, dtype=torch.float16,
                                                    offload=False))
    assert cfg.fp16 and cfg.loss_scale is None and cfg.initial_loss_scale == 2.0 ** 16


def test_mindspeed_must_come_before_any_megatron_import():
    """device._import_mindspeed refuses once megatron is imported (MindSpeed patches megatron's import-time
    bindings: HAVE_TE, the norm class, the jit fuser), before it needs torch_npu."""
    import megatron.core  # noqa: F401

    from rlrecipes import device as dev

    with pytest.raises(RuntimeError, match="before MindSpeed's adaptor"):
        dev._import_mindspeed()
