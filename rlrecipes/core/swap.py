"""Storage-level swap of tensors between device and host memory.

Each tensor's *storage* is copied into a host byte buffer (pinned on accelerators) and resized
to 0 bytes; ``restore`` resizes it back and copies the bytes in. Every view of the storage (FSDP2
shards, DTensor locals, optimizer references, KV-cache tensors) stays valid, so nothing has to be
re-registered after a swap. Storages shared by several tensors are swapped once.

Used by the resharder (training state out of the way of the KV cache) and by the native engines
(``TrainEngine.offload``, ``RolloutEngine.sleep``).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

from rlrecipes import device as devmod


def unique_storage_tensors(tensors: Iterable[torch.Tensor | None]) -> list[torch.Tensor]:
    out, seen = [], set()
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out.append(t)
    return out


class SwappedStorages:
    """Host copies of the storages of some tensors, whose device memory has been released."""

    def __init__(self, tensors: Iterable[torch.Tensor | None], device: torch.device):
        self.device = device
        self.saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        devmod.synchronize(device)
        for t in unique_storage_tensors(tensors):
            st = t.untyped_storage()
            host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=devmod.pin_memory_ok(device))
            host.copy_(_bytes(st, t.device))
            self.saved.append((st, host))
            st.resize_(0)
        devmod.empty_cache(device)

    @property
    def nbytes(self) -> int:
        """Bytes held on host (what was released on the device)."""
        return sum(h.numel() for _, h in self.saved)

    def device_nbytes(self) -> int:
        """Bytes the swapped storages occupy on the device now (0 until ``restore``)."""
        return sum(st.nbytes() for st, _ in self.saved)

    def restore(self) -> int:
        """Resize every storage back and copy its bytes in; returns the bytes restored."""
        n = self.nbytes
        for st, host in self.saved:
            st.resize_(host.numel())
            _bytes(st, st.device).copy_(host)
        self.saved = []
        devmod.synchronize(self.device)
        return n


def _bytes(st: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(st)  # [nbytes]


__all__ = ["SwappedStorages", "unique_storage_tensors"]
