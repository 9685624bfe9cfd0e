"""The families' dimension tables (pinned real checkpoints, smoke sizes) and the conversion between
:class:`~rlrecipes.models.dims.ModelDims` and transformers configs (no download).

Re-exported by :mod:`rlrecipes.models`; modules inside ``models/`` import from here, not from the
package ``__init__``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .dims import ModelDims
from .families import FAMILY_TABLE, get_family

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
    full, cfg = cfg, (cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg)  # a VL config: its decoder's
    heads = cfg.num_attention_heads
    kw: dict[str, Any] = dict(
        family=fam.name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        intermediate_size=cfg.intermediate_size, tie_embeddings=bool(getattr(full, "tie_word_embeddings", False)),
        max_position_embeddings=cfg.max_position_embeddings,
    )
    kw.update(fam.read_config(full))
    return ModelDims(**kw)
