"""Getting a train stage's rows: dock claim on the data leader, TensorCache exchange, MP share.

Within an engine's model-parallel group (TP x PP peers) only the data leader reads from and
writes to the dock; the rows are then broadcast to its peers, which run the same forward. Cached
columns (log-probs, values) come from the TensorCache by one collective all-to-all, so they never
travel through Ray. The result is engine-neutral: a :class:`~rlrecipes.engines.base.SeqBatch`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from ..core.collectives import all_gather_objects, broadcast_object
from ..core.tensor_cache import comm_device
from ..engines.base import SeqBatch, TrainEngine
from .context import Context


def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on every rank), in rank order; no collective on one rank."""
    if dist.get_world_size() == 1:
        return [t]
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return every


def share_rows(engine: TrainEngine, data: dict, device: torch.device) -> dict:
    """The data leader's rows (``{"rows": [...], column: tensor or list of tensors}``) on every
    model-parallel peer of ``engine``: the layout (columns, dtypes, shapes) by one small object
    broadcast, every value in one byte buffer by one tensor broadcast. Pickling the tensors
    themselves cost 60 ms for 128 rows of three columns (qwen3_moe smoke, TP2)."""
    group, src = engine.model_parallel_group()
    if group is None:
        return data
    lead = dist.get_rank() == src
    layout, parts = _flatten(data) if lead else (None, [])
    layout = broadcast_object(layout, src, group=group, device=device)
    comm = comm_device(group, device)
    n = sum(nb for *_, nb in layout)
    buf = (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)).to(comm) if lead else \
        torch.empty(n, dtype=torch.uint8, device=comm)
    if n:
        dist.broadcast(buf, src=src, group=group)
    return data if lead else _unflatten(layout, buf.cpu())


def gather_in_model_parallel_group(engine: TrainEngine, data: dict, device: torch.device) -> dict:
    """Every model-parallel peer's rows (``{"rows": [...], column: ...}``, the same columns on each),
    merged on each of them in row order -- the share a dock claim would hand their DP rank when each
    peer holds rows it generated itself. The layouts by one small object all-gather, the values as
    one byte buffer per peer by one tensor all-gather."""
    group, _ = engine.model_parallel_group()
    if group is None:
        return data
    layout, parts = _flatten(data)
    layouts = all_gather_objects(layout, group=group, device=device)
    sizes = [sum(nb for *_, nb in lay) for lay in layouts]
    comm = comm_device(group, device)
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    if parts:
        mine[:sizes[dist.get_rank(group)]] = torch.cat(parts)
    bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=comm) for _ in layouts]
    if max(sizes):
        dist.all_gather(bufs, mine.to(comm), group=group)
    each = [_unflatten(lay, b.cpu()) for lay, b in zip(layouts, bufs)]
    merged = {k: torch.cat([d[k] for d in each]) if all(isinstance(d[k], torch.Tensor) for d in each) else
              [x for d in each for x in d[k]] for k in data}  # a peer without rows may hold [] for a tensor
    order = sorted(range(len(merged["rows"])), key=merged["rows"].__getitem__)
    return subset(merged, order)


def _flatten(data: dict) -> tuple[list, list[torch.Tensor]]:
    """``[(key, kind, dtype, shapes, nbytes)]`` and the bytes of every value, in that order."""
    layout, parts = [], []
    for k, v in data.items():
        if isinstance(v, torch.Tensor):
            kind, dtype, shapes, ts = "tensor", v.dtype, tuple(v.shape), [v]
        elif k == "rows" or not all(isinstance(t, torch.Tensor) for t in v) or len({t.dtype for t in v}) > 1:
            layout.append((k, "object", None, v, 0))  # row ids, or anything not one-dtype tensors
            continue
        else:
            kind, dtype, shapes, ts = "list", v[0].dtype if v else None, [tuple(t.shape) for t in v], v
        raw = [t.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for t in ts]
        nbytes = sum(int(r.numel()) for r in raw)
        pad = -nbytes % 8  # the next column starts 8-byte aligned, so its bytes view as any dtype
        layout.append((k, kind, dtype, shapes, nbytes + pad))
        parts += raw + [torch.zeros(pad, dtype=torch.uint8)]
    return layout, parts


