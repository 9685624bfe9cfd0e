"""Pre-allocated per-layer K/V tensors for the native rollout engine's fast decode path.

One ``[B, heads, L, dim]`` tensor pair per layer (whatever 4-D states the attention module
caches: per-head K/V for Qwen, the compressed latent ``(kv_nope, k_rot)`` for DeepSeek MLA);
``update`` slice-assigns the new position and returns views of the filled prefix, the keys a
``DynamicCache`` would return. See ``decode.py``.

With ``rows`` set (the static decode step's batch-size bucket), every layer's storage has
``rows >= B`` rows (``store_keys`` / ``store_values``, zero-initialised: a captured step reads every
column and every row, so none may hold NaN) and ``keys`` / ``values`` are views of its first ``B``
rows, the tensors prefill, multi-turn chunks and compaction work on.
"""
from __future__ import annotations

import torch


class KVBuffers:
    """Per-layer pre-allocated K/V storage that duck-types ``transformers.Cache.update``.

    ``length`` is the number of filled positions; it advances once per model step
    (:meth:`advance`), after every layer wrote its states at ``[length, length + T)``.
    """

    def __init__(self, num_layers: int, rows: int = 0):
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # [B, H, L, D] (views of the storage)
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.store_keys: list[torch.Tensor | None] = [None] * num_layers  # [max(rows, B), H, L, D]
        self.store_values: list[torch.Tensor | None] = [None] * num_layers
        self.rows = rows  # storage rows at least (0: the batch's own)
        self.length = 0
        self.capacity = 0

    def _alloc(self, like: torch.Tensor, shape: tuple[int, ...], zeros: bool) -> torch.Tensor:
        return like.new_zeros(shape) if zeros or self.rows else like.new_empty(shape)

    def _store(self, li: int, key: bool, like: torch.Tensor, shape: tuple[int, ...], zeros: bool) -> torch.Tensor:
        """Layer ``li``'s key (or value) view ``[B, ...]`` of a storage of ``max(rows, B)`` rows, kept if it fits."""
        store, views = (self.store_keys, self.keys) if key else (self.store_values, self.values)
        full = (max(self.rows, shape[0]),) + tuple(shape[1:])
        t = store[li]
        if t is None or tuple(t.shape) != full or t.dtype != like.dtype or t.device != like.device:
            t = store[li] = self._alloc(like, full, zeros)
            views[li] = None
        if views[li] is None or views[li].shape[0] != shape[0]:
            views[li] = t if full[0] == shape[0] else t[: shape[0]]
        return views[li]

    def load_prefill(self, cache, capacity: int) -> None:
        """Copy a prefilled HF ``DynamicCache`` into the buffers (re-allocating only on shape change)."""
        ks = [layer.keys for layer in cache.layers]
        vs = [layer.values for layer in cache.layers]
        if len(ks) != len(self.keys):
            raise RuntimeError(f"prefill cache has {len(ks)} layers, expected {len(self.keys)}")
        for li, (k, v) in enumerate(zip(ks, vs)):
            self._store(li, True, k, (k.shape[0], k.shape[1], capacity, k.shape[3]), False)  # [B, H, L, Dk]
            self._store(li, False, v, (v.shape[0], v.shape[1], capacity, v.shape[3]), False)  # [B, H, L, Dv]
        self.capacity = capacity
        n = ks[0].shape[2]
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
        kshape = (key_shape[0], key_shape[1], capacity, key_shape[3])
        vshape = (value_shape[0], value_shape[1], capacity, value_shape[3])
        k = self._store(layer_idx, True, like, kshape, False)  # [B, Hk, L, Dk]
        v = self._store(layer_idx, False, like, vshape, True)  # [B, Hk, L, Dv] (zeros: padded columns)
        return k, v

    def grow(self, capacity: int) -> None:
        """Re-allocate every layer's storage with ``capacity`` columns, keeping the filled ones."""
        for li in range(len(self.keys)):
            for key in (True, False):
                store = self.store_keys if key else self.store_values
                views = self.keys if key else self.values
                old, B = store[li], views[li].shape[0]
                new = self._alloc(old, (old.shape[0], old.shape[1], capacity, old.shape[3]), not key)
                new[:, :, :self.length].copy_(old[:, :, :self.length])
                store[li] = new
                views[li] = new if new.shape[0] == B else new[:B]
        self.capacity = capacity

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
        return sum(t.numel() * t.element_size() for t in self.store_keys + self.store_values if t is not None)
