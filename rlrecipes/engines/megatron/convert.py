"""HF <-> megatron-core: model config translation and parameter names/layouts (no megatron import).

Everything here is plain torch on full (TP1) tensors, so it runs and is tested on any machine; the
engine slices the results into its TP/EP shards. Families: Qwen2 (dense, q/k/v bias), Qwen3-MoE
(q/k RMSNorm, routed experts, softmax top-k renormalised) and DeepSeek-V3 (MLA, sigmoid routing with
an expert bias and group-limited top-k, shared experts, dense first layers).

Megatron layouts that differ from HF:

* ``self_attention.linear_qkv`` fuses q, k and v *per query group*: the rows are
  ``[g0: q heads of the group, k, v | g1: ... ]`` (``num_heads / num_kv_heads`` query heads then one
  key and one value head per group); the bias follows the rows;
* ``mlp.linear_fc1`` is ``[gate; up]`` stacked on rows (megatron's GLU takes the first half
  through the activation); HF v5 fused experts ``gate_up_proj [E, 2I, H]`` are already that per
  expert, and ``down_proj [E, H, I]`` is each expert's ``linear_fc2``;
* names: ``embedding.word_embeddings``, ``decoder.layers.{i}``, ``input_layernorm``,
  ``pre_mlp_layernorm``, ``decoder.final_layernorm``, ``output_layer`` (absent when tied);
  MLA ``linear_q_down_proj``/``q_layernorm``/``linear_q_up_proj``/``linear_kv_down_proj``/
  ``kv_layernorm``/``linear_kv_up_proj``; the router ``mlp.router.weight`` (+ ``expert_bias``);
  routed experts ``mlp.experts.local_experts.{e}`` (the non-grouped-GEMM layout); shared experts
  ``mlp.shared_experts``.

Layer keys are numbered per pipeline stage (``decoder.layers.{i - first}``): pass ``layers=(first,
stop)`` to convert one stage; the embedding goes with the first stage, the final norm and the head
with the last.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from ...models import ModelDims

Tensors = Mapping[str, torch.Tensor]

_NORMS = {"input_layernorm.weight": "input_layernorm.weight",
          "post_attention_layernorm.weight": "pre_mlp_layernorm.weight"}
_QK_NORMS = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
             "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}
_MLA = {"self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
        "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
        "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
        "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",  # q_lora_rank = 0
        "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
        "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
        "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
        "self_attn.o_proj.weight": "self_attention.linear_proj.weight"}
_ROUTER = {"mlp.gate.weight": "mlp.router.weight", "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias"}


class ConversionError(KeyError):
    """A checkpoint lacks a tensor the target layout needs, or holds one it cannot place."""

    def __str__(self) -> str:  # KeyError quotes its message; this one is a sentence
        return str(self.args[0])


# --------------------------------------------------------------------------------------------- config
def transformer_config(dims: ModelDims, *, rope_theta: float = 1e6, rms_norm_eps: float = 1e-6,
                       hf_config: Optional[Mapping] = None) -> dict:
    """Keyword arguments of megatron-core's ``TransformerConfig`` (``MLATransformerConfig`` when
    ``dims.is_mla``) for the model's architecture; parallel sizes, dtype and recompute are added by
    the engine. ``hf_config``: the HF ``config.json`` dict, for the routing details it alone holds."""
    import torch.nn.functional as F

    hf = dict(hf_config or {})
    kw = dict(num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_heads,
              ffn_hidden_size=dims.intermediate_size, normalization="RMSNorm", layernorm_epsilon=rms_norm_eps,
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              bias_activation_fusion=False, attention_dropout=0.0, hidden_dropout=0.0)
    if dims.is_mla:
        # qk_layernorm: megatron's local MLA spec builds q_layernorm / kv_layernorm (HF q_a_layernorm,
        # kv_a_layernorm) only with it, IdentityOp otherwise; kv_channels = v_head_dim: the attention
        # output per head is a value head (megatron's local DotProductAttention sizes it so)
        kw.update(q_lora_rank=dims.q_lora_rank or None, kv_lora_rank=dims.kv_lora_rank,
                  qk_head_dim=dims.qk_nope_head_dim, qk_pos_emb_head_dim=dims.qk_rope_head_dim,
                  v_head_dim=dims.v_head_dim, rotary_base=rope_theta, qk_layernorm=True,
                  kv_channels=dims.v_head_dim)
        scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # transformers v4 / v5
        if scaling.get("type", scaling.get("rope_type")) == "yarn":
            kw.update(rope_type="yarn", rotary_scaling_factor=scaling["factor"],
                      original_max_position_embeddings=scaling["original_max_position_embeddings"],
                      beta_fast=scaling.get("beta_fast", 32), beta_slow=scaling.get("beta_slow", 1),
                      mscale=scaling.get("mscale", 1.0), mscale_all_dim=scaling.get("mscale_all_dim", 0.0))
        else:
            kw.update(rope_type="rope")
    else:
        kw.update(num_query_groups=dims.num_kv_heads, kv_channels=dims.head_dim,
                  add_qkv_bias=dims.attention_bias, qk_layernorm=dims.family == "qwen3_moe")
    if dims.is_moe:
        kw.update(num_moe_experts=dims.num_experts, moe_ffn_hidden_size=dims.moe_intermediate_size,
                  moe_router_topk=dims.experts_per_token, moe_grouped_gemm=False,
                  moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
                  moe_layer_freq=moe_layer_pattern(dims))
        if dims.num_shared_experts:
            kw["moe_shared_expert_intermediate_size"] = dims.num_shared_experts * dims.moe_intermediate_size
        if dims.family == "deepseek_v3":
            kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_dtype="fp32",
                      moe_router_num_groups=hf.get("n_group"), moe_router_group_topk=hf.get("topk_group"),
                      moe_router_topk_scaling_factor=hf.get("routed_scaling_factor"))
        else:  # Qwen3-MoE: softmax over the top-k logits = softmax, top-k, renormalise (norm_topk_prob,
            # true in Qwen3-30B-A3B); without renormalising, softmax over all experts first
            kw.update(moe_router_score_function="softmax",
                      moe_router_pre_softmax=not hf.get("norm_topk_prob", True))
    return kw


def rope_theta(hf_config: Optional[Mapping]) -> float:
    """RoPE base of an HF config dict: ``rope_theta`` (transformers v4) or ``rope_parameters`` (v5)."""
    hf = dict(hf_config or {})
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta")
    return float(theta or 10000.0)


def gpt_model_kwargs(dims: ModelDims, *, rope_theta: float = 1e6) -> dict:
    """Keyword arguments of ``GPTModel`` besides the config and the layer spec."""
    return dict(vocab_size=dims.vocab_size, max_sequence_length=dims.max_position_embeddings,
                position_embedding_type="rope", rotary_base=int(rope_theta),
                share_embeddings_and_output_weights=dims.tie_embeddings)


def block_spec_kwargs() -> dict:
    """Keyword arguments of megatron's ``get_gpt_decoder_block_spec`` besides the config and the stage:
    megatron-core's own modules (no TransformerEngine), RMSNorm (without it megatron picks apex's
    ``FusedLayerNorm`` where apex imports, which only does LayerNorm). The block spec places dense and
    MoE layers by ``moe_layer_freq`` and keeps the stage's layers only."""
    return dict(use_transformer_engine=False, normalization="RMSNorm")


