"""Micro-batches of the native engines, formed from an engine-neutral :class:`SeqBatch`.

Two forms, one contract for the loss closure (``response_mask [b, R]`` and every column of the
batch padded to ``[b, R]``, per-sample columns broadcast over the response; ``sample_index`` lists
the batch rows a micro-batch holds):

* **padded** (:func:`micro_batches`): a fixed count of samples per micro-batch,
  ``input_ids [b, T]`` = left-padded prompt then right-padded response, ``attention_mask [b, T]``;
* **packed** (:func:`packed_micro_batches`, dynamic batching): samples are grouped by a token budget
  (first-fit decreasing over prompt + response lengths) and concatenated without padding into one
  row, ``input_ids [1, N]`` with ``position_ids [1, N]`` restarting at 0 for every sample (the
  attention is block-diagonal: transformers reads sequence boundaries off ``position_ids``),
  ``logit_index [M]`` = the positions whose logits predict the ``M`` response tokens
  ``targets [M]``, and ``unpack_rows / unpack_cols [M]`` = where each lands in ``[b, R]``.

Every DP rank builds the same number of micro-batches: a rank with fewer adds zero-weight
micro-batches (``response_mask`` all zero), so FSDP's collectives stay in step.

Devices (the rule of ``engines/base.py``): :func:`micro_batches` and :func:`packed_micro_batches` are
where a batch crosses to its engine. They bring the batch to the host (its columns may sit on the
worker's device, from the TensorCache), build every micro-batch there, and return them on ``device``.
The builders below them take host tensors only.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from ..base import SeqBatch, micro_batch_to

HOST = torch.device("cpu")


class MeshRanks:
    """Where a native engine's rank sits, read off its ``mesh`` (``parallel.MeshInfo``): DP rank
    ``rank // (sp * tp)``; the first rank of each TP (x SP) group, which holds one batch, leads it."""

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp

    @property
    def is_data_leader(self) -> bool:
        return self.mesh.tp_rank == 0 and self.mesh.sp_rank == 0

    def model_parallel_group(self):
        """The TP (x SP) group and its first global rank (its ranks see the same batch); ``(None, rank)``
        when there is none."""
        if self.mesh.mp_size == 1:
            return None, dist.get_rank()
        group = self.mesh.mp_mesh.get_group()
        return group, dist.get_global_rank(group, 0)


def _lengths(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([int(t.numel()) for t in rows], dtype=torch.long)  # [n]


def _fill(out: torch.Tensor, mask: torch.Tensor, rows: Sequence[torch.Tensor]) -> None:
    """``out[mask] = cat(rows)``: the 1-D rows laid in row-major order at the True places of ``mask``
    (one batched copy instead of a slice assignment per row)."""
    if rows:
        out[mask] = torch.cat(list(rows)).to(out.dtype)


def pad_rows(rows: Sequence[torch.Tensor], width: int, value: float = 0.0) -> torch.Tensor:
    """1-D tensors -> ``[len(rows), width]`` float32, right-padded with ``value``."""
    out = torch.full((len(rows), width), value, dtype=torch.float32)  # [B, R]
    lens = _lengths(rows)
    if rows and int(lens.max()) > width:
        raise ValueError(f"pad_rows: a row of {int(lens.max())} values does not fit width {width}")
    # per-row float32 casts, as a row-by-row copy does (cat would promote mixed dtypes first)
    _fill(out, torch.arange(width)[None, :] < lens[:, None], [t.float() for t in rows])
    return out


def pad_sequences(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], pad_id: int) -> dict:
    """Left-padded prompts + right-padded responses -> ``input_ids``, ``attention_mask``, ``response_mask``."""
    plen, rlen = _lengths(prompts), _lengths(responses)
    P = int(plen.max())
    R = max(int(rlen.max()), 1)
    B = len(prompts)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)  # [B, T]
    pmask = torch.arange(P)[None, :] >= (P - plen)[:, None]  # [B, P]: left-padded prompts
    rmask = torch.arange(R)[None, :] < rlen[:, None]  # [B, R]: right-padded responses
    prompt_ids, response_ids = ids[:, :P], ids[:, P:]  # views of ids
    _fill(prompt_ids, pmask, prompts)
    _fill(response_ids, rmask, responses)
    attn = torch.cat([pmask, rmask], 1).long()  # [B, T]
    return {"input_ids": ids, "attention_mask": attn, "response_mask": rmask.float()}


def _columns(mb: dict, batch: SeqBatch, R: int) -> None:
    for c, v in batch.per_sample.items():
        mb[c] = v.float()[:, None].expand(-1, R)  # [b, R]
    for c, rows in batch.per_token.items():
        mb[c] = pad_rows(rows, R)  # [b, R]