def _unflatten(layout: list, buf: torch.Tensor) -> dict:
    out, pos = {}, 0
    for k, kind, dtype, shapes, nbytes in layout:
        if kind == "object":
            out[k] = shapes
            continue
        if kind == "list" and not shapes:  # an empty list column
            out[k] = []
            continue
        n = math.prod(shapes) if kind == "tensor" else sum(math.prod(x) for x in shapes)
        flat = buf[pos:pos + nbytes].view(dtype)[:n]
        pos += nbytes
        if kind == "tensor":
            out[k] = flat.reshape(shapes)
            continue
        sizes = [math.prod(s) for s in shapes]
        out[k] = [t.reshape(s) for t, s in zip(torch.split(flat, sizes), shapes)]
    return out


def train_rows(ctx: Context, engine: TrainEngine, consumer: str, columns: Sequence[str],
               cached: Sequence[str] = ()) -> dict:
    """This DP rank's balanced share of the ready rows: ``{"rows": [...], column: values...}``."""
    b = None
    if engine.is_data_leader:
        b = ctx.dock.get(consumer, list(columns) + list(cached), None, dp_rank=engine.dp_rank,
                         dp_size=engine.dp_size, timeout=ctx.recipe.trainer.dock_timeout_s)
    data = {"rows": list(b.rows) if b is not None else [],
            **({c: list(b[c]) if isinstance(b[c], list) else b[c] for c in columns} if b is not None else {})}
    if cached:  # collective on every rank: one all-to-all moves the cached rows to their consumer
        if engine.dp_size == ctx.world and b is not None and b.partition is not None:
            # every rank is its DP rank's leader and the dock's partition already names each one's
            # rows (entry r = DP rank r = world rank r): no all-gather of the wants first
            data.update(ctx.cache.exchange(list(cached), b.partition))
        else:
            data.update(ctx.cache.exchange_mine(list(cached), data["rows"]))
    return share_rows(engine, data, ctx.device)


def seq_batch(data: dict, per_token: Sequence[str] = (), per_sample: Sequence[str] = (),
              images_of=None) -> SeqBatch:
    """Rows as an engine-neutral batch; ``advantages`` goes per-sample when it is one number a row.
    ``images_of(prompt_index)``: the rows' images (a VL dataset's, ``WorkerData.images``) when the
    rows carry ``prompt_index``."""
    per_token, per_sample = list(per_token), list(per_sample)
    if "advantages" in data and "advantages" not in per_token + per_sample:
        advs = data["advantages"]
        scalar = isinstance(advs, torch.Tensor) and advs.dim() == 1 or all(a.numel() == 1 for a in advs)
        (per_sample if scalar else per_token).append("advantages")
    sample_cols = {}
    for c in per_sample:
        v = data[c]
        sample_cols[c] = (v.reshape(-1) if isinstance(v, torch.Tensor)
                          else torch.stack([a.reshape(()) for a in v]) if len(v) else torch.zeros(0)).float()
    routed = list(data["routed_experts"]) if "routed_experts" in data else None  # MoE routing replay
    images = images_of(data["prompt_index"]) if images_of is not None and "prompt_index" in data else None
    return SeqBatch(list(data.get("prompt_ids", [])), list(data.get("response_ids", [])),
                    {c: list(data[c]) for c in per_token}, sample_cols, routed, images)


def subset(data: dict, idx: list[int]) -> dict:
    out = {}
    for k, v in data.items():
        if isinstance(v, torch.Tensor):
            out[k] = v[torch.tensor(idx, dtype=torch.long)] if idx else v[:0]
        else:
            out[k] = [v[i] for i in idx]
    return out


def local_counts(engine: TrainEngine, batches: Sequence[SeqBatch]) -> torch.Tensor:
    """``[len(batches), 3]`` int64: each batch's (response tokens, sequences, prompt tokens) on this
    rank; zeros on a model-parallel peer that is not its data leader (it holds a copy). Integers, not
    float64: MindSpeed's adaptor (imported in a megatron worker on Ascend) wraps ``all_reduce`` so
    that a float64 tensor is reduced as a float32 copy and the caller's tensor keeps its local
    values (docs/upstream_contracts.md)."""
    lead = engine.is_data_leader
    return torch.tensor([[b.response_tokens(), len(b), b.prompt_tokens()] if lead else [0, 0, 0]
                         for b in batches], dtype=torch.int64).reshape(len(batches), 3)


def global_counts(engine: TrainEngine, batches: Sequence[SeqBatch]) -> list[tuple[float, float, float]]:
    """Each batch's ``(response tokens, sequences, prompt tokens)`` summed over all DP ranks: one
    all-reduce for all of them (collective; every rank passes as many batches)."""
    mine = local_counts(engine, batches)
    dist.all_reduce(mine)
    return [tuple(map(float, c)) for c in mine.tolist()]
