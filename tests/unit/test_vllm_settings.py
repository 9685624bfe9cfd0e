"""vllm-ascend settings per release line. Each test names the upstream file (vllm-ascend repository,
at the tags listed) whose rule its branch encodes; docs/upstream_contracts.md has the lines."""
import pytest

from rlrecipes.engines.vllm.settings import (LAST_CHECKED, InferenceConfigError, parse_version, render,
                                             torchair_models)
from rlrecipes.recipe import InferenceSettings, load_recipe


def S(**kw):
    return InferenceSettings(**kw)


def test_deepseek_recipe_on_torchair_versions():
    """vllm_ascend/ascend_config.py @ v0.9.1, v0.10.2rc1 (TorchairGraphConfig keys: enabled,
    enable_kv_nz, enable_multistream_mla, enable_multistream_moe) and @ v0.11.0 (enable_multistream_moe
    gone; top-level multistream_overlap_shared_expert)."""
    # the DeepSeek recipe's torchair settings as they were pinned before the recipe moved to 0.23 (the
    # torchair lines need transformers < 5: engines/vllm/args.stack_problem); the rendering rule stays
    inf = load_recipe("deepseek_r1_671b", overrides=[
        "rollout.inference.kv_cache_format=nz", "rollout.inference.multistream_mla=true",
        "rollout.inference.vllm_ascend_version=0.9.1"]).rollout.inference
    for v in ("0.9.1", "0.10.2rc1"):
        r = render(inf, v, is_mla=True, model_type="deepseek_v3")
        assert r.additional_config["torchair_graph_config"] == {
            "enabled": True, "enable_kv_nz": True, "enable_multistream_mla": True, "enable_multistream_moe": True}
        assert r.engine_kwargs["enforce_eager"] is False and r.engine_kwargs["gpu_memory_utilization"] == 0.85
        assert not r.env  # VLLM_ASCEND_ENABLE_NZ does not exist before 0.11.0rc1 (vllm_ascend/envs.py)
    r = render(inf, "0.11.0rc1", is_mla=True)
    assert r.additional_config["multistream_overlap_shared_expert"] is True
    assert "enable_multistream_moe" not in r.additional_config["torchair_graph_config"]


def test_torchair_only_for_deepseek_qwen_gets_acl_graph_on_091_to_011():
    """vllm_ascend/ascend_config.py check_ascend_config @ v0.9.1 ("Torchair graph mode only works with
    deepseek model"), @ v0.9.2rc1 / v0.10.0rc1 (TORCHAIR_MODEL_LIST without qwen; "ACL Graph does not
    support deepseek"), @ v0.10.1rc1 .. v0.11.0 (qwen added): graph mode for Qwen renders ACL graph
    (torchair off, enforce_eager False), which every one of these accepts for qwen model types."""
    inf = load_recipe("qwen25_7b").rollout.inference
    assert inf.graph_mode
    for v in ("0.9.1", "0.9.2rc1", "0.10.0rc1", "0.10.2rc1", "0.11.0"):
        r = render(inf, v, is_mla=False, model_type="qwen2")
        assert r.additional_config["torchair_graph_config"] == {"enabled": False}, v
        assert r.engine_kwargs["enforce_eager"] is False and "compilation_config" not in r.engine_kwargs
    assert torchair_models((0, 9, 1)) == ("deepseek",) and "qwen" in torchair_models((0, 10, 1))
    # an MLA model torchair does not list cannot take graph mode there (ACL graph refuses DeepSeek-style MLA)
    with pytest.raises(InferenceConfigError, match="torchair graph mode takes only"):
        render(S(graph_mode=True), "0.9.1", is_mla=True, model_type="kimi_k2")
    # torchair's MoE multistream is DeepSeek-only; without torchair it is refused, not dropped
    with pytest.raises(InferenceConfigError, match="enable_multistream_moe"):
        render(S(graph_mode=True, multistream_moe=True), "0.9.1", is_mla=False, model_type="qwen3_moe")


def test_v011_sets_nz_env_for_wake_up():
    """vllm_ascend/worker/worker_v1.py NPUWorker.wake_up @ v0.11.0rc1 .. v0.11.0 raises "FRACTAL_NZ mode
    is enabled ... Please set VLLM_ASCEND_ENABLE_NZ=0" when is_enable_nz() (vllm_ascend/utils.py; env
    default 1, vllm_ascend/envs.py)."""
    for v in ("0.11.0rc1", "0.11.0"):
        assert render(S(graph_mode=True), v, is_mla=False).env == {"VLLM_ASCEND_ENABLE_NZ": "0"}


def test_torchair_nz_needs_graph_and_mla():
    """vllm_ascend/ascend_config.py TorchairGraphConfig @ v0.9.1 .. v0.11.0: enable_kv_nz /
    enable_multistream_mla raise RuntimeError unless torchair is enabled; both are MLA-only."""
    with pytest.raises(InferenceConfigError, match="graph mode"):
        render(S(kv_cache_format="nz", graph_mode=False), "0.10.0", is_mla=True)
    with pytest.raises(InferenceConfigError, match="MLA"):
        render(S(kv_cache_format="nz", graph_mode=True), "0.10.0", is_mla=False)


