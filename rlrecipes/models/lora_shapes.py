"""The LoRA tensors PEFT adds to a family's HF model, from its dimensions (no model is built).

:func:`lora_shapes` gives ``(name, shape)`` of every adapter tensor ``peft.inject_adapter_in_model``
creates for ``actor.lora`` (``rank``, ``target_modules``), named as the native engine's
``local_shards()`` names them (``model.layers.0.self_attn.q_proj.lora_A.default.weight``), so
``rlrecipes.models.param_specs(dict(lora_shapes(dims, lora)))`` gives the resharder's specs of the
per-step adapter sync, and ``plan`` sizes the adapters' gradients and optimizer state from it.

What PEFT 0.21.2 does with transformers 5.x, mirrored here (``tests/unit/test_plan_lora.py``
compares name by name and shape by shape with PEFT on the smoke model of every family):

* a target name matches a module whose dotted name equals it or ends in ``.<name>``;
* ``nn.Linear`` ``[out, in]`` -> ``lora_A.default.weight [r, in]`` and ``lora_B.default.weight
  [out, r]`` (no bias: ``bias="none"``); ``nn.Embedding`` ``[V, H]`` -> ``lora_embedding_A.default
  [r, V]`` and ``lora_embedding_B.default [H, r]``; a tied ``lm_head`` is a Linear of its own;
  any other module (a decoder layer, ``self_attn``, the fused ``experts`` container, the router
  ``gate``) is refused with PEFT's error;
* MoE families whose checkpoints transformers v5 converts (Qwen3-MoE and DeepSeek-V3: PEFT's
  ``qwen2_moe`` conversion) get their v4 expert names re-targeted first: ``gate_proj`` / ``up_proj``
  / ``down_proj`` / ``gate`` stop being module targets and become parameter targets
  ``gate_up_proj`` / ``down_proj`` / ``gate.weight``. So the fused 3-D experts *are* adapted (one
  ``lora.ParamWrapper`` per parameter, ``[E, d1, d2]`` -> ``lora_A [r*E, d2]``, ``lora_B [d1, r*E]``,
  rank doubled for ``gate_up_proj``, which fuses two projections), while the dense MLPs of those
  families (DeepSeek's first-k dense layers and shared experts) get *no* adapter from those names.
  Two wrapped parameters of one module nest: the one registered first sits under ``base_layer``
  (``mlp.experts.base_layer.lora_A...`` is ``gate_up_proj``'s, ``mlp.experts.lora_A...``
  ``down_proj``'s). PEFT refuses ``gate_proj`` without ``up_proj`` (or the reverse) there, and any
  ``lora_dropout`` on a wrapped parameter.

Nothing matched at all is PEFT's "target modules not found" error, raised here too.
"""
from __future__ import annotations

import functools
from typing import Any, Iterable

from .dims import ModelDims
from .families import get_family

ADAPTER = "default"
"""The adapter name PEFT gives the one adapter the engine injects."""

PEFT_V5_MOE_FAMILIES = frozenset({"qwen3_moe", "deepseek_v3"})
"""Families whose model type PEFT converts from transformers v4 to v5 names (``qwen2_moe`` rule)."""
_V4_TO_V5 = {"gate": "gate.weight", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
"""PEFT's ``_MOE_TARGET_MODULE_MAPPING['qwen2_moe']``: v4 target name -> v5 parameter target (first match wins)."""
_FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}
"""PEFT's ``_MOE_FUSED_TARGETS['qwen2_moe']``: a fused parameter and the v4 targets it needs together."""

_NOT_LINEAR = {"embed_tokens": "Embedding", "gate": "router"}
"""Leaf names of 2-D ``.weight`` modules in the families' tables that are not ``nn.Linear``."""


def _matches(targets: Iterable[str], key: str) -> bool:
    """PEFT's ``check_target_module_exists`` for a list of names."""
    return any(key == t or key.endswith(f".{t}") for t in targets)


def _modules(dims: ModelDims) -> list[tuple[int, str, str, tuple[int, ...]]]:
    """``(order, module name, kind, weight shape)`` of every module of the HF model that PEFT's
    target matching can see: ``linear``, ``embedding``, or ``other`` (containers, norms, the router,
    the fused experts), in the order the model registers them."""
    params = get_family(dims.family).hf_params(dims)
    out: dict[str, tuple[int, str, tuple[int, ...]]] = {}
    for i, (name, shape, _unit, _unit_name) in enumerate(params):
        module, _, leaf = name.rpartition(".")
        parts = module.split(".")
        for k in range(1, len(parts)):  # the containers above it (model, model.layers, model.layers.0, ...)
            out.setdefault(".".join(parts[:k]), (i, "other", ()))
        if leaf == "weight" and len(shape) == 2:
            kind = _NOT_LINEAR.get(parts[-1], "linear")
            out.setdefault(module, (i, "embedding" if kind == "Embedding" else
                                    "linear" if kind == "linear" else "other", shape))
        else:
            out.setdefault(module, (i, "other", ()))
    if dims.tie_embeddings:  # the head shares the embedding's weight but is a Linear module of its own
        out.setdefault("lm_head", (len(params), "linear", (dims.vocab_size, dims.hidden_size)))
    return [(i, m, kind, shape) for m, (i, kind, shape) in out.items()]


