"""Architecture dimensions shared by the model families (:class:`ModelDims`) and parameter counts."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelDims:
    """Architecture dimensions shared by the three families (unused fields stay 0)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers / shared expert base)
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    # MoE
    num_experts: int = 0
    moe_intermediate_size: int = 0
    experts_per_token: int = 0
    num_shared_experts: int = 0
    first_k_dense: int = 0  # DeepSeek: the first k layers are dense
    # MLA (DeepSeek-V3)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    max_position_embeddings: int = 32768
    # vision tower (Qwen2.5-VL; 0 = a text-only model)
    vision_depth: int = 0
    vision_hidden: int = 0
    vision_intermediate: int = 0
    vision_heads: int = 0
    patch_size: int = 14
    spatial_merge: int = 2
    temporal_patch: int = 2
    image_token_id: int = 0
    vision_start_token_id: int = 0
    vision_end_token_id: int = 0

    # ---- parameter counts -------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def attention_params(self) -> int:
        h = self.hidden_size
        if self.is_mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * qk_head
                 if self.q_lora_rank else h * self.num_heads * qk_head)
            kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim))
            o = self.num_heads * self.v_head_dim * h
            return q + kv + o
        q = h * self.num_heads * self.head_dim
        kv = 2 * h * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * h
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        norms = 2 * self.head_dim if self.family == "qwen3_moe" else 0
        return q + kv + o + bias + norms

    def dense_mlp_params(self, width: int | None = None) -> int:
        return 3 * self.hidden_size * (width or self.intermediate_size)

    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.is_moe else 0

    def expert_params_per_layer(self) -> int:
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def layer_params(self, layer: int) -> tuple[int, int]:
        """(non-expert, expert) parameters of one decoder layer."""
        norms = 2 * self.hidden_size
        attn = self.attention_params()
        if self.is_moe and layer >= self.first_k_dense:
            router = self.num_experts * self.hidden_size
            shared = self.dense_mlp_params(self.num_shared_experts * self.moe_intermediate_size) if self.num_shared_experts else 0
            return attn + norms + router + shared, self.expert_params_per_layer()
        return attn + norms + self.dense_mlp_params(), 0

    @property
    def has_vision(self) -> bool:
        return self.vision_depth > 0

    def vision_params(self) -> int:
        """Vision tower + merger parameters (0 for a text-only model)."""
        if not self.has_vision:
            return 0
        d, i = self.vision_hidden, self.vision_intermediate
        patch = 3 * self.temporal_patch * self.patch_size ** 2 * d
        block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * d * i + 2 * i) + (i * d + d)
        merged = d * self.spatial_merge ** 2
        merger = d + merged * merged + merged + merged * self.hidden_size + self.hidden_size
        return patch + self.vision_depth * block + merger

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2) + self.hidden_size

    def total_params(self) -> int:
        return (self.embedding_params() + sum(sum(self.layer_params(i)) for i in range(self.num_layers))
                + self.vision_params())

    def expert_params(self) -> int:
        return sum(self.layer_params(i)[1] for i in range(self.num_layers))

    def active_params(self) -> int:
        """Parameters touched per token (routed experts counted top-k)."""
        if not self.is_moe:
            return self.total_params()
        frac = self.experts_per_token / self.num_experts
        return int(self.total_params() - self.expert_params() * (1 - frac))

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token occupies across all layers (unsharded)."""
        if self.is_mla:  # MLA caches the compressed latent + rope key, shared by all heads
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_layer = 2 * self.num_kv_heads * self.head_dim
        return per_layer * self.num_layers * dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


