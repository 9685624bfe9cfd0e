"""Parameter specs: how each HF parameter is sharded over TP / EP / PP.

The rules come from one place: each family's ``sharding`` table in
:mod:`rlrecipes.models.families` (HF module name -> kind). :data:`RULES` is their union, and
:func:`kind_of` maps a parameter name onto it; the native engine's DTensor TP plan, the
resharder's specs and checkpoint loaders all call it. Kinds:

- ``column`` (split dim 0, weight and bias), ``vocab`` (split dim 0),
- ``row`` (split dim 1; a row-parallel *bias* is replicated),
- ``replicated``,
- ``expert`` (fused v5 ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``: split dim 0 over EP,
  not over TP; per-expert checkpoint names map onto them with :func:`fused_expert_key`).

Pipeline stage: ``model.layers.<i>.*`` by the layer split, ``embed_tokens`` on the first stage,
``model.norm`` and ``lm_head`` on the last. :func:`rules_table` prints the table for the docs.

``param_specs`` accepts :class:`~rlrecipes.models.ModelDims`, a transformers config, or a
state-dict "meta" (mapping name -> tensor / shape), so names from a real checkpoint map on.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from rlrecipes.models.catalog import dims_from_hf_config
from rlrecipes.models.dims import ModelDims
from rlrecipes.models.families import FAMILY_TABLE, get_family

from rlrecipes.core.param_spec import Kind, ParamSpec, split_layers  # noqa: F401 (re-exported)

def _union_rules() -> dict[str, Kind]:
    out: dict[str, Kind] = {}
    for fam in FAMILY_TABLE.values():
        for module, kind in fam.sharding.items():
            if out.setdefault(module, kind) != kind:
                raise ValueError(f"model families disagree on how {module!r} is sharded: {out[module]} vs {kind}")
    return out


#: HF module name (or ``module.leaf``) -> sharding kind, over every family.
RULES: dict[str, Kind] = _union_rules()

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# transformers v4 / real safetensors checkpoints: one tensor per expert
_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def _module_of(name: str) -> tuple[str, str]:
    """('q_proj', 'weight') for 'model.layers.0.self_attn.q_proj.weight'."""
    parts = name.split(".")
    if len(parts) < 2:
        raise ValueError(f"parameter name {name!r} has no module part")
    return parts[-2], parts[-1]


def is_expert(name: str) -> bool:
    """Routed-expert weights (fused v5 names, or per-expert checkpoint names)."""
    try:
        return kind_of(name) == "expert"
    except ValueError:
        return False


def kind_of(name: str) -> Kind:
    """The sharding kind of a parameter name; unknown names are an error, never silently replicated."""
    if _PER_EXPERT_RE.match(name):
        return "expert"
    if ".lora_A." in name or ".lora_B." in name:
        return "replicated"  # LoRA adapters: small, trained and synced whole (TP with LoRA is refused)
    if _is_vision(name):
        return "replicated"  # a VL model's vision tower and merger: whole on every TP rank
    module, leaf = _module_of(name)
    kind = RULES.get(f"{module}.{leaf}")
    if kind is None and leaf in ("weight", "bias"):
        kind = RULES.get(module)
    if kind is None:
        raise ValueError(f"no sharding rule for parameter {name!r} (module {module!r}); add it to its family's "
                         f"sharding table in rlrecipes/models/families/")
    if kind == "row" and leaf == "bias":
        return "replicated"
    return kind


def _is_vision(name: str) -> bool:
    return name.startswith("visual.") or ".visual." in name


def rules_table() -> str:
    """The sharding table as Markdown, one row per kind (docs/conventions.md prints this)."""
    by_kind: dict[str, list[str]] = {}
    for module, kind in RULES.items():
        by_kind.setdefault(kind, []).append(f"`{module}`")
    return "\n".join(f"| {kind} | {', '.join(sorted(mods))} |" for kind, mods in sorted(by_kind.items()))


#: the dimension TP splits for each kind (replicated and expert tensors are not split over TP)
TP_DIM_OF_KIND = {"column": 0, "vocab": 0, "row": 1}


def tp_dim_of(name: str) -> int | None:
    """Dimension TP splits for this parameter name (0, 1) or None (replicated / expert)."""
    return TP_DIM_OF_KIND.get(kind_of(name))


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def fused_expert_key(name: str) -> tuple[str, int, str] | None:
    """Map a per-expert checkpoint name onto the fused v5 tensor.

    ``model.layers.3.mlp.experts.17.up_proj.weight`` -> (``model.layers.3.mlp.experts.gate_up_proj``, 17, ``up``):
    gate goes to rows ``[0, I)`` and up to rows ``[I, 2I)`` of ``gate_up_proj[e]``; down to ``down_proj[e]``.
    """
    m = _PER_EXPERT_RE.match(name)
    if not m:
        return None
    part = m.group("part")
    fused = "down_proj" if part == "down_proj" else "gate_up_proj"
    return f"{m.group('prefix')}.{fused}", int(m.group("e")), part.removesuffix("_proj")


def vl_checkpoint_name(name: str) -> str:
    """A VL model's in-memory name (transformers v5) -> the name its published checkpoints store:
    ``model.language_model.X`` -> ``model.X``, ``model.visual.X`` -> ``visual.X``; others unchanged."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.visual."):
        return name[len("model."):]
    return name


