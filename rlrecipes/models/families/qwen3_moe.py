"""Qwen3 MoE (``Qwen3MoeForCausalLM``): GQA with per-head q/k RMS norms, top-k routed fused experts."""
from __future__ import annotations

from ..dims import ModelDims
from .base import COMMON_SHARDING, Family, fused_experts, gqa_attention


def _layer(d: ModelDims, i: int, add) -> None:
    gqa_attention(d, add, qk_norm=True)
    fused_experts(d, add)


def _config(d: ModelDims, common: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**common, head_dim=d.head_dim, num_experts=d.num_experts,
                          moe_intermediate_size=d.moe_intermediate_size,
                          num_experts_per_tok=d.experts_per_token, norm_topk_prob=True)


FAMILY = Family(
    name="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    # published config.json of Qwen/Qwen3-30B-A3B
    presets={"qwen3-30b-a3b": ModelDims(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
        moe_intermediate_size=768, experts_per_token=8, max_position_embeddings=40960,
    )},
    # heads, KV heads and experts divide by the smoke layouts' TP and EP
    # head_dim 32: the smallest head size vLLM's CPU attention takes (the vllm engine runs it too)
    smoke=ModelDims(
        family="qwen3_moe", vocab_size=32, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
        head_dim=32, intermediate_size=128, num_experts=8, moe_intermediate_size=32,
        experts_per_token=2, max_position_embeddings=256,
    ),
    sharding={**COMMON_SHARDING, "q_norm": "replicated", "k_norm": "replicated", "gate": "replicated",
              "experts.gate_up_proj": "expert", "experts.down_proj": "expert"},
    attention_and_mlp=_layer,
    build_config=_config,
    read_config=lambda cfg: dict(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                                 experts_per_token=cfg.num_experts_per_tok),
)