def _convert_moe_targets(targets: list[str], rank: int) -> tuple[list[str], dict[str, int]]:
    """PEFT's ``_convert_peft_config_moe``: (remaining module targets, parameter target -> rank)."""
    remaining: list[str] = []
    params: dict[str, int] = {}
    present: dict[str, set[str]] = {new: set() for new in _FUSED}
    for t in targets:
        hit = next(((old, new) for old, new in _V4_TO_V5.items() if t == old or t.endswith(f".{old}")), None)
        if hit is None:
            remaining.append(t)
            continue
        old, new = hit
        params[new] = rank
        if new in _FUSED:
            present[new].add(old)
    for new, needed in _FUSED.items():
        have = present[new]
        if 0 < len(have) < len(needed):
            raise ValueError(f"Cannot convert PEFT target(s) {', '.join(sorted(have))} without also targeting "
                             f"{', '.join(sorted(set(needed) - have))} because they are fused into {new}")
        if len(have) == len(needed) > 1:
            params[new] = rank * len(needed)
    return remaining, params


def lora_shapes(dims: ModelDims, lora: Any) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every LoRA tensor PEFT injects into the family's HF model for ``lora``
    (anything with ``rank``, ``target_modules`` and optionally ``dropout``, e.g.
    :class:`rlrecipes.recipe.schema.LoraConfig`), in the model's registration order.

    Raises ``ValueError`` where PEFT refuses the targets (see the module docstring); ``rank <= 0``
    (LoRA off) gives ``[]``."""
    dropout = float(getattr(lora, "dropout", 0.0) or 0.0) > 0
    return list(_shapes(dims, int(lora.rank), tuple(lora.target_modules), dropout))


@functools.lru_cache(maxsize=64)  # plan's nearest-node search plans the same recipe many times
def _shapes(dims: ModelDims, r: int, target_modules: tuple[str, ...],
            dropout: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    if r <= 0:
        return ()
    targets = list(target_modules)
    param_targets: dict[str, int] = {}
    if dims.family in PEFT_V5_MOE_FAMILIES:
        targets, param_targets = _convert_moe_targets(targets, r)
    found: list[tuple[int, int, str, tuple[int, ...]]] = []  # (order, sub-order, name, shape)
    for order, module, kind, shape in _modules(dims):
        if not _matches(targets, module):
            continue
        if kind == "linear":
            out_f, in_f = shape
            found += [(order, 0, f"{module}.lora_A.{ADAPTER}.weight", (r, in_f)),
                      (order, 1, f"{module}.lora_B.{ADAPTER}.weight", (out_f, r))]
        elif kind == "embedding":
            vocab, hidden = shape
            found += [(order, 0, f"{module}.lora_embedding_A.{ADAPTER}", (r, vocab)),
                      (order, 1, f"{module}.lora_embedding_B.{ADAPTER}", (hidden, r))]
        else:
            raise ValueError(f"Target module {module!r} of {dims.family} is not supported by PEFT's LoRA "
                             "(only nn.Linear and nn.Embedding modules, and the fused experts' parameters of "
                             f"{', '.join(sorted(PEFT_V5_MOE_FAMILIES))} through gate_proj/up_proj/down_proj)")
    # parameter targets: one ParamWrapper per matched parameter, nested per module in registration order
    wrapped: dict[str, list[tuple[int, str, tuple[int, ...], int]]] = {}
    for order, (name, shape, _u, _un) in enumerate(get_family(dims.family).hf_params(dims)):
        hit = next((t for t in param_targets if name == t or name.endswith(f".{t}")), None)
        if hit is not None:
            module, _, leaf = name.rpartition(".")
            wrapped.setdefault(module, []).append((order, leaf, tuple(shape), param_targets[hit]))
    if wrapped and dropout:
        raise ValueError(f"lora.ParamWrapper does not work with lora_dropout != 0: PEFT adapts the fused experts "
                         f"of {dims.family} as parameters; set actor.lora.dropout=0")
    for module, items in wrapped.items():
        for k, (order, _leaf, shape, rank) in enumerate(items):
            prefix = module + ".base_layer" * (len(items) - 1 - k)  # the first registered is the innermost
            if len(shape) == 3:
                experts, d1, d2 = shape  # [E, d1, d2], not transposed: in = d2, out = d1
                a, b = (rank * experts, d2), (d1, rank * experts)
            else:
                out_f, in_f = shape
                a, b = (rank, in_f), (out_f, rank)
            found += [(order, 0, f"{prefix}.lora_A.{ADAPTER}.weight", a), (order, 1, f"{prefix}.lora_B.{ADAPTER}.weight", b)]
    if not found:
        raise ValueError(f"Target modules {sorted(set(target_modules))} not found in the base model "
                         f"({dims.family}); PEFT refuses an adapter that adapts nothing")
    found.sort(key=lambda x: (x[0], x[1]))
    return tuple((name, shape) for _o, _s, name, shape in found)


def target_names(dims: ModelDims) -> list[str]:
    """The names ``actor.lora.target_modules`` can give on this family: the last names of its Linear and
    Embedding modules, and (PEFT's v5 MoE conversion) the v4 expert names it re-targets."""
    names = {m.rsplit(".", 1)[-1] for _o, m, kind, _s in _modules(dims) if kind != "other"}
    if dims.family in PEFT_V5_MOE_FAMILIES:
        names |= set(_V4_TO_V5)
    return sorted(names)


def _known(dims: ModelDims, target: str) -> bool:
    """``target`` names a module (or, MoE, a re-targeted expert name) of this family's model."""
    leaf = target.rsplit(".", 1)[-1]
    if dims.family in PEFT_V5_MOE_FAMILIES and leaf in _V4_TO_V5:
        return True
    return any(_matches([target], m) for _o, m, _k, _s in _modules(dims))


def lora_problems(dims: ModelDims, lora: Any) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of ``actor.lora`` on this family, which PEFT itself lets pass: a target that
    is no module of any family (a misspelling, kept by PEFT while the other targets get adapters) is a
    problem naming the valid names; a module name of another family only (a list shared across
    families) is a note; a rank above the smallest dimension of a targeted weight is a problem."""
    from difflib import get_close_matches

    from .catalog import smoke_dims
    from .families import FAMILY_TABLE

    problems, notes = [], []
    valid = target_names(dims)
    others = [smoke_dims(f) for f in FAMILY_TABLE if f != dims.family]
    unknown = [t for t in lora.target_modules if not _known(dims, t)]
    typos = [t for t in unknown if not any(_known(o, t) for o in others)]
    if typos:
        close = {t: (get_close_matches(t.rsplit(".", 1)[-1], valid, n=1) or [None])[0] for t in typos}
        named = ", ".join(f"{t!r}" + (f" (did you mean {close[t]!r}?)" if close[t] else "") for t in typos)
        fixed = [close.get(t, t) for t in lora.target_modules]
        fix = (f"; set actor.lora.target_modules=[{','.join(dict.fromkeys(fixed))}]" if None not in fixed else "")
        problems.append(f"actor.lora.target_modules: {named} {'is no module' if len(typos) == 1 else 'are no modules'} "
                        f"of {dims.family} (PEFT would adapt the other targets only); the names it has: "
                        f"{', '.join(valid)}{fix}")
    if len(unknown) > len(typos):
        notes.append(f"actor.lora.target_modules {[t for t in unknown if t not in typos]}: no such module in "
                     f"{dims.family} (names of other families); no adapter there")
    if typos:
        return problems, notes
    shapes = lora_shapes(dims, lora)
    smallest = min(((min(a[1], b[0]), name.split(".lora_")[0]) for (name, a), (_n, b) in zip(shapes[::2], shapes[1::2])),
                   default=None)
    if smallest is not None and lora.rank > smallest[0]:
        problems.append(f"actor.lora.rank={lora.rank} is larger than the smallest dimension of a targeted weight "
                        f"({smallest[1]}: {smallest[0]}): its update B·A has rank {smallest[0]} at most, the rest only costs memory "
                        f"and shrinks the alpha / r scale; lower actor.lora.rank "
                        f"to {smallest[0]} or less")
    return problems, notes


def lora_numel(dims: ModelDims, lora: Any) -> int:
    """Adapter parameters in all: the trainable parameters of a LoRA actor."""
    total = 0
    for _name, shape in lora_shapes(dims, lora):
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


__all__ = ["ADAPTER", "PEFT_V5_MOE_FAMILIES", "lora_numel", "lora_problems", "lora_shapes", "target_names"]