def checkpoint_items(name: str, t):
    """One in-memory (transformers v5) tensor -> the ``(name, tensor)`` pairs of the on-disk checkpoint
    format that HF hub checkpoints, transformers' loader and vLLM all read: a fused
    ``mlp.experts.gate_up_proj [E, 2I, H]`` becomes ``mlp.experts.<e>.gate_proj.weight`` (rows
    ``[0, I)``) and ``up_proj.weight`` (rows ``[I, 2I)``); ``down_proj [E, H, I]`` becomes
    ``experts.<e>.down_proj.weight``. Every other tensor passes through. Yields views, no copies.
    A Qwen2.5-VL tensor takes its published checkpoint's name (``model.language_model.`` ->
    ``model.``, ``model.visual.`` -> ``visual.``). The inverse of :func:`fused_expert_key`."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith("mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
        yield vl_checkpoint_name(name), t  # a VL model: the published checkpoints' names
        return
    for e in range(t.shape[0]):
        if leaf == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            gate, up = t[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up


def stage_of(name: str, pp_layers: Sequence[int] | None) -> int:
    """Pipeline stage of a parameter under a layer split (None: one stage)."""
    if not pp_layers or len(pp_layers) == 1:
        return 0
    if _is_vision(name):
        return 0  # the vision tower feeds the first stage's embeddings
    layer = layer_of(name)
    if layer is None:
        module, _ = _module_of(name)
        if module == "embed_tokens":
            return 0
        return len(pp_layers) - 1  # model.norm, lm_head
    acc = 0
    for s, n in enumerate(pp_layers):
        acc += n
        if layer < acc:
            return s
    raise ValueError(f"{name}: layer {layer} is beyond the pipeline split {list(pp_layers)} (sum {acc})")


def _family_params(d: ModelDims) -> list[tuple[str, tuple[int, ...], int, str]]:
    """(name, shape, unit, unit_name) of every parameter of the HF model for these dims."""
    return get_family(d.family).hf_params(d)


def _make_spec(name: str, shape: tuple[int, ...], pp_layers, unit: int = 1, unit_name: str = "rows") -> ParamSpec:
    kind = kind_of(name)
    tp_dim = TP_DIM_OF_KIND.get(kind)
    expert_dim = 0 if kind == "expert" else None
    split = expert_dim if kind == "expert" else tp_dim
    if split is not None and split >= len(shape):
        raise ValueError(f"{name}: shape {list(shape)} has no dimension {split} to split ({kind})")
    if kind == "replicated":
        unit, unit_name = 1, "rows"
    return ParamSpec(name=name, shape=tuple(int(s) for s in shape), tp_dim=tp_dim, kind=kind,
                     expert_dim=expert_dim, pp_stage=stage_of(name, pp_layers), layer=layer_of(name),
                     unit=unit, unit_name=unit_name)


def _check_pp_layers(pp_layers, num_layers: int | None) -> None:
    if pp_layers is None:
        return
    if any(int(n) < 1 for n in pp_layers):
        raise ValueError(f"pp_layers {list(pp_layers)}: every stage needs at least one layer")
    if num_layers is not None and sum(pp_layers) != num_layers:
        raise ValueError(f"pp_layers {list(pp_layers)} sum to {sum(pp_layers)}, but the model has {num_layers} layers")


def param_specs(source: Any, pp_layers: Sequence[int] | None = None) -> list[ParamSpec]:
    """Specs of every parameter, from ModelDims, a transformers config, or a state-dict meta.

    Args:
        source: :class:`ModelDims`; a transformers ``PretrainedConfig``; or a mapping
            ``name -> tensor | torch.Size | tuple`` (e.g. a model's ``state_dict()`` or the
            header of a safetensors file). Non-persistent buffers such as ``rotary_emb.inv_freq``
            are skipped when present.
        pp_layers: layers per pipeline stage (sum = num_layers), None for one stage.
    """
    if isinstance(source, ModelDims):
        dims = source
    elif isinstance(source, Mapping):
        specs = []
        layers = set()
        for name, value in source.items():
            if "rotary_emb" in name:
                continue
            shape = tuple(value.shape) if hasattr(value, "shape") else tuple(value)
            layer = layer_of(name)
            if layer is not None:
                layers.add(layer)
            specs.append(_make_spec(name, shape, pp_layers))
        _check_pp_layers(pp_layers, (max(layers) + 1) if layers else None)
        return specs
    elif hasattr(source, "num_hidden_layers"):
        dims = dims_from_hf_config(source)
    else:
        raise TypeError(f"param_specs: expected ModelDims, a transformers config or a state-dict mapping, "
                        f"got {type(source).__name__}")
    _check_pp_layers(pp_layers, dims.num_layers)
    return [_make_spec(n, s, pp_layers, u, un) for n, s, u, un in _family_params(dims)]


__all__ = ["Kind", "ParamSpec", "checkpoint_items", "fused_expert_key", "is_expert", "kind_of", "layer_of", "param_specs",
           "split_layers", "stage_of", "tp_dim_of"]


def reshard_bytes_summary(train, rollout, dims: ModelDims, pp_layers: Sequence[int] | None = None,
                          dtype_bytes: int = 2, placement: str = "colocated") -> dict:
    """The core's reshard volume for a family's model given by its dims (the even split by default).

    ``placement="disaggregated"``: train and rollout on disjoint ranks (train first), see
    :func:`rlrecipes.core.resharder.reshard_bytes_summary`."""
    import dataclasses

    from rlrecipes.core.resharder import reshard_bytes_summary as summary

    if pp_layers is None and train.pp > 1:
        pp_layers = train.pp_layers or split_layers(dims.num_layers, train.pp)
    if pp_layers is not None and train.pp_layers is None and train.pp > 1:
        train = dataclasses.replace(train, pp_layers=tuple(pp_layers))
    return summary(train, rollout, param_specs(dims, pp_layers if train.pp > 1 else None), dtype_bytes, placement)
