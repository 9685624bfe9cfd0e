"""Native PPO critic: the actor's engine (:class:`~rlrecipes.engines.native.train.NativeTrainEngine`)
with a ``Linear(hidden, 1)`` value head in the ``lm_head`` slot. The registry builds it for
``role="critic"`` through its inherited ``create`` (the native package names it in ``CRITIC``)."""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from rlrecipes.engines.native.loader import ModelSource
from rlrecipes.engines.native.train import NativeTrainEngine


class NativeValueEngine(NativeTrainEngine):
    """PPO critic: the HF backbone + ``Linear(hidden, 1)`` per token (the ``lm_head`` slot).

    Same batches as the actor; ``values(batch) -> [B, R]`` are read at the same positions as the
    actor's log-probs (the state before each response token). ``loss_fn(values [b, R], None, mb)``.
    The head is replicated over TP; the rest is sharded exactly like the actor.
    """

    metric_prefix = "critic"
    serves = ("critic",)

    def __init__(self, model: ModelSource, **kwargs):
        kwargs.setdefault("role", "critic")
        super().__init__(model, **kwargs)

    def _adapt_model(self, model: nn.Module) -> nn.Module:
        hidden = model.config.hidden_size
        g = torch.Generator().manual_seed(self.seed)
        dtype = model.lm_head.weight.dtype
        # the initial head, kept whole (H + 1 numbers) so a meta-built model fills its shards from it
        self._head_init = {"lm_head.weight": torch.randn(1, hidden, generator=g).mul_(hidden ** -0.5).to(dtype),
                           "lm_head.bias": torch.zeros(1, dtype=dtype)}
        head = nn.Linear(hidden, 1, bias=True, dtype=dtype, device=model.lm_head.weight.device)
        if head.weight.device.type != "meta":
            with torch.no_grad():
                head.weight.copy_(self._head_init["lm_head.weight"])
                head.bias.zero_()
        model.config.tie_word_embeddings = False
        model.lm_head = head
        model.config.critic_head = True
        return model

    def _init_missing(self, name, shape):
        return self._head_init.get(name)

    def _head_output(self, logits, targets, temperature, with_entropy):
        return logits[..., 0].float(), None  # [b, R]

    @torch.no_grad()
    def values(self, batch: Mapping[str, Any], *, micro_batch_size: int | None = None) -> torch.Tensor:
        """Per-token values ``[B, R]`` (fp32)."""
        return self.log_probs(batch, micro_batch_size=micro_batch_size)[0]

    def export_hf(self, folder, *, dtype=None):
        raise TypeError("a critic has a value head, not an LM head: use save()/load() (DCP)")


__all__ = ["NativeValueEngine"]
