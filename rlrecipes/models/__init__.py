"""Model families: HF classes, pinned real dimensions, smoke dimensions and parameter counts.

Model math lives in HF transformers (Qwen2ForCausalLM, Qwen3MoeForCausalLM,
DeepseekV3ForCausalLM); this package only says how to build each family from a
config and what the real checkpoints look like, so that the planner can size a
671B run without downloading anything.

Each family is one module in :mod:`rlrecipes.models.families` (dimensions, HF parameter names,
sharding table); :mod:`rlrecipes.models.catalog` holds the dimension tables and the config
conversion; :mod:`rlrecipes.models.sharding` turns the tables into specs and rules. This
``__init__`` re-exports them, and none of them imports it.
"""
from __future__ import annotations

from typing import Any

from .catalog import FAMILIES, HF_ARCHITECTURE, PRESETS, SMOKE, dims_from_hf_config, hf_config, smoke_dims
from .dims import ModelDims
from .families import Family, get_family

__all__ = ["FAMILIES", "Family", "HF_ARCHITECTURE", "ModelDims", "get_family", "PRESETS", "SMOKE", "dims_from_hf_config",
           "hf_config", "param_specs", "smoke_dims"]


def param_specs(source: Any, pp_layers=None) -> list:
    """The resharder's ParamSpecs of a family's model (see :mod:`rlrecipes.models.sharding`)."""
    from .sharding import param_specs as _specs

    return _specs(source, pp_layers)
