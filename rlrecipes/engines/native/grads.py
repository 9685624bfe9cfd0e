"""Gradients of a native engine across its mesh: the replicated-DP all-reduce (one flat buffer per
dtype), the TP sum of per-head norm gradients, the global grad norm counting every element once,
and scaling."""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from rlrecipes.core.mesh import MeshInfo
from rlrecipes.engines.native.parallel import _local, tp_partial_grad


def _replication(t: torch.Tensor, world: int) -> int:
    """How many ranks of the world hold each element of ``t``'s local shard."""
    if not isinstance(t, DTensor):
        return world
    shards = 1
    for i, p in enumerate(t.placements):
        if p.is_shard():
            shards *= t.device_mesh.size(i)
    return max(world // shards, 1)


def allreduce_dp_grads(params: Sequence[torch.Tensor], mesh: MeshInfo,
                       flag: torch.Tensor | None = None) -> torch.Tensor | None:
    """Replicated DP (no FSDP): average every gradient over the DP (x SP) ranks in one all-reduce of one
    flat buffer per dtype (a missing gradient counts as zeros, so every rank sends the same
    layout). Each rank's local TP/EP shard is reduced with the DP peers holding the same shard.
    ``flag`` (a 0-dim number) rides in the first buffer and comes back summed over the group."""
    group = mesh.grad_mesh.get_group()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(_local(p.grad))
    summed = None
    for grads in by_dtype.values():
        parts = [g.reshape(-1) for g in grads]
        if flag is not None and summed is None:
            parts.append(flag.reshape(1).to(grads[0].dtype))
        flat = torch.cat(parts)  # [sum numel (+ 1)]
        dist.all_reduce(flat, group=group)
        if flag is not None and summed is None:
            summed, flat = flat[-1].double(), flat[:-1]
        flat /= mesh.grad_size
        for g, v in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(v.view_as(g))
    return summed if flag is not None else None


def local_grad_sq_sum(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global grad norm (float64): ``sum |g_local|^2 / replication``
    (replication = ranks holding that element: TP copies of norms, ``tp/ep`` copies of expert blocks,
    DP copies without FSDP). A sum-all-reduce over the world gives the squared global norm."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        g = p.grad
        if g is None:
            continue
        gl = _local(g)
        total += gl.detach().double().pow(2).sum() / _replication(g, world)
    return total


def global_grad_norm(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients across the whole mesh, counting every distinct element once
    (:func:`local_grad_sq_sum` and one sum-all-reduce over the world): identical on every rank."""
    total = local_grad_sq_sum(params, device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt().float()


def scale_grads_(params: Iterable[torch.Tensor], coef: float) -> None:
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef)


def tp_partial_params(model: nn.Module, mesh: MeshInfo) -> list[torch.Tensor]:
    """The parameters whose grads :func:`allreduce_tp_partial_grads` sums over TP (none at TP1)."""
    if mesh.tp == 1:
        return []
    return [p for name, p in model.named_parameters() if tp_partial_grad(name)]


def allreduce_tp_partial_grads(params: Sequence[torch.Tensor], mesh: MeshInfo) -> None:
    """Sum the per-head norm grads (q/k-norm, :func:`tp_partial_params`) over the TP group: each
    rank saw its own heads only."""
    if mesh.tp == 1:
        return
    group = mesh.tp_mesh.get_group()
    for p in params:
        if p.grad is not None:
            dist.all_reduce(_local(p.grad), group=group)


def finish_gradients(params: Sequence[torch.Tensor], mesh: MeshInfo, *, replicated: bool, bad: torch.Tensor,
                     device: torch.device, tp_partial: list[torch.Tensor]) -> torch.Tensor:
    """After backward: the reductions the wrapper did not do (replicated DP's all-reduce, the TP sum
    of per-head norm grads), then ``[squared global grad norm, ranks whose loss was not finite]``
    (float64, ``bad``: this rank's 0/1), the same on every rank, in as few collectives as the
    layout allows."""
    if replicated and mesh.grad_size == dist.get_world_size():
        # pure replicated DP: the flag rides in the gradients' one all-reduce, and every rank then
        # holds the whole averaged gradient (its norm is local)
        bad_all = allreduce_dp_grads(params, mesh, flag=bad)
        return torch.stack([sum((p.grad.double().pow(2).sum() for p in params),
                                torch.zeros((), dtype=torch.float64)), bad_all])
    if replicated:
        allreduce_dp_grads(params, mesh)
    allreduce_tp_partial_grads(tp_partial, mesh)
    # the squared grad norm and the flag summed over the world in one collective
    both = torch.stack([local_grad_sq_sum(params, device), bad])  # [2] float64
    if dist.get_world_size() > 1:
        dist.all_reduce(both)
    return both
