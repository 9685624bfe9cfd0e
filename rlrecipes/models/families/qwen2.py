"""Qwen2 / Qwen2.5 dense decoder (``Qwen2ForCausalLM``): GQA attention with q/k/v biases."""
from __future__ import annotations

from ..dims import ModelDims
from .base import COMMON_SHARDING, Family, dense_mlp, gqa_attention


def _layer(d: ModelDims, i: int, add) -> None:
    gqa_attention(d, add, qk_norm=False)
    dense_mlp(d, add)


def _config(d: ModelDims, common: dict):
    from transformers import Qwen2Config

    return Qwen2Config(**common)


FAMILY = Family(
    name="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    presets={
        # published config.json of Qwen/Qwen2.5-7B-Instruct
        "qwen2.5-7b": ModelDims(
            family="qwen2", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
            num_kv_heads=4, head_dim=128, intermediate_size=18944, attention_bias=True,
            max_position_embeddings=32768,
        ),
        # published config.json of Qwen/Qwen2.5-32B (MindSpeed-RL's 32B runs, which
        # benchmarks/predict_vs_published.py predicts)
        "qwen2.5-32b": ModelDims(
            family="qwen2", vocab_size=152064, hidden_size=5120, num_layers=64, num_heads=40,
            num_kv_heads=8, head_dim=128, intermediate_size=27648, attention_bias=True,
            max_position_embeddings=32768,
        ),
    },
    # head_dim 32: the smallest head size vLLM's CPU attention takes (the vllm engine runs it too)
    smoke=ModelDims(
        family="qwen2", vocab_size=32, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
        head_dim=32, intermediate_size=128, attention_bias=True, max_position_embeddings=256,
    ),
    sharding=dict(COMMON_SHARDING),
    attention_and_mlp=_layer,
    build_config=_config,
    read_config=lambda cfg: {"attention_bias": True},
)