def moe_layer_pattern(dims: ModelDims) -> list[int]:
    """megatron's ``moe_layer_freq`` list: 0 for a dense layer (HF ``first_k_dense_replace``), 1 for MoE."""
    if not dims.is_moe:
        return [0] * dims.num_layers
    return [0] * dims.first_k_dense + [1] * (dims.num_layers - dims.first_k_dense)


# --------------------------------------------------------------------------------------------- q/k/v
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: ModelDims) -> torch.Tensor:
    """HF q [nh*d, ...], k/v [ng*d, ...] -> megatron's grouped ``[ng * (nh/ng + 2) * d, ...]``."""
    ng, d = dims.num_kv_heads, dims.head_dim
    per = dims.num_heads // ng
    tail = q.shape[1:]
    q = q.reshape(ng, per * d, *tail)
    return torch.cat([q, k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, dims: ModelDims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, d = dims.num_kv_heads, dims.head_dim
    per = dims.num_heads // ng
    tail = qkv.shape[1:]
    g = qkv.reshape(ng, (per + 2) * d, *tail)
    q, k, v = g.split([per * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


# --------------------------------------------------------------------------------------------- names
def _take(src: Tensors, key: str, used: set) -> torch.Tensor:
    if key not in src:
        raise ConversionError(f"the HF checkpoint has no {key}; the model config expects it (is it the same "
                              "model family and size as config.json says?)")
    used.add(key)
    return src[key]


def _stage(dims: ModelDims, layers: Optional[tuple[int, int]]) -> tuple[int, int, bool, bool]:
    first, stop = layers or (0, dims.num_layers)
    if not 0 <= first < stop <= dims.num_layers:
        raise ValueError(f"layers={layers}: expected 0 <= first < stop <= {dims.num_layers}")
    return first, stop, first == 0, stop == dims.num_layers


def _renames(dims: ModelDims, hf_keys, first: int, stop: int, pre: bool, post: bool):
    """(HF name, megatron name) of every tensor that moves unchanged, for the stage's layers;
    optional ones (MLA's q_lora path, the router's expert bias) only where ``hf_keys`` has them."""
    if pre:
        yield "model.embed_tokens.weight", "embedding.word_embeddings.weight"
    if post:
        yield "model.norm.weight", "decoder.final_layernorm.weight"
        if not dims.tie_embeddings:
            yield "lm_head.weight", "output_layer.weight"
    for i in range(first, stop):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i - first}."
        table = dict(_NORMS)
        if dims.is_mla:
            table.update({a: b for a, b in _MLA.items() if h + a in hf_keys})
        else:
            table["self_attn.o_proj.weight"] = "self_attention.linear_proj.weight"
            if dims.family == "qwen3_moe":
                table.update(_QK_NORMS)
        if dims.is_moe and i >= dims.first_k_dense:
            table.update({a: b for a, b in _ROUTER.items() if h + a in hf_keys})
        for a, b in table.items():
            yield h + a, m + b


def _layer_keys(dims: ModelDims, i: int, first: int) -> tuple[str, str, bool]:
    return f"model.layers.{i}.", f"decoder.layers.{i - first}.", dims.is_moe and i >= dims.first_k_dense


def hf_to_megatron(hf: Tensors, dims: ModelDims, *, layers: Optional[tuple[int, int]] = None,
                   strict: bool = True) -> dict[str, torch.Tensor]:
    """Full HF tensors (transformers v5 names, fused experts) -> megatron-core names and layouts for
    the stage holding ``layers`` (all by default). ``strict``: every HF tensor of the stage is used."""
    first, stop, pre, post = _stage(dims, layers)
    used: set[str] = set()
    out = {b: _take(hf, a, used) for a, b in _renames(dims, hf, first, stop, pre, post)}
    for i in range(first, stop):
        h, m, moe = _layer_keys(dims, i, first)
        if not dims.is_mla:
            for kind in ("weight", "bias") if dims.attention_bias else ("weight",):
                out[m + f"self_attention.linear_qkv.{kind}"] = fuse_qkv(
                    *(_take(hf, h + f"self_attn.{p}_proj.{kind}", used) for p in "qkv"), dims)
        if moe:
            gate_up = _take(hf, h + "mlp.experts.gate_up_proj", used)
            down = _take(hf, h + "mlp.experts.down_proj", used)
            for e in range(dims.num_experts):
                out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
                out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
        for hp, mp in _glu_mlps(dims, h, m, moe):
            out[mp + "linear_fc1.weight"] = torch.cat(
                [_take(hf, hp + "gate_proj.weight", used), _take(hf, hp + "up_proj.weight", used)])
            out[mp + "linear_fc2.weight"] = _take(hf, hp + "down_proj.weight", used)
    if strict:
        mine = [k for k in hf if _in_stage(k, first, stop, pre, post, dims)]
        extra = sorted(set(mine) - used)
        if extra:
            raise ConversionError(f"HF tensors with no megatron place: {', '.join(extra[:5])}"
                                  + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else ""))
    return out


def _glu_mlps(dims: ModelDims, h: str, m: str, moe: bool) -> list[tuple[str, str]]:
    """(HF prefix, megatron prefix) of the layer's gate/up/down MLPs: the dense MLP, or the shared experts."""
    if not moe:
        return [(h + "mlp.", m + "mlp.")]
    return [(h + "mlp.shared_experts.", m + "mlp.shared_experts.")] if dims.num_shared_experts else []


def _in_stage(key: str, first: int, stop: int, pre: bool, post: bool, dims: ModelDims) -> bool:
    if key.startswith("model.layers."):
        return first <= int(key.split(".")[2]) < stop
    if key == "model.embed_tokens.weight":
        return pre
    if key == "lm_head.weight":
        return post and not dims.tie_embeddings
    return post


def megatron_to_hf(mg: Tensors, dims: ModelDims, *, layers: Optional[tuple[int, int]] = None) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_megatron` (HF v5 names, fused experts; a tied head is omitted)."""
    first, stop, pre, post = _stage(dims, layers)
    used: set[str] = set()
    # optional tensors exist on the HF side exactly when their megatron counterparts do
    present = {a for a, b in _renames(dims, _AllKeys(), first, stop, pre, post) if b in mg}
    out = {a: _take(mg, b, used) for a, b in _renames(dims, present, first, stop, pre, post)}
    for i in range(first, stop):
        h, m, moe = _layer_keys(dims, i, first)
        if not dims.is_mla:
            for kind in ("weight", "bias") if dims.attention_bias else ("weight",):
                q, k, v = split_qkv(_take(mg, m + f"self_attention.linear_qkv.{kind}", used), dims)
                out.update({h + f"self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v))})
        if moe:
            e_pre = m + "mlp.experts.local_experts."
            out[h + "mlp.experts.gate_up_proj"] = torch.stack(
                [_take(mg, e_pre + f"{e}.linear_fc1.weight", used) for e in range(dims.num_experts)])
            out[h + "mlp.experts.down_proj"] = torch.stack(
                [_take(mg, e_pre + f"{e}.linear_fc2.weight", used) for e in range(dims.num_experts)])
        for hp, mp in _glu_mlps(dims, h, m, moe):
            out[hp + "gate_proj.weight"], out[hp + "up_proj.weight"] = _take(mg, mp + "linear_fc1.weight", used).chunk(2)
            out[hp + "down_proj.weight"] = _take(mg, mp + "linear_fc2.weight", used)
    extra = sorted(k for k in set(mg) - used if not k.endswith("_extra_state"))
    if extra:
        raise ConversionError(f"megatron tensors with no HF place: {', '.join(extra[:5])}")
    return out


class _AllKeys:
    """A key set that holds everything (lists every optional rename, to be filtered by what exists)."""

    def __contains__(self, _key) -> bool:
        return True