def padded_micro_batch(batch: SeqBatch, pad_id: int, vision=None) -> dict:
    """``vision``: a VL model's ``vision.VisionSpec`` (pixels, grids, M-RoPE positions of the batch's images)."""
    mb = pad_sequences(batch.prompts, batch.responses, pad_id)
    R = mb["response_mask"].shape[1]
    _columns(mb, batch, R)
    if vision is not None:
        from .vision import add_images

        add_images(mb, batch, vision)
    if batch.routed_experts is not None:  # [P_i + R_i, layers, k] -> aligned with input_ids [b, T]
        P = mb["input_ids"].shape[1] - R
        first = batch.routed_experts[0]
        routed = torch.full((len(batch), P + R, *first.shape[1:]), -1, dtype=torch.int32)  # [b, T, layers, k]
        for i, (p, x) in enumerate(zip(batch.prompts, batch.routed_experts)):
            routed[i, P - p.numel():P - p.numel() + x.shape[0]] = x
        mb["routed_experts"] = routed
    return mb


def _empty_micro_batch(batch: SeqBatch, pad_id: int) -> dict:
    mb = pad_sequences([torch.tensor([pad_id])], [torch.tensor([pad_id])], pad_id)
    mb["response_mask"].zero_()
    for c in list(batch.per_sample) + list(batch.per_token):
        mb[c] = torch.zeros(1, 1)
    return mb


