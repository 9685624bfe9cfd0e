"""Padded micro-batches of the native engines, formed from an engine-neutral :class:`SeqBatch`.

One micro-batch maps ``input_ids [b, T]`` (left-padded prompt, then right-padded response),
``attention_mask [b, T]``, ``response_mask [b, R]`` and every column of the batch padded to
``[b, R]`` (per-sample columns broadcast over the response). Every DP rank builds the same number
of micro-batches: a rank with fewer samples adds zero-weight micro-batches (``response_mask`` all
zero), so FSDP's collectives stay in step.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from ..base import SeqBatch


class MeshRanks:
    """Where a native engine's rank sits, read off its ``mesh`` (``parallel.MeshInfo``): DP rank
    ``rank // tp``; TP rank 0 of each group is the data leader."""

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp

    @property
    def is_data_leader(self) -> bool:
        return self.mesh.tp_rank == 0


def pad_rows(rows: Sequence[torch.Tensor], width: int, value: float = 0.0) -> torch.Tensor:
    """1-D tensors -> ``[len(rows), width]`` float32, right-padded with ``value``."""
    out = torch.full((len(rows), width), value, dtype=torch.float32)  # [B, R]
    for i, t in enumerate(rows):
        out[i, :t.numel()] = t.float()
    return out


def pad_sequences(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor], pad_id: int) -> dict:
    """Left-padded prompts + right-padded responses -> ``input_ids``, ``attention_mask``, ``response_mask``."""
    P = max(int(p.numel()) for p in prompts)
    R = max(max(int(x.numel()) for x in responses), 1)
    B = len(prompts)
    ids = torch.full((B, P + R), pad_id, dtype=torch.long)  # [B, T]
    attn = torch.zeros((B, P + R), dtype=torch.long)  # [B, T]
    rmask = torch.zeros((B, R), dtype=torch.float32)  # [B, R]
    for i, (p, x) in enumerate(zip(prompts, responses)):
        ids[i, P - p.numel():P] = p
        attn[i, P - p.numel():P] = 1
        ids[i, P:P + x.numel()] = x
        attn[i, P:P + x.numel()] = 1
        rmask[i, :x.numel()] = 1
    return {"input_ids": ids, "attention_mask": attn, "response_mask": rmask}


def padded_micro_batch(batch: SeqBatch, pad_id: int) -> dict:
    mb = pad_sequences(batch.prompts, batch.responses, pad_id)
    R = mb["response_mask"].shape[1]
    for c, v in batch.per_sample.items():
        mb[c] = v.float()[:, None].expand(-1, R)  # [b, R]
    for c, rows in batch.per_token.items():
        mb[c] = pad_rows(rows, R)  # [b, R]
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


def micro_batches(batch: SeqBatch, size: int, pad_id: int, *, collective: bool = True) -> list[dict]:
    """Consecutive groups of ``size`` samples; the count is the max over all ranks (collective)."""
    n = math.ceil(len(batch) / size) if len(batch) else 0
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = int(t)
    out = []
    for k in range(n):
        idx = list(range(k * size, min(len(batch), (k + 1) * size)))
        out.append(padded_micro_batch(batch.subset(idx), pad_id) if idx else _empty_micro_batch(batch, pad_id))
    return out
