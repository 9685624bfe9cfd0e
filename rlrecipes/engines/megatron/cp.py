"""Context parallelism (``layout.sp`` = megatron's ``context_parallel_size``): how the engine cuts each
micro-batch's sequence over the CP group and puts the per-token log-probs back together.

megatron-core's CP attention (TransformerEngine's ``DotProductAttention`` on CUDA, MindSpeed's
``megatron_cp_algo`` ring attention on Ascend) expects causal inputs **load-balanced**: the sequence,
a multiple of ``2 * cp`` long, is cut into ``2 * cp`` equal chunks and CP rank ``r`` holds chunks ``r``
and ``2 * cp - 1 - r`` (so every rank gets one cheap early chunk and one expensive late chunk under
the causal mask). megatron slices its RoPE table the same way by itself
(``rope_utils.get_pos_emb_on_this_cp_rank``); the engine cuts the token ids, positions and next-token
labels (:func:`split`) exactly as Megatron-LM's ``get_batch_on_this_cp_rank`` does (checked against
it in the megatron tier).

Each CP rank's model output covers its own columns only: ``[b, T / cp, vocab / tp]``. The engine
computes the log-prob of each local column's next token there, then :func:`gather` brings the
``[b, T / cp]`` pieces of every CP rank together into ``[b, T]`` in sequence order (one all-gather of
fp32 log-probs, never logits), from which the response columns are read as without CP. Every CP rank
then holds the same log-probs and computes the same loss; the backward of the gather hands each rank
the gradient of its own columns, so each rank's parameter gradient is the part its tokens contribute.

Scaling (docs/upstream_contracts.md, "Megatron context parallelism"): megatron's schedule multiplies a
2-tuple loss by the CP size (``forward_step_calc_loss``: ``output_tensor *= cp_group_size``) and its
DDP reduces gradients over the DP x CP group scaled by ``1 / (dp * cp)``: the ``cp`` partial gradients
of one DP rank, each times ``cp``, summed and divided by ``dp * cp``, give the DP mean of the whole
gradients, as without CP. The engine therefore returns its loss unscaled by CP.

Pure torch (no megatron import): the split / unsplit functions need no process group.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def padded_length(length: int, tp: int, cp: int) -> int:
    """The micro-batch length megatron gets with CP ``cp`` and TP ``tp``: ``2 * cp`` equal chunks
    (the load-balanced split), and each rank's ``length / cp`` columns a multiple of TP when sequence
    parallelism is on (TP > 1: megatron's embedding scatters each rank's sequence over TP)."""
    cp, tp = int(cp), int(tp)
    m = 2 * cp if cp > 1 else 1
    if tp > 1:
        m = math.lcm(m, cp * tp)
    return -(-int(length) // m) * m


def chunk_columns(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """``[length / cp]`` the columns of a ``length``-long sequence CP rank ``rank`` holds, in the order
    it holds them: chunk ``rank`` then chunk ``2 * cp - 1 - rank`` of ``2 * cp`` equal chunks."""
    cp, rank, length = int(cp), int(rank), int(length)
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} of {cp}")
    if length % (2 * cp) and cp > 1:
        raise ValueError(f"a sequence of {length} columns does not cut into 2 * CP = {2 * cp} equal chunks; "
                         "pad it with padded_length first")
    if cp == 1:
        return torch.arange(length, device=device)
    c = length // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def split(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's columns of ``t`` along ``dim`` (the sequence): ``[.., T, ..] -> [.., T / cp, ..]``."""
    if int(cp) == 1:
        return t
    return t.index_select(dim, chunk_columns(t.shape[dim], cp, rank, device=t.device))


def unsplit(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`split`: every CP rank's piece (in CP rank order) -> the whole sequence."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    local = parts[0].shape[dim]
    order = torch.cat([chunk_columns(local * cp, cp, r, device=parts[0].device) for r in range(cp)])
    return torch.cat(list(parts), dim=dim).index_select(dim, torch.argsort(order))


def next_token_labels(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """``[b, T]``: the token each column's logits predict (column ``c`` -> ``ids[:, c + 1]``; the last
    column, which predicts nothing the engine reads, gets ``pad_id``)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], int(pad_id))], dim=1)


class _GatherFromCP(torch.autograd.Function):
    """Forward: all-gather of ``[b, T / cp]`` over the CP group, chunks put back in sequence order.
    Backward: this rank's columns of the incoming gradient (every CP rank computes the same loss from
    the same gathered tensor, so the gradient of its own columns is the whole of it: no reduction)."""

    @staticmethod
    def forward(ctx, local, group, cp, rank):
        import torch.distributed as dist

        ctx.cp, ctx.rank = cp, rank
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return unsplit(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.cp, ctx.rank, dim=1), None, None, None


def gather(local: Optional[torch.Tensor], group, cp: int, rank: int) -> Optional[torch.Tensor]:
    """``[b, T / cp]`` per-column values of this CP rank -> ``[b, T]`` on every rank of ``group``
    (collective; autograd-aware, see :class:`_GatherFromCP`). ``None`` stays ``None``."""
    if local is None or int(cp) == 1:
        return local
    return _GatherFromCP.apply(local, group, int(cp), int(rank))


def data_peer_ranks(world: int, tp: int, cp: int, pp: int) -> list[list[int]]:
    """The groups of global ranks that must see the same micro-batches (TP x CP x PP peers: one DP
    rank each), in megatron's default rank order ``tp-cp-ep-dp-pp`` (TP fastest, then CP, DP, PP;
    ``parallel_state.initialize_model_parallel``'s ``order``). Group ``d`` is DP rank ``d``; ranks
    ascending, so its first rank is the TP / CP / PP rank 0 of that DP rank."""
    tp, cp, pp = int(tp), int(cp), int(pp)
    if world % (tp * cp * pp):
        raise ValueError(f"TP{tp} x CP{cp} x PP{pp} does not divide {world} ranks")
    dp = world // (tp * cp * pp)
    return [sorted(t + tp * (c + cp * (d + dp * p)) for p in range(pp) for c in range(cp) for t in range(tp))
            for d in range(dp)]
