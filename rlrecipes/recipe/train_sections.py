"""Recipe sections of the train roles: their layouts, LoRA, the actor, the reference model and the critic."""
from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from .base import _Strict, registered_engine




# ---------------------------------------------------------------------------------------------
# layouts and engines
# ---------------------------------------------------------------------------------------------
class TrainLayout(_Strict):
    """A train role's layout keys; ``recipe.roles.role_layout`` makes the role's
    ``rlrecipes.core.parallel.ParallelLayout`` of them (DP inferred from its devices), which ``plan``
    checks and the engines and the resharder build from."""

    tp: int = Field(1, ge=1)
    """Tensor-parallel size."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size."""
    ep: int = Field(1, ge=1)
    """Expert-parallel size (carved out of dp*tp)."""
    sp: int = Field(1, ge=1)
    """Sequence-parallel size: each micro-batch's sequences are split over ``sp`` devices, which see
    the same samples (carved out of DP: DP = devices / (tp * pp * sp)). The native engine runs
    Ulysses (attention over all-to-all head shards); megatron runs it as ``context_parallel_size``."""
    pp_layers: Optional[list[int]] = None
    """Layers per pipeline stage, e.g. [7,7,8,8,8,8,8,7]; even split when null."""


class LoraConfig(_Strict):
    """LoRA adapters on the actor (PEFT); ``rank: 0`` is off."""

    rank: int = Field(0, ge=0)
    """Adapter rank r; 0: full-parameter training."""
    alpha: float = Field(16.0, gt=0)
    """Scale alpha (the update is alpha / r * B A)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    """Linear layers (by name) that get adapters."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ActorConfig(_Strict):
    @field_validator("engine")
    @classmethod
    def _train_engine(cls, v: str) -> str:
        return registered_engine(v, "train", "actor.engine")

    engine: str = "native"
    """Training engine, by its name in the engine registry: native (HF + FSDP2 + DTensor TP/EP, any
    device) or megatron (megatron-core / MindSpeed)."""
    layout: TrainLayout = Field(default_factory=TrainLayout)
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip."""
    freeze_vision_tower: bool = True
    """Vision-language models: keep the vision tower (patch embedding and blocks) frozen and train the
    merger and the decoder, as the published Qwen2.5-VL GRPO runs do; false trains the tower too."""
    offload_optimizer: bool = False
    """Keep Adam state on the host between optimizer steps (native: swapped in for each step; megatron:
    swap-optimizer); the planner counts it off-device."""
    recompute: bool = True
    """Activation recomputation per decoder layer (native: activation checkpointing; megatron: full
    recompute); the planner's activation estimate uses it."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA: adapters trained, the base frozen; the reference policy is the base (adapters off)."""


class RefConfig(_Strict):
    enabled: bool = True
    """Compute reference log-probs (needed for a KL term)."""
    layout: Optional[TrainLayout] = None
    """Reference layout; null reuses the actor layout (colocated)."""


class CriticConfig(_Strict):
    layout: Optional[TrainLayout] = None
    """Critic layout (PPO); null reuses the actor layout."""
    lr: float = Field(1e-5, gt=0)
    """Critic learning rate."""