def _same_count(n: int) -> int:
    """The max of ``n`` over all ranks (every rank must run as many micro-batches)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = int(t)
    return n


def micro_batches(batch: SeqBatch, size: int, pad_id: int, *, collective: bool = True,
                  device: torch.device = HOST, vision=None) -> list[dict]:
    """Consecutive groups of ``size`` samples on ``device``; the count is the max over all ranks (collective)."""
    batch = batch.to(HOST)
    n = math.ceil(len(batch) / size) if len(batch) else 0
    if collective:
        n = _same_count(n)
    out = []
    for k in range(n):
        idx = list(range(k * size, min(len(batch), (k + 1) * size)))
        mb = padded_micro_batch(batch.subset(idx), pad_id, vision) if idx else _empty_micro_batch(batch, pad_id)
        mb["sample_index"] = idx
        out.append(micro_batch_to(mb, device))
    return out


def rows_to_samples(dest: list, mb: Mapping, rows: torch.Tensor | None, batch: SeqBatch) -> None:
    """``dest[i] = rows[j, :R_i]`` on the host for the ``j``-th sample ``i`` of micro-batch ``mb``
    (``rows [b, R]``, as the engines' forward returns it; nothing when ``rows`` is None). One copy
    to the host for the whole block, then views of it."""
    if rows is None:
        return
    host = rows.detach().cpu()  # [b, R]
    for j, i in enumerate(mb["sample_index"]):
        dest[i] = host[j, :int(batch.responses[i].numel())]


def token_bins(lengths: Sequence[int], budget: int, *, padded: bool = False) -> list[list[int]]:
    """First-fit decreasing: groups of indices whose lengths sum to at most ``budget`` (a longer item
    gets a group of its own); indices inside a group are in ascending order. ``padded``: every member
    costs the group's longest length (each sample a row padded to the longest), so a group's padded
    tokens stay within the budget."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for b, r in enumerate(room):
            cost = lengths[bins[b][0]] if padded else n  # decreasing order: a group's first is its longest
            if cost <= r:
                bins[b].append(i)
                room[b] -= cost
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return [sorted(b) for b in bins]


def packed_micro_batch(batch: SeqBatch, pad_id: int = 0, row_tokens: int | None = None, *,
                       one_per_row: bool = False, vision=None) -> dict:
    """The samples of ``batch`` concatenated without padding (see the module docstring).

    ``row_tokens=None``: one row ``[1, N]`` (the layout for varlen attention kernels). Otherwise the
    samples are laid first-fit into rows of at most ``row_tokens`` tokens (a longer sample alone)
    and the rows padded to the longest, ``[rows, L]``: attention without a varlen kernel costs
    ``O(row length^2)``, so short rows keep a dense block-diagonal mask cheap. Row padding is a
    block of its own (its positions restart at 0) whose logits are never read.
    ``logit_index [U]`` are the columns the head is evaluated at (the union over rows) and
    ``keep_rows / keep_cols [M]`` pick each response token's logits out of ``[rows, U, V]``.
    ``one_per_row``: every sample a row of its own (padded to the longest): plain causal attention is
    then exact (trailing padding is never attended to, its outputs never read), so no ``[rows, T, T]``
    mask is needed and the attention kernel keeps its fused path; ``mb["one_per_row"]`` says so.
    ``vision``: a VL model's ``vision.VisionSpec``: the samples' pixels in layout order and their
    ``[4, rows, L]`` positions (``vision.add_packed_images``).
    """
    plen, rlen = _lengths(batch.prompts), _lengths(batch.responses)  # [n]
    lengths = (plen + rlen).tolist()
    rows_of = ([[i] for i in range(len(batch))] if one_per_row else
               token_bins(lengths, row_tokens) if row_tokens else [list(range(len(batch)))])
    # every sample's row and offset in it, in row order (one batched scatter below, no per-sample ops)
    order, row_of, offset_of, ends = [], [], [], []
    for r, members in enumerate(rows_of):
        offset = 0
        for i in members:
            order.append(i)
            row_of.append(r)
            offset_of.append(offset)
            offset += lengths[i]
        ends.append(offset)
    L = max(ends)
    order_t = torch.tensor(order, dtype=torch.long)  # [n]
    row_t, off_t = torch.tensor(row_of, dtype=torch.long), torch.tensor(offset_of, dtype=torch.long)  # [n]
    P_o, R_o = plen[order_t], rlen[order_t]  # [n], in row order
    n_o = P_o + R_o

    def within(counts):  # 0, 1, .., c - 1 for every count c, concatenated
        total = int(counts.sum())
        return torch.arange(total) - torch.repeat_interleave(counts.cumsum(0) - counts, counts, output_size=total)

    tok = within(n_o)  # [N]: position of each token inside its sample
    tok_row = torch.repeat_interleave(row_t, n_o, output_size=tok.numel())  # [N]
    tok_col = torch.repeat_interleave(off_t, n_o, output_size=tok.numel()) + tok  # [N]
    ids = torch.full((len(rows_of), L), pad_id, dtype=torch.long)
    ids[tok_row, tok_col] = torch.cat([t for i in order for t in (batch.prompts[i], batch.responses[i])]).long()
    # row padding is a block of its own: positions restart at 0 after a row's last sample
    pos = torch.arange(L)[None, :] - torch.tensor(ends, dtype=torch.long)[:, None]  # [rows, L]
    pos[tok_row, tok_col] = tok
    routed = None
    if batch.routed_experts is not None:
        shape = batch.routed_experts[0].shape[1:]
        routed = torch.full((len(rows_of), L, *shape), -1, dtype=torch.int32)  # [rows, L, layers, k]
        for i, r, offset in zip(order, row_of, offset_of):
            # the last token was never fed back to the rollout: it keeps -1
            rec = batch.routed_experts[i][:lengths[i]]
            routed[r, offset:offset + rec.shape[0]] = rec
    M = int(R_o.sum())
    j = within(R_o)  # [M]: response slot of each response token
    cols = torch.repeat_interleave(off_t + P_o - 1, R_o, output_size=M) + j  # logits that predict each token
    union = torch.unique(cols)  # sorted
    R = max(int(rlen.max()), 1)
    mb = {"input_ids": ids, "position_ids": pos,  # [rows, L]
          "logit_index": union, "keep_rows": torch.repeat_interleave(row_t, R_o, output_size=M),
          "keep_cols": torch.searchsorted(union, cols),
          "targets": torch.cat([batch.responses[i] for i in order]).long(),  # [M]
          "unpack_rows": torch.repeat_interleave(order_t, R_o, output_size=M), "unpack_cols": j,  # [M]
          "response_mask": (torch.arange(R)[None, :] < rlen[:, None]).float(),  # [b, R]
          "one_per_row": one_per_row or len(rows_of) == len(batch)}
    _columns(mb, batch, R)
    if routed is not None:
        mb["routed_experts"] = routed
    if vision is not None:
        from .vision import add_packed_images

        add_packed_images(mb, batch, vision, order, row_of, offset_of)
    return mb


def _empty_packed(batch: SeqBatch, pad_id: int, one_per_row: bool = False) -> dict:
    one = torch.tensor([pad_id])
    sub = SeqBatch(prompts=[one], responses=[one], per_sample={c: torch.zeros(1) for c in batch.per_sample},
                   per_token={c: [torch.zeros(1)] for c in batch.per_token})
    mb = packed_micro_batch(sub, pad_id, one_per_row=one_per_row)
    mb["response_mask"].zero_()
    return mb


def packed_micro_batches(batch: SeqBatch, max_tokens: int, pad_id: int, *, collective: bool = True,
                         varlen: bool = False, one_per_row: bool = False,
                         device: torch.device = HOST, vision=None) -> list[dict]:
    """Micro-batches of at most ``max_tokens`` prompt + response tokens each (a longer sample alone),
    on ``device``; the count is the max over all ranks (collective). ``varlen``: the attention kernel
    takes packed rows natively, so each micro-batch is one row; otherwise rows are as long as its
    longest sample. ``one_per_row`` (long sequences under sequence parallelism): a sample per row, no
    attention mask, and the budget counts each row padded to the micro-batch's longest sample."""
    batch = batch.to(HOST)
    lengths = [int(p.numel()) + int(x.numel()) for p, x in zip(batch.prompts, batch.responses)]
    bins = token_bins(lengths, int(max_tokens), padded=one_per_row) if len(batch) else []
    n = _same_count(len(bins)) if collective else len(bins)
    out = []
    for k in range(n):
        idx = bins[k] if k < len(bins) else []
        if idx:
            row = None if varlen else max(lengths[i] for i in idx)
            mb = packed_micro_batch(batch.subset(idx), pad_id, row, one_per_row=one_per_row, vision=vision)
        else:
            mb = _empty_packed(batch, pad_id, one_per_row)
        mb["sample_index"] = idx
        out.append(micro_batch_to(mb, device))
    return out
