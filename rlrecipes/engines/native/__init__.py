"""Native engines: HF models + DTensor TP / EP-inside-TP / FSDP2 training, a KV-cache sampler.

See docs/engines.md. Imports are lazy so that ``import rlrecipes.engines.native`` stays cheap.
"""
from __future__ import annotations

_EXPORTS = {
    "TrainEngine": "train", "ValueEngine": "train", "RolloutEngine": "rollout", "RolloutOutput": "rollout",
    "bench_vs_generate": "rollout", "build_model": "loader", "save_hf_folder": "loader",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_EXPORTS)
