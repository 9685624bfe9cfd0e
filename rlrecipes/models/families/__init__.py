"""One module per model family; each holds everything the project knows about that family.

A family module (``qwen2.py``, ``qwen3_moe.py``, ``deepseek_v3.py``) defines one :class:`Family`:

* its HF architecture and ``model_type``;
* its dimensions: the pinned real checkpoints (``presets``) and the tiny ``smoke`` model;
* its HF parameter names and shapes for given dimensions (``hf_params``), in state-dict order;
* its sharding table: HF module name -> sharding kind (``column``, ``row``, ``vocab``,
  ``replicated``, ``expert``). The native engine's DTensor TP plan
  (``engines/native/parallel.py``) and the resharder's specs (``models/sharding.py``) are both
  derived from these tables, and ``docs/conventions.md`` prints them (``rlrecipes.models.sharding.rules_table``);
* how to build its transformers config from dimensions and read dimensions back.

Adding a family is adding one module here and listing it in :data:`FAMILY_MODULES`. A family module
imports what families share from :mod:`.base`, never from this package (which imports it).
"""
from __future__ import annotations

from . import deepseek_v3, qwen2, qwen2_5_vl, qwen3_moe
from .base import COMMON_SHARDING, Family, Kind, ParamList, dense_mlp, fused_experts, gqa_attention

FAMILY_MODULES = (qwen2, qwen3_moe, deepseek_v3, qwen2_5_vl)
FAMILY_TABLE: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in FAMILY_MODULES}


def get_family(name: str) -> Family:
    if name not in FAMILY_TABLE:
        raise KeyError(f"unknown model family {name!r}; choose one of {', '.join(FAMILY_TABLE)}")
    return FAMILY_TABLE[name]


__all__ = ["COMMON_SHARDING", "FAMILY_MODULES", "FAMILY_TABLE", "Family", "Kind", "ParamList", "dense_mlp",
           "fused_experts", "get_family", "gqa_attention"]
