"""Pre-allocated per-layer K/V tensors for the native rollout engine's fast decode path.

One ``[B, heads, L, dim]`` tensor pair per layer (whatever 4-D states the attention module
caches: per-head K/V for Qwen, the compressed latent ``(kv_nope, k_rot)`` for DeepSeek MLA);
``update`` slice-assigns the new position and returns views of the filled prefix, the keys a
``DynamicCache`` would return. See ``decode.py``.
"""
from __future__ import annotations

import torch


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

    def reserve(self, layer_idx: int, key_shape: tuple[int, ...], value_shape: tuple[int, ...], capacity: int,
                like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s ``[B, H, capacity, D]`` buffers for these (B, H, *, D) shapes, kept if they fit.

        The fast prefill's allocator: states are written straight into the returned tensors.
        ``length`` is reset to 0 by :meth:`reset` (call once per prefill, before the layers).
        """
        k, v = self.keys[layer_idx], self.values[layer_idx]
        kshape = (key_shape[0], key_shape[1], capacity, key_shape[3])
        vshape = (value_shape[0], value_shape[1], capacity, value_shape[3])
        if (k is None or tuple(k.shape) != kshape or k.dtype != like.dtype or k.device != like.device):
            k = self.keys[layer_idx] = like.new_empty(kshape)  # [B, Hk, L, Dk]
        if (v is None or tuple(v.shape) != vshape or v.dtype != like.dtype or v.device != like.device):
            v = self.values[layer_idx] = like.new_zeros(vshape)  # [B, Hk, L, Dv] (zeros: padded columns)
        return k, v

    def reset(self, capacity: int) -> None:
        self.length = 0
        self.capacity = capacity

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
