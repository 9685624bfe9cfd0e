"""Rollout inference settings rendered for the installed vllm-ascend version.

The recipe states *what* it wants (``rollout.inference``: NZ KV cache, MLA / MoE multistream,
graph mode, ...); this module says *how* a given vllm-ascend release spells it, as the
``additional_config`` dict passed to ``vllm.LLM(...)`` plus engine kwargs and environment.
vllm-ascend vX.Y pairs with vLLM vX.Y (its ``docs/source/community/versioning_policy.md``).

Every branch below encodes a rule read in vllm-ascend's source at its tags (paths relative to the
vllm-ascend repository; ``docs/upstream_contracts.md`` has the lines):

| vllm-ascend | graph mode (``graph_mode: true``) | NZ KV cache | MoE multistream | weights reloaded every step |
|---|---|---|---|---|
| 0.9.1 - 0.10.x | DeepSeek (MLA): ``torchair_graph_config.enabled``; other models: ACL graph (torchair off, ``enforce_eager=False``) -- torchair raises for models outside its list (``ascend_config.py``) | ``torchair_graph_config.enable_kv_nz`` (MLA, torchair) | ``torchair_graph_config.enable_multistream_moe`` (torchair, DeepSeek) | - |
| 0.11.x | same | same | top-level ``multistream_overlap_shared_expert`` | env ``VLLM_ASCEND_ENABLE_NZ=0`` (``wake_up`` raises otherwise) |
| 0.12 | ACLGraph: ``compilation_config.cudagraph_mode`` (torchair removed; ``enable_npugraph_ex`` raises) | none | same | env ``VLLM_ASCEND_ENABLE_NZ=0`` |
| 0.13 | + top-level ``enable_npugraph_ex`` | ``enable_kv_nz``: MLA, KV-consumer only | same | same |
| 0.14 - 0.15 | + ``npugraph_ex_config.enable`` | same | same | same |
| 0.16 - 0.19 | + ``ascend_compilation_config.enable_npugraph_ex`` | same | same | same |
| 0.20 - 0.25 | same | same | same | ``additional_config.weight_nz_mode = 0`` |

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


#: the newest vllm-ascend release line whose knobs are mapped here (tags up to v0.25.1rc1 read)
LAST_CHECKED = (0, 25, 99)
#: the oldest release rlrecipes renders for
FIRST_SUPPORTED = (0, 9, 1)


def parse_version(v: str) -> tuple[int, int, int]:
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(v))
    if not m:
        raise InferenceConfigError(f"cannot parse vllm-ascend version {v!r}; expected e.g. 0.11.0rc1")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed_vllm_ascend_version() -> Optional[str]:
    try:
        from importlib.metadata import version

        return version("vllm-ascend")
    except Exception:
        return None


def torchair_models(ver: tuple[int, int, int]) -> tuple[str, ...]:
    """Model types torchair graph mode accepts (``check_ascend_config`` raises NotImplementedError for
    the others): ``"deepseek" in model_type`` on 0.9.1; ``TORCHAIR_MODEL_LIST`` from 0.9.2rc1."""
    if ver < (0, 9, 2):
        return ("deepseek",)
    if ver < (0, 10, 0):
        return ("deepseek", "pangu")
    if ver < (0, 10, 1):
        return ("deepseek", "pangu", "kimi_k2")
    return ("deepseek", "pangu", "kimi_k2", "qwen")


def _model_type(model_type: Optional[str], is_mla: bool) -> str:
    # the families rlrecipes ships: deepseek_v3 is the MLA one
    return (model_type or ("deepseek_v3" if is_mla else "qwen2")).lower()


#: the vllm-ascend release the ``ascend`` extra pins (pyproject.toml); used when the recipe pins none
#: and none is installed (``plan`` on a machine without NPUs)
ASCEND_PIN = "0.23.0"


def ascend_version(inference=None, installed: Optional[str] = None) -> str:
    """The vllm-ascend release to render for: the recipe's pin, else the installed one, else the
    ``ascend`` extra's pin. A pin whose release line differs from the installed one is an error
    (the knobs of one line are silently ignored by another)."""
    pinned = getattr(inference, "vllm_ascend_version", None) if inference is not None else None
    if pinned and installed and parse_version(pinned)[:2] != parse_version(installed)[:2]:
        raise InferenceConfigError(
            f"rollout.inference.vllm_ascend_version={pinned} but vllm-ascend {installed} is installed; install "
            f"{pinned} or pin {installed} (knob names differ by release, see rlrecipes/engines/vllm/settings.py)")
    return pinned or installed or ASCEND_PIN


@dataclass
class RenderedSettings:
    version: str
    additional_config: dict[str, Any] = field(default_factory=dict)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def render(settings, version: str, *, is_mla: bool, model_type: Optional[str] = None) -> RenderedSettings:
    """Render ``rollout.inference`` (an InferenceSettings) for vllm-ascend ``version``.

    ``model_type``: the HF ``model_type`` (torchair takes only some); None: ``deepseek_v3`` for an
    MLA model, else a Qwen type (the families rlrecipes ships).
    """
    ver = parse_version(version)
    mtype = _model_type(model_type, is_mla)
    deepseek = "deepseek" in mtype
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

    if ver < FIRST_SUPPORTED:
        raise InferenceConfigError(f"vllm-ascend {version} is older than 0.9.1, the first release rlrecipes supports; upgrade")
    if ver > LAST_CHECKED:
        raise InferenceConfigError(
            f"vllm-ascend {version} is newer than {'.'.join(map(str, LAST_CHECKED[:2]))}.x, the last release whose knobs "
            "rlrecipes checks; pin rollout.inference.vllm_ascend_version to it, or add the release to "
            "rlrecipes/engines/vllm/settings.py")
    if ver < (0, 12, 0):
        _render_torchair_era(settings, version, ver, mtype, deepseek, is_mla, nz, out)
        return out
    _render_aclgraph_era(settings, version, ver, nz, out)
    return out


def _render_torchair_era(settings, version, ver, mtype, deepseek, is_mla, nz, out) -> None:
    """0.9.1 - 0.11.x: torchair graph mode (MLA models) or ACL graph (the others)."""
    if settings.graph_mode and is_mla and not any(m in mtype for m in torchair_models(ver)):
        raise InferenceConfigError(
            f"vllm-ascend {version}: torchair graph mode takes only {list(torchair_models(ver))} model types, not "
            f"{mtype!r}, and ACL graph does not serve MLA; set rollout.inference.graph_mode=false")
    # torchair for DeepSeek (MLA); ACL graph for the others: torchair raises "Torchair graph mode only
    # works with deepseek model" for them on 0.9.1 (and outside TORCHAIR_MODEL_LIST later), while ACL
    # graph raises for DeepSeek up to 0.10.x ("ACL Graph does not support deepseek")
    torchair = bool(settings.graph_mode and deepseek)
    tg: dict[str, Any] = {"enabled": torchair}
    if nz or settings.multistream_mla:
        if not is_mla:
            raise InferenceConfigError(
                f"vllm-ascend {version}: the NZ KV cache and MLA multistream apply to MLA models (DeepSeek) only; "
                "set kv_cache_format=nd, multistream_mla=false")
        if not torchair:
            raise InferenceConfigError(
                f"vllm-ascend {version}: kv_cache_format=nz and multistream_mla need torchair graph mode "
                "(enable_kv_nz / enable_multistream_mla raise without it); set rollout.inference.graph_mode=true")
    if nz:
        tg["enable_kv_nz"] = True
    if settings.multistream_mla:
        tg["enable_multistream_mla"] = True
    if settings.multistream_moe:
        if ver < (0, 11, 0):
            if not torchair:
                raise InferenceConfigError(
                    f"vllm-ascend {version}: multistream_moe is torchair's enable_multistream_moe, which needs torchair "
                    "graph mode and a DeepSeek MoE model; set multistream_moe=false, or use vllm-ascend >= 0.11 "
                    "(multistream_overlap_shared_expert)")
            tg["enable_multistream_moe"] = True
        else:
            out.additional_config["multistream_overlap_shared_expert"] = True
    out.additional_config["torchair_graph_config"] = tg
    if ver >= (0, 11, 0):
        # 0.11.0rc1 - 0.11.x: NPUWorker.wake_up raises unless VLLM_ASCEND_ENABLE_NZ=0 (default 1)
        out.env["VLLM_ASCEND_ENABLE_NZ"] = "0"


def _render_aclgraph_era(settings, version, ver, nz, out) -> None:
    """0.12+: torchair removed; ACLGraph through vLLM's compilation_config."""
    if settings.multistream_mla:
        raise InferenceConfigError(
            f"vllm-ascend {version} removed torchair and its enable_multistream_mla; set multistream_mla=false "
            "or use vllm-ascend 0.9.1-0.11.x")
    if nz:
        if ver < (0, 13, 0):
            raise InferenceConfigError(
                f"vllm-ascend {version} has no NZ KV cache (torchair removed, enable_kv_nz came back in 0.13); "
                "use kv_cache_format=nd, or vllm-ascend 0.9.1-0.11.x (torchair)")
        raise InferenceConfigError(
            f"vllm-ascend {version}: enable_kv_nz is MLA-only and needs a KV-consumer (decode node) kv_transfer_config, "
            "which a colocated RL rollout does not have; use kv_cache_format=nd, or vllm-ascend 0.9.1-0.11.x "
            "(torchair NZ KV cache)")
    if settings.graph_mode:
        out.engine_kwargs["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY"}
        # npugraph_ex: 0.12 raises NotImplementedError when it is on; its key moved twice
        if (0, 13, 0) <= ver < (0, 14, 0):
            out.additional_config["enable_npugraph_ex"] = True
        elif (0, 14, 0) <= ver < (0, 16, 0):
            out.additional_config["npugraph_ex_config"] = {"enable": True}
        elif ver >= (0, 16, 0):
            out.additional_config["ascend_compilation_config"] = {"enable_npugraph_ex": True}
    if settings.multistream_moe:
        out.additional_config["multistream_overlap_shared_expert"] = True
    # weights are reloaded every step: keep them ND (wake_up raises while weight NZ is on)
    if ver >= (0, 20, 0):
        out.additional_config["weight_nz_mode"] = 0
    else:
        out.env["VLLM_ASCEND_ENABLE_NZ"] = "0"


def plan_settings(*, inference, dims) -> tuple[Optional[dict], list[str]]:
    """``Capabilities.inference_settings`` of the vLLM engine: what ``plan`` prints for
    ``rollout.inference`` on the pinned (or installed) vllm-ascend release, and the settings that
    release cannot serve. ``(None, [])`` when neither a pin nor vllm-ascend is there to render for."""
    from rlrecipes.models import get_family

    installed = installed_vllm_ascend_version()
    if not (inference.vllm_ascend_version or installed):
        return None, []
    try:
        version = ascend_version(inference, installed)  # the engine's choice (and its refusal), too
        r = render(inference, version, is_mla=dims.is_mla, model_type=get_family(dims.family).model_type)
    except InferenceConfigError as e:
        return None, [str(e)]
    return {"vllm_ascend": version, "additional_config": r.additional_config, "engine_kwargs": r.engine_kwargs}, []
