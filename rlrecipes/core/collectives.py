"""Small Python objects across ranks in one collective.

``torch.distributed.all_gather_object`` and ``broadcast_object_list`` cost two collectives each (the
sizes, then the bytes) plus a tensor per rank. The per-step objects of the workflow (row ids, a DAPO
verdict, the step's metric facts) are a few KiB, so here they travel as one fixed-size byte buffer:
an 8-byte length, then the pickle. Only when some rank's pickle is larger than the buffer does a
second collective follow, sized to the largest, and every rank sees that from the lengths, so they
all take it together. Measured with gloo on the 2-core host: an all-gather of about 1 KiB per rank
takes 1.2 ms as ``all_gather_object`` and 0.34 ms as one buffer at 2 ranks, 7.0 vs 3.4 ms at 4.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from .tensor_cache import comm_device

OBJECT_BYTES = 8192
"""Pickle bytes that travel in the one-collective path; larger objects cost one more collective."""

_CPU = torch.device("cpu")


def _frame(obj: Any, cap: int) -> tuple[torch.Tensor, bytes]:
    """``[8 + cap]`` uint8: the pickle's length, then the pickle if it fits; and the pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    head = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, _padded(data if len(data) <= cap else b"", cap)]), data


def _length(buf: torch.Tensor) -> int:
    return int(buf[:8].view(torch.int64)[0])


def _loads(b: torch.Tensor) -> Any:
    return pickle.loads(b.numpy().tobytes())


def _padded(data: bytes, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.uint8)
    if data:
        out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def all_gather_objects(obj: Any, *, group=None, device: torch.device = _CPU,
                       cap: int = OBJECT_BYTES) -> list[Any]:
    """Every rank's picklable ``obj`` of ``group``, in rank order. ``device``: the worker's compute
    device (the buffers live there on NCCL/HCCL groups, in host memory on gloo)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return [obj]
    comm = comm_device(group, device)
    buf, data = _frame(obj, cap)
    bufs = [torch.empty_like(buf, device=comm) for _ in range(world)]
    dist.all_gather(bufs, buf.to(comm), group=group)
    bufs = [b.cpu() for b in bufs]
    sizes = [_length(b) for b in bufs]
    if max(sizes) <= cap:
        return [_loads(b[8:8 + n]) for b, n in zip(bufs, sizes)]
    big = [torch.empty(max(sizes), dtype=torch.uint8, device=comm) for _ in range(world)]
    dist.all_gather(big, _padded(data, max(sizes)).to(comm), group=group)
    return [_loads(b.cpu()[:n]) for b, n in zip(big, sizes)]


def broadcast_object(obj: Any, src: int = 0, *, group=None, device: torch.device = _CPU,
                     cap: int = OBJECT_BYTES) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group`` (the others pass anything)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    comm = comm_device(group, device)
    me = dist.get_rank() == src
    buf, data = _frame(obj, cap) if me else (torch.empty(8 + cap, dtype=torch.uint8), b"")
    buf = buf.to(comm)
    dist.broadcast(buf, src=src, group=group)
    buf = buf.cpu()
    n = _length(buf)
    if n <= cap:
        return obj if me else _loads(buf[8:8 + n])
    big = (_padded(data, n) if me else torch.empty(n, dtype=torch.uint8)).to(comm)
    dist.broadcast(big, src=src, group=group)
    return obj if me else _loads(big.cpu())
