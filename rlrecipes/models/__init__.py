"""Model families: HF classes, pinned real dimensions, smoke dimensions and parameter counts.

Model math lives in HF transformers (Qwen2ForCausalLM, Qwen3MoeForCausalLM,
DeepseekV3ForCausalLM); this package only says how to build each family from a
config and what the real checkpoints look like, so that the planner can size a
671B run without downloading anything.

Each family is one module in :mod:`rlrecipes.models.families` (dimensions, HF parameter names,
sharding table); :mod:`rlrecipes.models.sharding` turns the tables into specs and rules.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .dims import ModelDims
from .families import FAMILY_TABLE, Family, get_family

FAMILIES = tuple(FAMILY_TABLE)
#: Real checkpoints, pinned so the planner never needs a download (each family module holds its own).
PRESETS: dict[str, ModelDims] = {k: v for f in FAMILY_TABLE.values() for k, v in f.presets.items()}
#: Tiny same-architecture dimensions for --smoke runs (CPU, minutes).
SMOKE: dict[str, ModelDims] = {name: f.smoke for name, f in FAMILY_TABLE.items()}
HF_ARCHITECTURE = {name: f.hf_architecture for name, f in FAMILY_TABLE.items()}


def smoke_dims(family: str, **overrides: Any) -> ModelDims:
    return replace(get_family(family).smoke, **overrides)


def hf_config(dims: ModelDims, **extra: Any):
    """A transformers config of the family with these dimensions (no download)."""
    fam = get_family(dims.family)
    common = dict(
        vocab_size=dims.vocab_size, hidden_size=dims.hidden_size, num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads,
        intermediate_size=dims.intermediate_size, tie_word_embeddings=dims.tie_embeddings,
        max_position_embeddings=dims.max_position_embeddings, architectures=[fam.hf_architecture],
    )
    common.update(extra)
    return fam.build_config(dims, common)


def dims_from_hf_config(cfg) -> ModelDims:
    """Read ModelDims back from a transformers config (e.g. an HF folder's config.json)."""
    arch = (getattr(cfg, "architectures", None) or [""])[0]
    by_arch = {f.hf_architecture: f for f in FAMILY_TABLE.values()}
    by_type = {f.model_type: f for f in FAMILY_TABLE.values()}
    fam = by_arch.get(arch) or by_type.get(getattr(cfg, "model_type", None))
    if fam is None:
        raise ValueError(f"unsupported architecture {arch or cfg.model_type!r}; supported: {', '.join(HF_ARCHITECTURE.values())}")
    heads = cfg.num_attention_heads
    kw: dict[str, Any] = dict(
        family=fam.name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        intermediate_size=cfg.intermediate_size, tie_embeddings=bool(cfg.tie_word_embeddings),
        max_position_embeddings=cfg.max_position_embeddings,
    )
    kw.update(fam.read_config(cfg))
    return ModelDims(**kw)


__all__ = ["FAMILIES", "Family", "HF_ARCHITECTURE", "ModelDims", "get_family", "PRESETS", "SMOKE", "dims_from_hf_config",
           "hf_config", "smoke_dims"]


def param_specs(source: Any, pp_layers=None) -> list:
    """The resharder's ParamSpecs of a family's model (see :mod:`rlrecipes.models.sharding`)."""
    from .sharding import param_specs as _specs

    return _specs(source, pp_layers)
