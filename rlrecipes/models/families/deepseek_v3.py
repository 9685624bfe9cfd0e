"""DeepSeek-V3 / R1 (``DeepseekV3ForCausalLM``): MLA attention, first-k dense layers, then routed
fused experts with a shared expert and a sigmoid router with a score-correction bias."""
from __future__ import annotations

from ..dims import ModelDims
from .base import COMMON_SHARDING, Family, dense_mlp, fused_experts


def _mla(d: ModelDims, add) -> None:
    H, qk = d.hidden_size, d.qk_nope_head_dim + d.qk_rope_head_dim
    if d.q_lora_rank:
        add("self_attn.q_a_proj.weight", (d.q_lora_rank, H))
        add("self_attn.q_a_layernorm.weight", (d.q_lora_rank,))
        add("self_attn.q_b_proj.weight", (d.num_heads * qk, d.q_lora_rank), qk, "heads")
    else:
        add("self_attn.q_proj.weight", (d.num_heads * qk, H), qk, "heads")
    add("self_attn.kv_a_proj_with_mqa.weight", (d.kv_lora_rank + d.qk_rope_head_dim, H))
    add("self_attn.kv_a_layernorm.weight", (d.kv_lora_rank,))
    add("self_attn.kv_b_proj.weight", (d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank),
        d.qk_nope_head_dim + d.v_head_dim, "heads")
    add("self_attn.o_proj.weight", (H, d.num_heads * d.v_head_dim), d.v_head_dim, "heads")


def _layer(d: ModelDims, i: int, add) -> None:
    _mla(d, add)
    if i < d.first_k_dense:
        dense_mlp(d, add)
        return
    fused_experts(d, add)
    add("mlp.gate.e_score_correction_bias", (d.num_experts,))
    if d.num_shared_experts:
        dense_mlp(d, add, "mlp.shared_experts", d.num_shared_experts * d.moe_intermediate_size)


def _config(d: ModelDims, common: dict):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **common, n_routed_experts=d.num_experts, n_shared_experts=d.num_shared_experts,
        moe_intermediate_size=d.moe_intermediate_size, num_experts_per_tok=d.experts_per_token,
        first_k_dense_replace=d.first_k_dense, q_lora_rank=d.q_lora_rank, kv_lora_rank=d.kv_lora_rank,
        qk_nope_head_dim=d.qk_nope_head_dim, qk_rope_head_dim=d.qk_rope_head_dim, v_head_dim=d.v_head_dim,
        n_group=1, topk_group=1,
        # as in the published config.json: vLLM reads these (HF's class always routes this way)
        topk_method="noaux_tc", scoring_func="sigmoid",
    )


def _read(cfg) -> dict:
    return dict(num_experts=cfg.n_routed_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                experts_per_token=cfg.num_experts_per_tok, num_shared_experts=cfg.n_shared_experts,
                first_k_dense=cfg.first_k_dense_replace, q_lora_rank=cfg.q_lora_rank or 0,
                kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)


FAMILY = Family(
    name="deepseek_v3",
    hf_architecture="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    # published config.json of deepseek-ai/DeepSeek-V3 (R1 has the same architecture)
    presets={"deepseek-v3-671b": ModelDims(
        family="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
        num_kv_heads=128, head_dim=192, intermediate_size=18432, num_experts=256,
        moe_intermediate_size=2048, experts_per_token=8, num_shared_experts=1, first_k_dense=3,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=163840,
    )},
    smoke=ModelDims(
        family="deepseek_v3", vocab_size=32, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=24, intermediate_size=128, num_experts=8, moe_intermediate_size=32,
        experts_per_token=2, num_shared_experts=1, first_k_dense=1, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=256,
    ),
    sharding={**COMMON_SHARDING, "q_b_proj": "column", "kv_b_proj": "column",
              "q_a_proj": "replicated", "kv_a_proj_with_mqa": "replicated",
              "q_a_layernorm": "replicated", "kv_a_layernorm": "replicated", "gate": "replicated",
              "gate.e_score_correction_bias": "replicated",
              "experts.gate_up_proj": "expert", "experts.down_proj": "expert"},
    attention_and_mlp=_layer,
    build_config=_config,
    read_config=_read,
)