def test_v012_rejects_torchair_only_knobs_with_alternative():
    """vllm_ascend/ascend_config.py @ v0.12.0rc1: no TorchairGraphConfig, no enable_kv_nz, and
    enable_npugraph_ex raises NotImplementedError ("still in the experiment"), so none is emitted."""
    with pytest.raises(InferenceConfigError, match="0.12.0.*multistream_mla"):
        render(S(multistream_mla=True, graph_mode=True), "0.12.0", is_mla=True)
    with pytest.raises(InferenceConfigError, match="no NZ KV cache"):
        render(S(kv_cache_format="nz"), "0.12.0", is_mla=True)
    r = render(S(graph_mode=True, multistream_moe=True), "0.12.0rc1", is_mla=False)
    assert r.engine_kwargs["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert r.additional_config == {"multistream_overlap_shared_expert": True}
    assert r.env == {"VLLM_ASCEND_ENABLE_NZ": "0"}  # vllm_ascend/worker/worker_v1.py wake_up @ v0.12.0rc1


def test_v013_plus_nz_refused_in_colocated_rl():
    """vllm_ascend/ascend_config.py @ v0.13.0 .. v0.25.1rc1: enable_kv_nz raises unless the model is
    DeepSeek MLA and kv_transfer_config.is_kv_consumer."""
    for v in ("0.13.0", "0.18.0", "0.23.0rc1", "0.25.1rc1"):
        with pytest.raises(InferenceConfigError, match="KV-consumer.*kv_cache_format=nd"):
            render(S(kv_cache_format="nz"), v, is_mla=True)


def test_v013_npugraph_ex_top_level():
    """vllm_ascend/ascend_config.py @ v0.13.0: additional_config["enable_npugraph_ex"] (default False)."""
    r = render(S(graph_mode=True, multistream_moe=True), "0.13.0", is_mla=False)
    assert r.engine_kwargs["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert r.additional_config == {"enable_npugraph_ex": True, "multistream_overlap_shared_expert": True}
    assert r.env == {"VLLM_ASCEND_ENABLE_NZ": "0"}  # vllm_ascend/worker/worker.py wake_up @ v0.13.0


def test_v014_v015_npugraph_ex_config():
    """vllm_ascend/ascend_config.py @ v0.14.0rc1, v0.15.0rc1: additional_config["npugraph_ex_config"]
    -> NpugraphExConfig(enable=...)."""
    for v in ("0.14.0rc1", "0.15.0rc1"):
        r = render(S(graph_mode=True), v, is_mla=False)
        assert r.additional_config == {"npugraph_ex_config": {"enable": True}}, v
        assert "ascend_compilation_config" not in r.additional_config


def test_v016_to_v019_ascend_compilation_config_and_nz_env():
    """vllm_ascend/ascend_config.py @ v0.16.0rc1 .. v0.19.1rc1: AscendCompilationConfig(enable_npugraph_ex);
    the NZ switch is still the env var (vllm_ascend/worker/worker.py wake_up)."""
    for v in ("0.16.0rc1", "0.18.0", "0.19.1rc1"):
        r = render(S(graph_mode=True), v, is_mla=False)
        assert r.additional_config == {"ascend_compilation_config": {"enable_npugraph_ex": True}}, v
        assert r.env == {"VLLM_ASCEND_ENABLE_NZ": "0"}


def test_v020_to_v025_weight_nz_mode():
    """vllm_ascend/ascend_config.py @ v0.20.2rc1 .. v0.25.1rc1: weight_nz_mode (additional_config, falls back
    to VLLM_ASCEND_ENABLE_NZ); vllm_ascend/worker/worker.py wake_up raises unless it is 0."""
    for v in ("0.20.2rc1", "0.23.0", "0.24.0rc1", "0.25.1rc1"):
        r = render(S(graph_mode=True), v, is_mla=True)
        assert r.additional_config == {"ascend_compilation_config": {"enable_npugraph_ex": True},
                                       "weight_nz_mode": 0}, v
        assert not r.env
    r = render(S(), "0.23.0", is_mla=False)
    assert r.engine_kwargs["enforce_eager"] is True and "compilation_config" not in r.engine_kwargs


def test_versions():
    assert parse_version("v0.11.0rc1") == (0, 11, 0)
    assert LAST_CHECKED[:2] == (0, 25)
    with pytest.raises(InferenceConfigError):
        parse_version("latest")
    with pytest.raises(InferenceConfigError, match="older than 0.9.1"):
        render(S(), "0.8.5", is_mla=False)
    with pytest.raises(InferenceConfigError, match="newer than 0.25.x"):
        render(S(), "0.26.0", is_mla=False)
    with pytest.raises(InferenceConfigError, match="pick one"):
        render(S(graph_mode=True, enforce_eager=True), "0.23.0", is_mla=False)
