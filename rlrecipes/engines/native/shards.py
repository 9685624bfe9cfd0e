"""A native engine's tensors as shards: the train-layout shard of each parameter (DP dim gathered,
TP/EP kept), full tensors, the box a rank holds in global coordinates, loading a shard in place,
and the slice of a full tensor a rank holds by ``docs/conventions.md``."""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlrecipes.engines.native.parallel import _local, is_expert, tp_dim


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones under every name) and persistent buffers, with HF names."""
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.add(name)
        yield name, p
    sd_keys = set(model.state_dict().keys())
    for name, b in model.named_buffers():
        if name in sd_keys and name not in seen:
            yield name, b


FSDP_DIMS = ("dp", "dpsp")
"""Mesh dims FSDP2 shards over: DP, or DP x SP flattened under sequence parallelism
(``parallel.MeshInfo.grad_mesh``); the train layout has them all-gathered."""


def train_layout_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's TP/EP shard of a (possibly FSDP-sharded) DTensor with the DP dim all-gathered."""
    if not isinstance(t, DTensor):
        return t.detach()
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or ()
    placements = [Replicate() if (i < len(names) and names[i] in FSDP_DIMS) else p for i, p in enumerate(t.placements)]
    if list(placements) != list(t.placements):
        t = t.redistribute(mesh, placements)
    return t.to_local().detach()


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter/persistent buffer of this rank in the train layout (see conventions).

    Tensors FSDP shards plainly along dim 0 (nothing else splits dim 0) are gathered together: one
    all-gather per dtype over the DP group instead of one per tensor (a step's weight hand-off at
    DP > 1 was one collective per parameter). The rest go one at a time through ``redistribute``."""
    with torch.no_grad():
        items = list(named_tensors(model))
        out: dict[str, torch.Tensor] = {}
        batch: dict[tuple, list[tuple[str, DTensor]]] = {}
        for name, t in items:
            dp = _plain_dp_dim(t)
            if dp is None:
                out[name] = train_layout_shard(t)
            else:
                batch.setdefault((t.dtype, id(t.device_mesh), dp), []).append((name, t))
        for (_, _, dp), group in batch.items():
            out.update(_gather_dim0(group, dp))
        return {name: out[name] for name, _ in items}


def _plain_dp_dim(t: torch.Tensor) -> int | None:
    """The mesh dim of "dp" when ``t`` is FSDP-sharded as a plain ``Shard(0)`` there and no other
    mesh dim splits dim 0 (else None: the general path)."""
    if not isinstance(t, DTensor) or t.dim() == 0:
        return None
    names = t.device_mesh.mesh_dim_names or ()
    dp = next((names.index(n) for n in FSDP_DIMS if n in names), None)
    if dp is None or type(t.placements[dp]) is not Shard or t.placements[dp].dim != 0:
        return None
    for i, p in enumerate(t.placements):
        if i != dp and not (isinstance(p, Replicate) or (type(p) is Shard and p.dim != 0)):
            return None
    return dp


def _gather_dim0(group: list[tuple[str, DTensor]], dp: int) -> dict[str, torch.Tensor]:
    """All-gather the dim-0 FSDP shards of ``group`` (same dtype and mesh) in one collective.

    Each rank sends its shard rows padded to ``ceil(rows / dp_size)`` (torch.chunk's split, which
    DTensor's Shard(0) uses), flattened back to back; the full rows are then cut out per tensor."""
    mesh = group[0][1].device_mesh
    pg, size = mesh.get_group(dp), mesh.size(dp)
    locals_ = [t.to_local() for _, t in group]
    rows = [int(t.shape[0]) for _, t in group]
    per_row = [torch.Size(loc.shape[1:]).numel() for loc in locals_]
    chunk = [-(-n // size) for n in rows]
    sizes = [c * r for c, r in zip(chunk, per_row)]
    send = torch.zeros(sum(sizes), dtype=locals_[0].dtype, device=locals_[0].device)
    off = 0
    for loc, n in zip(locals_, sizes):
        send[off:off + loc.numel()].copy_(loc.reshape(-1))
        off += n
    recv = torch.empty(size * send.numel(), dtype=send.dtype, device=send.device)
    dist.all_gather_into_tensor(recv, send, group=pg)
    recv = recv.view(size, -1)  # [dp ranks, packed shards]
    out, off = {}, 0
    for (name, t), loc, n, c, r, k in zip(group, locals_, rows, chunk, per_row, sizes):
        parts = [recv[q, off:off + max(0, min(c, n - q * c)) * r] for q in range(size)]
        out[name] = torch.cat(parts).view(n, *loc.shape[1:])
        off += k
    return out


def local_box(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, stop)`` per dimension of this rank's local shard of ``t`` in global coordinates.

    Every placement the engine creates (TP ``Shard``, EP ``Shard(0)``, FSDP2's ``Shard(0)`` and its
    strided form when FSDP and TP split the same dimension) leaves each rank one contiguous box.
    """
    if not isinstance(t, DTensor):
        return [(0, int(n)) for n in t.shape]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return [(int(o), int(o) + int(n)) for o, n in zip(offset, shape)]


def full_state_dict(model: nn.Module, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded tensors (collective on every rank; ``keep=False`` drops them, e.g. off rank 0)."""
    out = {}
    with torch.no_grad():
        for name, t in named_tensors(model):
            full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            if keep:
                out[name] = full.cpu().clone()
    return out


def copy_shard_(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy ``value`` (this rank's local shard) into ``param`` in place, checking the shape."""
    dst = _local(param.data if isinstance(param, nn.Parameter) else param)
    if tuple(dst.shape) != tuple(value.shape):
        raise ValueError(f"load_shards: {name}: got shape {tuple(value.shape)}, this rank holds "
                         f"{tuple(dst.shape)} (wrong layout?)")
    dst.copy_(value.to(device=dst.device, dtype=dst.dtype))


def convention_slice(full: torch.Tensor, name: str, tp: int, tp_rank: int, ep: int, ep_rank: int) -> torch.Tensor:
    """The slice of a full tensor a rank holds per docs/conventions.md (torch.chunk semantics)."""
    if is_expert(name):
        return torch.chunk(full, ep, dim=0)[ep_rank] if ep > 1 else full
    d = tp_dim(name)
    if d is None or tp == 1:
        return full
    return torch.chunk(full, tp, dim=d)[tp_rank]
