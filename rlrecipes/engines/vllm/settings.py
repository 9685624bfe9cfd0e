"""Rollout inference settings rendered for the installed vllm-ascend version.

The recipe states *what* it wants (``rollout.inference``: NZ KV cache, MLA / MoE multistream,
graph mode, ...); this module says *how* a given vllm-ascend release spells it, as the
``additional_config`` dict passed to ``vllm.LLM(...)`` plus engine kwargs and environment.

Knob names by release line (vllm-ascend 0.23.x pairs with vLLM 0.23, torch 2.10, torch_npu 2.10.0.post2+):

| vllm-ascend | graph mode | NZ KV cache | multistream | weights reloaded every step |
|---|---|---|---|---|
| 0.9.1 - 0.10.x | ``torchair_graph_config.enabled`` | ``torchair_graph_config.enable_kv_nz`` | ``torchair_graph_config.enable_multistream_mla`` / ``enable_multistream_moe`` | - |
| 0.11.x | same torchair keys | same | MLA as above; MoE: top-level ``multistream_overlap_shared_expert`` | - |
| 0.12 - 0.14 | ACLGraph: ``compilation_config.cudagraph_mode`` (torchair removed) | none in 0.12 | MoE: ``multistream_overlap_shared_expert`` | env ``VLLM_ASCEND_ENABLE_NZ=0`` |
| 0.15 - 0.19 | + ``ascend_compilation_config.enable_npugraph_ex`` | top-level ``enable_kv_nz`` (0.13+): MLA only, KV-consumer instances only | same | env ``VLLM_ASCEND_ENABLE_NZ=0`` |
| 0.20 - 0.23 | same | same | same | ``additional_config.weight_nz_mode = 0`` |

``enable_kv_nz`` on 0.13+ needs a KV-consumer (decode node) ``kv_transfer_config``, which a
colocated RL rollout does not have, so ``kv_cache_format: nz`` there is an error. vllm-ascend
silently ignores ``additional_config`` keys it does not know (the old ``torchair_graph_config``
on 0.12+), so this module never emits a key the target version lacks. Versions after the last one
checked here are an error too, until their knobs are checked and added.

A combination a version cannot do raises :class:`InferenceConfigError` naming the version and the
alternative; nothing is silently dropped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional


class InferenceConfigError(ValueError):
    pass


#: the newest vllm-ascend release line whose knobs are mapped here
LAST_CHECKED = (0, 23, 99)


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
    # 0.12+: torchair removed, ACLGraph
    if ver > LAST_CHECKED:
        raise InferenceConfigError(
            f"vllm-ascend {version} is newer than {'.'.join(map(str, LAST_CHECKED[:2]))}.x, the last release whose knobs "
            "rlrecipes checks; pin rollout.inference.vllm_ascend_version to it, or add the release to "
            "rlrecipes/engines/vllm/settings.py")
    if settings.multistream_mla:
        raise InferenceConfigError(
            f"vllm-ascend {version} removed torchair and its enable_multistream_mla; set multistream_mla=false "
            "or use vllm-ascend 0.9.1-0.11.x")
    if settings.graph_mode:
        out.engine_kwargs["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY"}
        if ver >= (0, 15, 0):
            out.additional_config["ascend_compilation_config"] = {"enable_npugraph_ex": True}
    if settings.multistream_moe:
        out.additional_config["multistream_overlap_shared_expert"] = True
    if nz:
        if ver < (0, 13, 0):
            raise InferenceConfigError(
                f"vllm-ascend {version} has no NZ KV cache (torchair removed, enable_kv_nz came back in 0.13); "
                "use kv_cache_format=nd, or vllm-ascend 0.9.1-0.11.x (torchair)")
        raise InferenceConfigError(
            f"vllm-ascend {version}: enable_kv_nz is MLA-only and needs a KV-consumer (decode node) kv_transfer_config, "
            "which a colocated RL rollout does not have; use kv_cache_format=nd, or vllm-ascend 0.9.1-0.11.x "
            "(torchair NZ KV cache)")
    # weights are reloaded every step: keep them ND (an NZ weight cast would run at every reload)
    if ver >= (0, 20, 0):
        out.additional_config["weight_nz_mode"] = 0
    else:
        out.env["VLLM_ASCEND_ENABLE_NZ"] = "0"
    return out
