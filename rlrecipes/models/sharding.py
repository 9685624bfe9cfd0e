"""Parameter specs: how each HF parameter is sharded over TP / EP / PP.

The rules follow ``docs/conventions.md`` and are derived from the transformers v5
parameter *names*, so the training engine, the resharder and a checkpoint loader
agree on one table:

- column-parallel (split dim 0): ``q_proj k_proj v_proj gate_proj up_proj q_b_proj kv_b_proj lm_head``
- vocab-parallel (split dim 0): ``embed_tokens``
- row-parallel (split dim 1): ``o_proj down_proj`` (a row-parallel *bias* is replicated)
- replicated: every norm, MLA ``q_a_proj kv_a_proj_with_mqa``, router ``mlp.gate.weight`` and
  ``mlp.gate.e_score_correction_bias``
- experts (fused in v5): ``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``:
  split dim 0 over EP, not split over TP.

Pipeline stage: ``model.layers.<i>.*`` by the layer split, ``embed_tokens`` on the first stage,
``model.norm`` and ``lm_head`` on the last.

``param_specs`` accepts :class:`~rlrecipes.models.ModelDims`, a transformers config, or a
state-dict "meta" (mapping name -> tensor / shape), so names from a real checkpoint map on.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlrecipes.models import ModelDims, dims_from_hf_config

from rlrecipes.core.param_spec import Kind, ParamSpec, split_layers  # noqa: F401 (re-exported)

COLUMN_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj",
                            "lm_head"})
ROW_MODULES = frozenset({"o_proj", "down_proj"})
VOCAB_MODULES = frozenset({"embed_tokens"})
REPLICATED_MODULES = frozenset({"input_layernorm", "post_attention_layernorm", "norm", "q_norm", "k_norm",
                                "q_a_layernorm", "kv_a_layernorm", "q_a_proj", "kv_a_proj_with_mqa", "gate"})
FUSED_EXPERT_PARAMS = frozenset({"gate_up_proj", "down_proj"})

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FUSED_EXPERT_RE = re.compile(r"(?:^|\.)mlp\.experts\.(gate_up_proj|down_proj)$")
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
    return bool(_FUSED_EXPERT_RE.search(name) or _PER_EXPERT_RE.match(name))


def kind_of(name: str) -> Kind:
    """The sharding kind of a parameter name; unknown names are an error, never silently replicated."""
    if is_expert(name):
        return "expert"
    module, leaf = _module_of(name)
    if module == "gate" and leaf == "e_score_correction_bias":
        return "replicated"
    if leaf not in ("weight", "bias"):
        raise ValueError(f"no sharding rule for parameter {name!r} (leaf {leaf!r}); see docs/conventions.md")
    if module in VOCAB_MODULES:
        return "vocab"
    if module in COLUMN_MODULES:
        return "column"
    if module in ROW_MODULES:
        return "replicated" if leaf == "bias" else "row"
    if module in REPLICATED_MODULES or module.endswith("layernorm") or module.endswith("_norm"):
        return "replicated"
    raise ValueError(f"no sharding rule for parameter {name!r} (module {module!r}); see docs/conventions.md")


def tp_dim_of(name: str) -> int | None:
    """Dimension TP splits for this parameter name (0, 1) or None (replicated / expert)."""
    kind = kind_of(name)
    return {"column": 0, "vocab": 0, "row": 1}.get(kind)


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


def stage_of(name: str, pp_layers: Sequence[int] | None) -> int:
    """Pipeline stage of a parameter under a layer split (None: one stage)."""
    if not pp_layers or len(pp_layers) == 1:
        return 0
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


# ---------------------------------------------------------------------------------------------
# names and shapes of each family, in HF state-dict order
def _family_params(d: ModelDims) -> list[tuple[str, tuple[int, ...], int, str]]:
    """(name, shape, unit, unit_name) of every parameter of the HF model for these dims."""
    H, out = d.hidden_size, []
    add = lambda n, s, unit=1, unit_name="rows": out.append((n, tuple(s), unit, unit_name))  # noqa: E731
    add("model.embed_tokens.weight", (d.vocab_size, H))
    for i in range(d.num_layers):
        p = f"model.layers.{i}."
        if d.is_mla:
            qk = d.qk_nope_head_dim + d.qk_rope_head_dim
            if d.q_lora_rank:
                add(p + "self_attn.q_a_proj.weight", (d.q_lora_rank, H))
                add(p + "self_attn.q_a_layernorm.weight", (d.q_lora_rank,))
                add(p + "self_attn.q_b_proj.weight", (d.num_heads * qk, d.q_lora_rank), qk, "heads")
            else:
                add(p + "self_attn.q_proj.weight", (d.num_heads * qk, H), qk, "heads")
            add(p + "self_attn.kv_a_proj_with_mqa.weight", (d.kv_lora_rank + d.qk_rope_head_dim, H))
            add(p + "self_attn.kv_a_layernorm.weight", (d.kv_lora_rank,))
            add(p + "self_attn.kv_b_proj.weight",
                (d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank),
                d.qk_nope_head_dim + d.v_head_dim, "heads")
            add(p + "self_attn.o_proj.weight", (H, d.num_heads * d.v_head_dim), d.v_head_dim, "heads")
        else:
            hd, q, kv = d.head_dim, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
            for proj, rows, unit_name in (("q_proj", q, "heads"), ("k_proj", kv, "kv heads"), ("v_proj", kv, "kv heads")):
                add(p + f"self_attn.{proj}.weight", (rows, H), hd, unit_name)
                if d.attention_bias:
                    add(p + f"self_attn.{proj}.bias", (rows,), hd, unit_name)
            add(p + "self_attn.o_proj.weight", (H, q), hd, "heads")
            if d.family == "qwen3_moe":
                add(p + "self_attn.q_norm.weight", (hd,))
                add(p + "self_attn.k_norm.weight", (hd,))
        if d.is_moe and i >= d.first_k_dense:
            E, I = d.num_experts, d.moe_intermediate_size
            add(p + "mlp.experts.gate_up_proj", (E, 2 * I, H), 1, "experts")
            add(p + "mlp.experts.down_proj", (E, H, I), 1, "experts")
            add(p + "mlp.gate.weight", (E, H))
            if d.family == "deepseek_v3":
                add(p + "mlp.gate.e_score_correction_bias", (E,))
            if d.num_shared_experts:
                S = d.num_shared_experts * I
                add(p + "mlp.shared_experts.gate_proj.weight", (S, H))
                add(p + "mlp.shared_experts.up_proj.weight", (S, H))
                add(p + "mlp.shared_experts.down_proj.weight", (H, S))
        else:
            add(p + "mlp.gate_proj.weight", (d.intermediate_size, H))
            add(p + "mlp.up_proj.weight", (d.intermediate_size, H))
            add(p + "mlp.down_proj.weight", (H, d.intermediate_size))
        add(p + "input_layernorm.weight", (H,))
        add(p + "post_attention_layernorm.weight", (H,))
    add("model.norm.weight", (H,))
    if not d.tie_embeddings:
        add("lm_head.weight", (d.vocab_size, H))
    return out


def _make_spec(name: str, shape: tuple[int, ...], pp_layers, unit: int = 1, unit_name: str = "rows") -> ParamSpec:
    kind = kind_of(name)
    tp_dim = {"column": 0, "vocab": 0, "row": 1}.get(kind)
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


__all__ = ["Kind", "ParamSpec", "fused_expert_key", "is_expert", "kind_of", "layer_of", "param_specs",
           "split_layers", "stage_of", "tp_dim_of"]


def reshard_bytes_summary(train, rollout, dims: ModelDims, pp_layers: Sequence[int] | None = None,
                          dtype_bytes: int = 2) -> dict:
    """The core's reshard volume for a family's model given by its dims (the even split by default)."""
    from rlrecipes.core.resharder import Layout
    from rlrecipes.core.resharder import reshard_bytes_summary as summary

    if pp_layers is None and train.pp > 1:
        pp_layers = train.pp_layers or split_layers(dims.num_layers, train.pp)
    if pp_layers is not None and train.pp_layers is None and train.pp > 1:
        train = Layout(train.tp, train.pp, train.ep, train.dp, tuple(pp_layers))
    return summary(train, rollout, param_specs(dims, pp_layers if train.pp > 1 else None), dtype_bytes)
