"""The resharder's parameter-spec type: what a model family tells the core about each weight.

Model families (``rlrecipes/models``) produce these from their sharding tables; the core never
imports a family. Names are HF state-dict names; ``layer`` places a weight in a pipeline stage.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Kind = Literal["column", "row", "vocab", "replicated", "expert"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the full (unsharded) model and how it is sharded.

    Attributes:
        name: HF (transformers v5) state-dict name.
        shape: full shape.
        tp_dim: dimension split over TP (None: not TP-split).
        kind: column | row | vocab | replicated | expert.
        expert_dim: dimension split over EP (0 for fused experts, None otherwise).
        pp_stage: pipeline stage holding it under the ``pp_layers`` given to :func:`param_specs`.
        layer: decoder layer index, None for embeddings / final norm / lm_head.
        unit: indivisible block along the split dim (head_dim for attention heads, 1 otherwise).
        unit_name: what one unit is, for error messages ("heads", "kv heads", "experts", "rows").
    """

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    kind: Kind
    expert_dim: int | None = None
    pp_stage: int = 0
    layer: int | None = None
    unit: int = 1
    unit_name: str = "rows"

    @property
    def split_dim(self) -> int | None:
        """The dimension any layout splits (EP dim for experts, TP dim otherwise)."""
        return self.expert_dim if self.kind == "expert" else self.tp_dim

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def nbytes(self, dtype_bytes: int = 2) -> int:
        return self.numel * dtype_bytes


def split_layers(num_layers: int, pp: int) -> list[int]:
    """Even layer split over ``pp`` stages; the first ``num_layers % pp`` stages get one more."""
    if pp < 1 or pp > num_layers:
        raise ValueError(f"cannot split {num_layers} layers over pp={pp} stages")
    base, rem = divmod(num_layers, pp)
    return [base + (1 if s < rem else 0) for s in range(pp)]


def stage_of_spec(spec: ParamSpec, pp_layers: Sequence[int] | None) -> int:
    """Pipeline stage of ``spec`` under a layer split: by its decoder layer; layer-less weights go
    to the first stage (embeddings) or the last (final norm, head)."""
    if not pp_layers or len(pp_layers) == 1:
        return 0
    if spec.layer is None:
        return 0 if "embed_tokens" in spec.name else len(pp_layers) - 1
    acc = 0
    for s, n in enumerate(pp_layers):
        acc += n
        if spec.layer < acc:
            return s
    raise ValueError(f"{spec.name}: layer {spec.layer} is beyond the pipeline split {list(pp_layers)} (sum {acc})")
