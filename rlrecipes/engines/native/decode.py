"""Fast single-token decode steps for the native rollout engine.

``model.forward`` of an HF causal LM spends most of a 1-token decode step outside the layers:
output-capture decorators, ``create_causal_mask``, position ids / ``cache_position`` bookkeeping,
the rotary embedding, the cache-layer update logic. :class:`FastDecoder` keeps the layers and
drops the rest:

* K/V live in :class:`KVBuffers`, one pre-allocated ``[B, heads, L, dim]`` tensor pair per layer
  (whatever 4-D states the attention module caches: per-head K/V for Qwen, the compressed latent
  ``(kv_nope, k_rot)`` for DeepSeek MLA). ``update`` slice-assigns the new position and returns
  views of the filled prefix, i.e. the same keys a ``DynamicCache`` would return;
* the rotary ``(cos, sin)`` of every decode position is computed once per ``generate`` call;
* the attention mask is a boolean ``[B, 1, 1, L]`` keep-mask over the padded prompt, sliced per
  step (``None`` when nothing is padded, as HF does);
* a step calls ``embed_tokens -> decoder layers -> norm -> lm_head`` directly.

The layers, attention modules and MoE blocks are HF's own (or the engine's TP/EP replacements:
DTensor-parallel linears, ``EPExperts``), so the math -- Qwen3 ``q_norm``/``k_norm``, DeepSeek MLA
latent expansion, routing -- and the TP/EP collectives are exactly those of ``model.forward``.
Prefill stays a normal ``model.forward`` over a ``DynamicCache``, whose states are then copied
into the buffers.

Supported: decoder stacks under ``model.model`` with ``embed_tokens``, ``layers``, ``norm``,
``rotary_emb`` and only full-attention layers. :func:`supports_fast_decode` says whether a model
qualifies; the engine falls back to ``model.forward`` otherwise.
"""
from __future__ import annotations

import torch
import torch.nn as nn


class KVBuffers:
    """Per-layer pre-allocated K/V storage that duck-types ``transformers.Cache.update``.

    ``length`` is the number of filled positions; it advances once per model step
    (:meth:`advance`), after every layer wrote its states at ``[length, length + T)``.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self.capacity = 0

    def fits(self, key_shapes: list[tuple[int, ...]], value_shapes: list[tuple[int, ...]], capacity: int,
             dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the allocated buffers have exactly these per-layer (B, H, *, D) shapes and capacity."""
        if self.capacity != capacity or any(k is None for k in self.keys):
            return False
        for k, v, ks, vs in zip(self.keys, self.values, key_shapes, value_shapes):
            if (k.shape[:2], k.shape[3]) != (ks[:2], ks[3]) or (v.shape[:2], v.shape[3]) != (vs[:2], vs[3]):
                return False
            if k.dtype != dtype or k.device != device:
                return False
        return True

    def load_prefill(self, cache, capacity: int) -> None:
        """Copy a prefilled HF ``DynamicCache`` into the buffers (re-allocating only on shape change)."""
        ks = [layer.keys for layer in cache.layers]
        vs = [layer.values for layer in cache.layers]
        if len(ks) != len(self.keys):
            raise RuntimeError(f"prefill cache has {len(ks)} layers, expected {len(self.keys)}")
        ref = ks[0]
        if not self.fits([tuple(k.shape) for k in ks], [tuple(v.shape) for v in vs], capacity, ref.dtype,
                         ref.device):
            self.keys = [k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3]) for k in ks]  # [B, H, L, Dk]
            self.values = [v.new_empty(v.shape[0], v.shape[1], capacity, v.shape[3]) for v in vs]  # [B, H, L, Dv]
            self.capacity = capacity
        n = ref.shape[2]
        for dst, src in zip(self.keys, ks):
            dst[:, :, :n].copy_(src)
        for dst, src in zip(self.values, vs):
            dst[:, :, :n].copy_(src)
        self.length = n

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        n = self.length
        end = n + key_states.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV buffers full: {end} > capacity {self.capacity}")
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[:, :, n:end].copy_(key_states)
        v[:, :, n:end].copy_(value_states)
        return k[:, :, :end], v[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def advance(self, n: int = 1) -> None:
        self.length += n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)


def supports_fast_decode(model: nn.Module) -> bool:
    """True when ``model`` is an HF causal LM whose decode step :class:`FastDecoder` can run."""
    backbone = getattr(model, "model", None)
    if backbone is None or not hasattr(model, "lm_head"):
        return False
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(backbone, attr):
            return False
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if any(t != "full_attention" for t in types):
        return False  # sliding-window layers need their own mask
    if getattr(cfg, "final_logit_softcapping", None):
        return False
    return True


class FastDecoder:
    """Runs 1-token decode steps of an HF causal LM on :class:`KVBuffers` (see module docstring).

    One ``generate`` call: :meth:`begin` (after the HF prefill), then :meth:`step` per token.
    """

    def __init__(self, model: nn.Module):
        if not supports_fast_decode(model):
            raise ValueError(f"{type(model).__name__}: no fast decode path")
        self.model = model
        backbone = model.model
        self.embed = backbone.embed_tokens
        self.layers = list(backbone.layers[: model.config.num_hidden_layers])
        self.norm = backbone.norm
        self.rotary = backbone.rotary_emb
        self.lm_head = model.lm_head
        self.buffers = KVBuffers(len(self.layers))
        self._cos = self._sin = None
        self._mask = None

    def begin(self, prefill_cache, *, capacity: int, first_pos: torch.Tensor, steps: int,
              prompt_mask: torch.Tensor, like: torch.Tensor) -> None:
        """Take over a prefilled ``DynamicCache``; precompute rotary and mask for ``steps`` decode steps.

        ``first_pos [B, 1]``: position id of the first decoded token; ``prompt_mask [B, P]`` (1 = real
        token); ``like``: a tensor in the compute dtype/device (the prefill logits; rotary only reads those).
        """
        self.buffers.load_prefill(prefill_cache, capacity)
        B, P = prompt_mask.shape
        pos = first_pos + torch.arange(max(steps, 1), device=first_pos.device)  # [B, S]
        self._cos, self._sin = self.rotary(like, pos)  # [B, S, D] each, in like's dtype
        if bool(prompt_mask.all()):
            self._mask = None
        else:
            keep = torch.ones((B, 1, 1, capacity), dtype=torch.bool, device=prompt_mask.device)  # [B, 1, 1, L]
            keep[:, 0, 0, :P] = prompt_mask.bool()
            self._mask = keep

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Feed ``tokens [B]`` as decode step ``t`` (0-based); returns next-token logits ``[B, V]``."""
        buf = self.buffers
        h = self.embed(tokens[:, None])  # [B, 1, H]
        pe = (self._cos[:, t:t + 1], self._sin[:, t:t + 1])  # [B, 1, D] each
        mask = None if self._mask is None else self._mask[..., :buf.length + 1]  # [B, 1, 1, n + 1]
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=pe, past_key_values=buf, use_cache=True)
        buf.advance(1)
        return self.lm_head(self.norm(h))[:, -1]  # [B, V]

    def release(self) -> None:
        self.buffers = KVBuffers(len(self.layers))
        self._cos = self._sin = self._mask = None


__all__ = ["FastDecoder", "KVBuffers", "supports_fast_decode"]
