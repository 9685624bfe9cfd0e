"""Collective plumbing the executors share: process groups per strategy, byte-buffer packing, the host
swap of training state, and the stats a reshard reports."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlrecipes.core.swap import SwappedStorages

from ..parallel import ParallelLayout


# process groups per (layout, group), created once per process (new_group is collective)
_GROUPS: dict[tuple, Any] = {}


def _dist():
    import torch.distributed as dist

    return dist


def _groups_for(train: ParallelLayout, group) -> dict[str, dict[int, Any]]:
    """{'tp': {rank: pg}, 'ep': {...}, 'pp': {...}} for the train layout, built once per world.

    Every rank of the default group calls ``new_group`` for every subgroup in one fixed order,
    as torch.distributed requires; subgroups of size 1 are None.
    """
    dist = _dist()
    W = train.world
    glob = [dist.get_global_rank(group, i) if group is not None else i for i in range(W)]
    key = (id(dist.group.WORLD), train.tp, train.pp, train.ep, train.replicas, tuple(glob))
    if key in _GROUPS:
        return _GROUPS[key]
    S = train.stage_size
    out: dict[str, dict[int, Any]] = {"tp": {}, "ep": {}, "pp": {}}
    families = {
        "tp": [[s * S + d * train.tp + t for t in range(train.tp)] for s in range(train.pp)
               for d in range(train.replicas)],
        "ep": [[s * S + b * train.ep + e for e in range(train.ep)] for s in range(train.pp)
               for b in range(S // train.ep)],
        "pp": [[s * S + loc for s in range(train.pp)] for loc in range(S)],
    }
    for kind, lists in families.items():
        for ranks in lists:
            pg = None
            if len(ranks) > 1:
                pg = dist.new_group([glob[r] for r in ranks])
            for r in ranks:
                out[kind][r] = (pg, ranks)
    _GROUPS[key] = out
    return out


# =============================================================================================
# host swap
class HostSwap:
    """Swap training params (and optionally grads and optimizer state) to host and back.

    Collects the tensors, then delegates to :class:`rlrecipes.core.swap.SwappedStorages` (the same
    storage-level swap the native engines use): on accelerators the host buffers are pinned; on CPU
    host and "device" are the same RAM, but the storage is still really released
    (``untyped_storage().nbytes() == 0``) and restored bit-exactly.
    """

    def __init__(self):
        self._swapped: SwappedStorages | None = None

    @staticmethod
    def _collect(params, grads: bool, optimizer) -> list[torch.Tensor]:
        if isinstance(params, torch.nn.Module):
            tensors = list(params.parameters())
        elif isinstance(params, Mapping):
            tensors = list(params.values())
        else:
            tensors = list(params)
        out = list(tensors)
        if grads:
            out += [t.grad for t in tensors if getattr(t, "grad", None) is not None]
        if optimizer is not None:
            for st in optimizer.state.values():
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def swap_out(self, params, grads: bool = False, optimizer=None) -> int:
        """Move to host and release; returns the bytes released."""
        if self._swapped is not None:
            raise RuntimeError("swap_out called twice without swap_in")
        tensors = self._collect(params, grads, optimizer)
        device = next((t.device for t in tensors), torch.device("cpu"))
        swapped = SwappedStorages(tensors, device)
        self._swapped = swapped if swapped.saved else None
        return swapped.nbytes

    @property
    def swapped(self) -> bool:
        return self._swapped is not None

    def device_nbytes(self) -> int:
        """Bytes the swapped storages occupy on the device now (0 after swap_out)."""
        return self._swapped.device_nbytes() if self._swapped is not None else 0

    def swap_in(self) -> int:
        """Restore every swapped storage in place (same tensors, same values); returns bytes restored."""
        if self._swapped is None:
            return 0
        n, self._swapped = self._swapped.restore(), None
        return n


# =============================================================================================
# executors
@dataclass
class ReshardStats:
    """Logical traffic and executor-tracked transient memory of the last ``reshard`` call on this rank.

    ``sent_bytes`` / ``recv_bytes`` count payload leaving / arriving at this rank (an all-gather of
    group g and chunk c: (g-1)*c each way; a broadcast: (g-1)*B sent by the root, B received by
    the others; all-to-all-v: the off-diagonal splits). ``peak_transient_bytes`` is the high-water
    mark of buffers the executor itself allocated (gather buffers, packed send/recv buffers and
    the rollout tensors not yet handed out).
    """

    sent_bytes: int = 0
    recv_bytes: int = 0
    live_bytes: int = 0
    peak_transient_bytes: int = 0
    buckets: int = 0
    collectives: int = 0
    phases: dict = field(default_factory=dict)  # method -> {"sent", "recv", "peak"} for the specs it moved
    _phase_peak: int = 0

    def alloc(self, n: int) -> None:
        self.live_bytes += n
        self.peak_transient_bytes = max(self.peak_transient_bytes, self.live_bytes)
        self._phase_peak = max(self._phase_peak, self.live_bytes)

    def free(self, n: int) -> None:
        self.live_bytes -= n


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(raw: torch.Tensor, dtype: torch.dtype) -> bool:
    return raw.storage_offset() % torch.empty((), dtype=dtype).element_size() == 0


def _bytes_as(raw: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """Read a 1-D uint8 slice as ``dtype`` with ``shape`` (a view; a copy when the offset is misaligned)."""
    if not _aligned(raw, dtype):
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def _pack(raw: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` into the 1-D uint8 slice ``raw`` (exactly its bytes)."""
    if _aligned(raw, src.dtype):
        raw.view(src.dtype).view(src.shape).copy_(src)
    else:
        raw.copy_(src.contiguous().reshape(-1).view(torch.uint8))
