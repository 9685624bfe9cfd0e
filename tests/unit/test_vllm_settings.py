import pytest

from rlrecipes.engines.vllm.settings import InferenceConfigError, parse_version, render
from rlrecipes.recipe import InferenceSettings, load_recipe


def S(**kw):
    return InferenceSettings(**kw)


def test_deepseek_recipe_on_torchair_versions():
    inf = load_recipe("deepseek_r1_671b").rollout.inference
    r = render(inf, "0.9.1", is_mla=True)
    assert r.additional_config["torchair_graph_config"] == {
        "enabled": True, "enable_kv_nz": True, "enable_multistream_mla": True, "enable_multistream_moe": True}
    assert r.engine_kwargs["enforce_eager"] is False and r.engine_kwargs["gpu_memory_utilization"] == 0.85
    r = render(inf, "0.11.0rc1", is_mla=True)
    assert r.additional_config["multistream_overlap_shared_expert"] is True
    assert "enable_multistream_moe" not in r.additional_config["torchair_graph_config"]


def test_v012_rejects_torchair_only_knobs_with_alternative():
    with pytest.raises(InferenceConfigError, match="0.12.0.*multistream_mla"):
        render(S(multistream_mla=True, graph_mode=True), "0.12.0", is_mla=True)
    with pytest.raises(InferenceConfigError, match="no NZ KV cache"):
        render(S(kv_cache_format="nz"), "0.12.0", is_mla=True)


def test_v013_plus_nz_refused_in_colocated_rl():
    for v in ("0.13.0", "0.18.0", "0.23.0rc1"):
        with pytest.raises(InferenceConfigError, match="KV-consumer.*kv_cache_format=nd"):
            render(S(kv_cache_format="nz"), v, is_mla=True)


def test_acl_graph_npugraph_ex_and_weight_nz_by_version():
    r = render(S(graph_mode=True, multistream_moe=True), "0.13.0", is_mla=False)
    assert r.engine_kwargs["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert "ascend_compilation_config" not in r.additional_config and "torchair_graph_config" not in r.additional_config
    assert r.additional_config["multistream_overlap_shared_expert"] is True and r.env == {"VLLM_ASCEND_ENABLE_NZ": "0"}
    r = render(S(graph_mode=True), "0.15.0rc1", is_mla=False)
    assert r.additional_config["ascend_compilation_config"] == {"enable_npugraph_ex": True}
    r = render(S(graph_mode=True), "0.23.0", is_mla=True)
    assert r.additional_config["weight_nz_mode"] == 0 and not r.env
    with pytest.raises(InferenceConfigError, match="newer than 0.23.x"):
        render(S(), "0.24.0", is_mla=False)


def test_torchair_nz_needs_graph_and_mla():
    with pytest.raises(InferenceConfigError, match="graph mode"):
        render(S(kv_cache_format="nz", graph_mode=False), "0.10.0", is_mla=True)
    with pytest.raises(InferenceConfigError, match="MLA"):
        render(S(kv_cache_format="nz", graph_mode=True), "0.10.0", is_mla=False)


def test_versions():
    assert parse_version("v0.11.0rc1") == (0, 11, 0)
    with pytest.raises(InferenceConfigError):
        parse_version("latest")
    with pytest.raises(InferenceConfigError, match="older than 0.9.1"):
        render(S(), "0.8.5", is_mla=False)
