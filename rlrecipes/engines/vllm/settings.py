"""Rollout inference settings rendered for the installed vllm-ascend version.

The recipe states *what* it wants (``rollout.inference``: NZ KV cache, MLA / MoE multistream,
graph mode, ...); this module says *how* a given vllm-ascend release spells it, as the
``additional_config`` dict passed to ``vllm.LLM(...)`` plus engine kwargs and environment.

Knob names by release line:

| vllm-ascend | graph mode | NZ KV cache | multistream |
|---|---|---|---|
| 0.9.1 - 0.10.x | ``torchair_graph_config.enabled`` | ``torchair_graph_config.enable_kv_nz`` | ``torchair_graph_config.enable_multistream_mla`` / ``enable_multistream_moe`` |
| 0.11.x | same torchair keys | same | MLA as above; MoE: top-level ``multistream_overlap_shared_expert`` |
| 0.12.x | torchair removed (ACL graph via ``enforce_eager=False``) | not available | MoE: ``multistream_overlap_shared_expert`` |
| >= 0.13 | ACL graph | top-level ``enable_kv_nz`` (MLA models, decode-only instances) | MoE: ``multistream_overlap_shared_expert`` |

A combination a version cannot do raises :class:`InferenceConfigError` naming the version and the
alternative; nothing is silently dropped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional


class InferenceConfigError(ValueError):
    pass


def parse_version(v: str) -> tuple[int, int, int]:
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", v)
    if not m:
        raise InferenceConfigError(f"cannot parse vllm-ascend version {v!r}; expected e.g. 0.11.0rc1")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed_vllm_ascend_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("vllm-ascend")
    except Exception:
        return None


@dataclass
class RenderedSettings:
    version: str
    additional_config: dict[str, Any] = field(default_factory=dict)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def render(settings, version: str, *, is_mla: bool) -> RenderedSettings:
    """Render ``rollout.inference`` (an InferenceSettings) for vllm-ascend ``version``."""
    ver = parse_version(version)
    out = RenderedSettings(version=version)
    out.engine_kwargs = {
        "max_num_seqs": settings.max_num_seqs,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enforce_eager": bool(settings.enforce_eager or not settings.graph_mode),
    }
    if settings.max_num_batched_tokens:
        out.engine_kwargs["max_num_batched_tokens"] = settings.max_num_batched_tokens
    nz = settings.kv_cache_format == "nz"
    if settings.graph_mode and settings.enforce_eager:
        raise InferenceConfigError("rollout.inference: graph_mode and enforce_eager are both true; pick one")

    if ver < (0, 9, 1):
        raise InferenceConfigError(f"vllm-ascend {version} is older than 0.9.1, the first release rlrecipes supports; upgrade")
    if ver < (0, 12, 0):  # torchair era
        tg: dict[str, Any] = {"enabled": bool(settings.graph_mode)}
        if nz or settings.multistream_mla:
            if not settings.graph_mode:
                raise InferenceConfigError(
                    f"vllm-ascend {version}: kv_cache_format=nz and multistream_mla need torchair graph mode; "
                    "set rollout.inference.graph_mode=true")
            if not is_mla:
                raise InferenceConfigError(
                    f"vllm-ascend {version}: the NZ KV cache and MLA multistream apply to MLA models (DeepSeek) only; "
                    "set kv_cache_format=nd, multistream_mla=false")
        if nz:
            tg["enable_kv_nz"] = True
        if settings.multistream_mla:
            tg["enable_multistream_mla"] = True
        if settings.multistream_moe:
            if ver < (0, 11, 0):
                if not settings.graph_mode:
                    raise InferenceConfigError(f"vllm-ascend {version}: multistream_moe needs torchair graph mode")
                tg["enable_multistream_moe"] = True
            else:
                out.additional_config["multistream_overlap_shared_expert"] = True
        out.additional_config["torchair_graph_config"] = tg
        return out
    # 0.12+: torchair removed
    if settings.multistream_mla:
        raise InferenceConfigError(
            f"vllm-ascend {version} removed torchair and its enable_multistream_mla; set multistream_mla=false "
            "or use vllm-ascend 0.9.1-0.11.x")
    if settings.multistream_moe:
        out.additional_config["multistream_overlap_shared_expert"] = True
    if nz:
        if ver < (0, 13, 0):
            raise InferenceConfigError(
                f"vllm-ascend {version} has no NZ KV cache (torchair removed, enable_kv_nz came back in 0.13); "
                "use kv_cache_format=nd, or vllm-ascend 0.11.x (torchair) / >= 0.13")
        if not is_mla:
            raise InferenceConfigError(f"vllm-ascend {version}: enable_kv_nz supports MLA models only; use kv_cache_format=nd")
        if not settings.decode_only:
            raise InferenceConfigError(
                f"vllm-ascend {version}: enable_kv_nz is for decode-only instances; set rollout.inference.decode_only=true "
                "(disaggregated prefill/decode) or kv_cache_format=nd")
        out.additional_config["enable_kv_nz"] = True
    return out
