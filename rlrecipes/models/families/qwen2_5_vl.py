"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a Qwen2 decoder whose image tokens are the
outputs of a ViT (``model.visual``: patch embedding, windowed-attention blocks, a 2x2 patch merger
into the decoder's hidden size), with M-RoPE (3-D) positions (``rlrecipes.models.vision``).

The vision tower and merger are replicated over TP (``models/sharding.py``: every ``visual.``
parameter), sit on the first pipeline stage, and move with the decoder's weights every step."""
from __future__ import annotations

from ..dims import ModelDims
from .base import COMMON_SHARDING, Family, dense_mlp, gqa_attention


def _layer(d: ModelDims, i: int, add) -> None:
    gqa_attention(d, add, qk_norm=False)
    dense_mlp(d, add)


def _vision(d: ModelDims, add) -> None:
    v, i, m2 = d.vision_hidden, d.vision_intermediate, d.spatial_merge ** 2
    add("model.visual.patch_embed.proj.weight", (v, 3, d.temporal_patch, d.patch_size, d.patch_size))
    for b in range(d.vision_depth):
        p = f"model.visual.blocks.{b}."
        add(p + "norm1.weight", (v,))
        add(p + "norm2.weight", (v,))
        add(p + "attn.qkv.weight", (3 * v, v))
        add(p + "attn.qkv.bias", (3 * v,))
        add(p + "attn.proj.weight", (v, v))
        add(p + "attn.proj.bias", (v,))
        for proj, shape in (("gate_proj", (i, v)), ("up_proj", (i, v)), ("down_proj", (v, i))):
            add(p + f"mlp.{proj}.weight", shape)
            add(p + f"mlp.{proj}.bias", (shape[0],))
    add("model.visual.merger.ln_q.weight", (v,))
    add("model.visual.merger.mlp.0.weight", (v * m2, v * m2))
    add("model.visual.merger.mlp.0.bias", (v * m2,))
    add("model.visual.merger.mlp.2.weight", (d.hidden_size, v * m2))
    add("model.visual.merger.mlp.2.bias", (d.hidden_size,))


def mrope_section(head_dim: int) -> list[int]:
    """Rotary dims per (t, h, w) axis: Qwen2.5-VL's [16, 24, 24] at head_dim 128, scaled."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _config(d: ModelDims, common: dict):
    from transformers import Qwen2_5_VLConfig

    text = {k: v for k, v in common.items() if k not in ("architectures", "tie_word_embeddings")}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0,
                               "mrope_section": mrope_section(d.head_dim)}
    text.update(bos_token_id=None, eos_token_id=None)
    depth = d.vision_depth
    full = [b for b in range(depth) if b % 8 == 7] or [depth - 1]
    vision = dict(depth=depth, hidden_size=d.vision_hidden, intermediate_size=d.vision_intermediate,
                  num_heads=d.vision_heads, out_hidden_size=d.hidden_size, patch_size=d.patch_size,
                  spatial_merge_size=d.spatial_merge, temporal_patch_size=d.temporal_patch,
                  window_size=112, fullatt_block_indexes=full)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=d.image_token_id,
                            vision_start_token_id=d.vision_start_token_id, vision_end_token_id=d.vision_end_token_id,
                            video_token_id=d.vocab_size - 1, tie_word_embeddings=d.tie_embeddings,
                            architectures=common.get("architectures"))


def _read(cfg) -> dict:
    v = cfg.vision_config
    return dict(attention_bias=True, vision_depth=v.depth, vision_hidden=v.hidden_size,
                vision_intermediate=v.intermediate_size, vision_heads=v.num_heads, patch_size=v.patch_size,
                spatial_merge=v.spatial_merge_size, temporal_patch=v.temporal_patch_size,
                image_token_id=cfg.image_token_id, vision_start_token_id=cfg.vision_start_token_id,
                vision_end_token_id=cfg.vision_end_token_id)


_REAL_VISION = dict(vision_depth=32, vision_hidden=1280, vision_heads=16, patch_size=14, spatial_merge=2,
                    temporal_patch=2, image_token_id=151655, vision_start_token_id=151652,
                    vision_end_token_id=151653)

FAMILY = Family(
    name="qwen2_5_vl",
    hf_architecture="Qwen2_5_VLForConditionalGeneration",
    model_type="qwen2_5_vl",
    presets={
        # published config.json of Qwen/Qwen2.5-VL-7B-Instruct
        "qwen2.5-vl-7b": ModelDims(
            family="qwen2_5_vl", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
            num_kv_heads=4, head_dim=128, intermediate_size=18944, attention_bias=True,
            max_position_embeddings=128000, vision_intermediate=3420, **_REAL_VISION,
        ),
        # published config.json of Qwen/Qwen2.5-VL-32B-Instruct
        "qwen2.5-vl-32b": ModelDims(
            family="qwen2_5_vl", vocab_size=152064, hidden_size=5120, num_layers=64, num_heads=40,
            num_kv_heads=8, head_dim=128, intermediate_size=27648, attention_bias=True,
            max_position_embeddings=128000, vision_intermediate=3456, **_REAL_VISION,
        ),
    },
    # the smoke tokenizer with vision tokens (rlrecipes.data.smoke: 40 ids, <|image_pad|> = 33);
    # head_dim 32 as qwen2's smoke (vLLM's CPU attention), a one-block vision tower
    smoke=ModelDims(
        family="qwen2_5_vl", vocab_size=40, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
        head_dim=32, intermediate_size=128, attention_bias=True, max_position_embeddings=512,
        vision_depth=1, vision_hidden=32, vision_intermediate=64, vision_heads=2, patch_size=14,
        spatial_merge=2, temporal_patch=2, image_token_id=33, vision_start_token_id=31, vision_end_token_id=32,
    ),
    sharding=dict(COMMON_SHARDING),
    attention_and_mlp=_layer,
    build_config=_config,
    read_config=_read,
    text_prefix="model.language_model.",
    extra_params=_vision,
)
