"""What every family module shares: the :class:`Family` record, the common sharding table and the
parameter-list helpers for GQA attention, dense MLPs and fused experts.

The family modules import from here, never from the package ``__init__`` (which imports them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..dims import ModelDims

Kind = str
ParamList = list[tuple[str, tuple[int, ...], int, str]]
"""``(name, shape, unit, unit_name)``: ``unit`` rows form one indivisible block (a head) for TP."""


#: Modules every decoder family shares (embeddings, dense MLP, GQA attention, norms).
COMMON_SHARDING: Mapping[str, Kind] = {
    "embed_tokens": "vocab",
    "lm_head": "column",
    "q_proj": "column", "k_proj": "column", "v_proj": "column",
    "gate_proj": "column", "up_proj": "column",
    "o_proj": "row", "down_proj": "row",
    "input_layernorm": "replicated", "post_attention_layernorm": "replicated", "norm": "replicated",
}


@dataclass(frozen=True)
class Family:
    name: str
    hf_architecture: str
    model_type: str
    smoke: ModelDims
    presets: Mapping[str, ModelDims]
    sharding: Mapping[str, Kind]
    """HF module name -> sharding kind, for every module this family has (COMMON_SHARDING included)."""
    attention_and_mlp: Callable[[ModelDims, int, Callable[..., None]], None]
    """Add layer ``i``'s attention and MLP parameters (``add(name_suffix, shape, unit, unit_name)``)."""
    build_config: Callable[[ModelDims, dict[str, Any]], Any]
    """transformers config from dims and the shared keyword arguments."""
    read_config: Callable[[Any], dict[str, Any]] = field(default=lambda cfg: {})
    """Family-specific ModelDims fields read back from a transformers config."""
    text_prefix: str = "model."
    """Where the decoder stack sits in the HF state dict (``model.language_model.`` for a VL model)."""
    extra_params: Optional[Callable[[ModelDims, Callable[..., None]], None]] = None
    """More parameters after the decoder's (a vision tower and its merger), ``add(name, shape)``."""

    def hf_params(self, d: ModelDims) -> ParamList:
        """(name, shape, unit, unit_name) of every parameter of the HF model, in state-dict order."""
        H, out = d.hidden_size, []

        def add(name: str, shape, unit: int = 1, unit_name: str = "rows") -> None:
            out.append((name, tuple(int(s) for s in shape), unit, unit_name))

        t = self.text_prefix
        add(f"{t}embed_tokens.weight", (d.vocab_size, H))
        for i in range(d.num_layers):
            self.attention_and_mlp(d, i, lambda n, *a, _p=f"{t}layers.{i}.": add(_p + n, *a))
            add(f"{t}layers.{i}.input_layernorm.weight", (H,))
            add(f"{t}layers.{i}.post_attention_layernorm.weight", (H,))
        add(f"{t}norm.weight", (H,))
        if not d.tie_embeddings:
            add("lm_head.weight", (d.vocab_size, H))
        if self.extra_params is not None:
            self.extra_params(d, add)
        return out


def gqa_attention(d: ModelDims, add: Callable[..., None], *, qk_norm: bool) -> None:
    """Grouped-query attention (Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms)."""
    H, hd = d.hidden_size, d.head_dim
    q, kv = d.num_heads * hd, d.num_kv_heads * hd
    for proj, rows, unit_name in (("q_proj", q, "heads"), ("k_proj", kv, "kv heads"), ("v_proj", kv, "kv heads")):
        add(f"self_attn.{proj}.weight", (rows, H), hd, unit_name)
        if d.attention_bias:
            add(f"self_attn.{proj}.bias", (rows,), hd, unit_name)
    add("self_attn.o_proj.weight", (H, q), hd, "heads")
    if qk_norm:
        add("self_attn.q_norm.weight", (hd,))
        add("self_attn.k_norm.weight", (hd,))


def dense_mlp(d: ModelDims, add: Callable[..., None], prefix: str = "mlp", width: int | None = None) -> None:
    H, w = d.hidden_size, width or d.intermediate_size
    add(f"{prefix}.gate_proj.weight", (w, H))
    add(f"{prefix}.up_proj.weight", (w, H))
    add(f"{prefix}.down_proj.weight", (H, w))


def fused_experts(d: ModelDims, add: Callable[..., None]) -> None:
    """transformers v5 fused experts ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]`` + router."""
    E, I, H = d.num_experts, d.moe_intermediate_size, d.hidden_size
    add("mlp.experts.gate_up_proj", (E, 2 * I, H), 1, "experts")
    add("mlp.experts.down_proj", (E, H, I), 1, "experts")
    add("mlp.gate.weight", (E, H))
