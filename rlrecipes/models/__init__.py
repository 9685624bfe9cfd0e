"""Model families: HF classes, pinned real dimensions, smoke dimensions and parameter counts.

Model math lives in HF transformers (Qwen2ForCausalLM, Qwen3MoeForCausalLM,
DeepseekV3ForCausalLM); this package only says how to build each family from a
config and what the real checkpoints look like, so that the planner can size a
671B run without downloading anything.

Parallel sharding rules (which dimension TP splits, which tensors are experts)
are derived from the HF parameter names in :mod:`rlrecipes.models.sharding`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

FAMILIES = ("qwen2", "qwen3_moe", "deepseek_v3")


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

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2) + self.hidden_size

    def total_params(self) -> int:
        return self.embedding_params() + sum(sum(self.layer_params(i)) for i in range(self.num_layers))

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


# Real checkpoints, pinned so the planner never needs a download. Values from the
# published config.json of each model.
PRESETS: dict[str, ModelDims] = {
    "qwen2.5-7b": ModelDims(
        family="qwen2", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, intermediate_size=18944, attention_bias=True,
        max_position_embeddings=32768,
    ),
    "qwen3-30b-a3b": ModelDims(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, intermediate_size=6144, num_experts=128,
        moe_intermediate_size=768, experts_per_token=8, max_position_embeddings=40960,
    ),
    "deepseek-v3-671b": ModelDims(
        family="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
        num_kv_heads=128, head_dim=192, intermediate_size=18432, num_experts=256,
        moe_intermediate_size=2048, experts_per_token=8, num_shared_experts=1, first_k_dense=3,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_position_embeddings=163840,
    ),
}

# Tiny same-architecture dimensions for --smoke runs (CPU, minutes). Heads, KV heads
# and experts are chosen to divide by the smoke layouts' TP and EP.
SMOKE: dict[str, ModelDims] = {
    "qwen2": ModelDims(
        family="qwen2", vocab_size=32, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, attention_bias=True, max_position_embeddings=256,
    ),
    "qwen3_moe": ModelDims(
        family="qwen3_moe", vocab_size=32, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, num_experts=8, moe_intermediate_size=32,
        experts_per_token=2, max_position_embeddings=256,
    ),
    "deepseek_v3": ModelDims(
        family="deepseek_v3", vocab_size=32, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=24, intermediate_size=128, num_experts=8, moe_intermediate_size=32,
        experts_per_token=2, num_shared_experts=1, first_k_dense=1, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=256,
    ),
}

HF_ARCHITECTURE = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def smoke_dims(family: str, **overrides: Any) -> ModelDims:
    if family not in SMOKE:
        raise KeyError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    return replace(SMOKE[family], **overrides)


def hf_config(dims: ModelDims, **extra: Any):
    """A transformers config of the family with these dimensions (no download)."""
    from transformers import DeepseekV3Config, Qwen2Config, Qwen3MoeConfig

    common = dict(
        vocab_size=dims.vocab_size, hidden_size=dims.hidden_size, num_hidden_layers=dims.num_layers,
        num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads,
        intermediate_size=dims.intermediate_size, tie_word_embeddings=dims.tie_embeddings,
        max_position_embeddings=dims.max_position_embeddings, architectures=[HF_ARCHITECTURE[dims.family]],
    )
    common.update(extra)
    if dims.family == "qwen2":
        return Qwen2Config(**common)
    if dims.family == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, head_dim=dims.head_dim, num_experts=dims.num_experts,
            moe_intermediate_size=dims.moe_intermediate_size, num_experts_per_tok=dims.experts_per_token,
            norm_topk_prob=True,
        )
    if dims.family == "deepseek_v3":
        return DeepseekV3Config(
            **common, n_routed_experts=dims.num_experts, n_shared_experts=dims.num_shared_experts,
            moe_intermediate_size=dims.moe_intermediate_size, num_experts_per_tok=dims.experts_per_token,
            first_k_dense_replace=dims.first_k_dense, q_lora_rank=dims.q_lora_rank,
            kv_lora_rank=dims.kv_lora_rank, qk_nope_head_dim=dims.qk_nope_head_dim,
            qk_rope_head_dim=dims.qk_rope_head_dim, v_head_dim=dims.v_head_dim, n_group=1, topk_group=1,
        )
    raise KeyError(f"unknown model family {dims.family!r}; choose one of {', '.join(FAMILIES)}")


def dims_from_hf_config(cfg) -> ModelDims:
    """Read ModelDims back from a transformers config (e.g. an HF folder's config.json)."""
    arch = (getattr(cfg, "architectures", None) or [""])[0]
    family = {v: k for k, v in HF_ARCHITECTURE.items()}.get(arch) or {
        "qwen2": "qwen2", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3"}.get(cfg.model_type)
    if family is None:
        raise ValueError(f"unsupported architecture {arch or cfg.model_type!r}; supported: {', '.join(HF_ARCHITECTURE.values())}")
    heads = cfg.num_attention_heads
    kw: dict[str, Any] = dict(
        family=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        intermediate_size=cfg.intermediate_size, tie_embeddings=bool(cfg.tie_word_embeddings),
        attention_bias=family == "qwen2", max_position_embeddings=cfg.max_position_embeddings,
    )
    if family == "qwen3_moe":
        kw.update(num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                  experts_per_token=cfg.num_experts_per_tok)
    if family == "deepseek_v3":
        kw.update(num_experts=cfg.n_routed_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                  experts_per_token=cfg.num_experts_per_tok, num_shared_experts=cfg.n_shared_experts,
                  first_k_dense=cfg.first_k_dense_replace, q_lora_rank=cfg.q_lora_rank or 0,
                  kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                  qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                  head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    return ModelDims(**kw)


__all__ = ["FAMILIES", "HF_ARCHITECTURE", "ModelDims", "PRESETS", "SMOKE", "dims_from_hf_config",
           "hf_config", "smoke_dims"]


def param_specs(source: Any, pp_layers=None) -> list:
    """The resharder's ParamSpecs of a family's model (see :mod:`rlrecipes.models.sharding`)."""
    from .sharding import param_specs as _specs

    return _specs(source, pp_layers)
