"""Getting a train stage's rows: dock claim on the data leader, TensorCache exchange, MP share.

Within an engine's model-parallel group (TP x PP peers) only the data leader reads from and
writes to the dock; the rows are then broadcast to its peers, which run the same forward. Cached
columns (log-probs, values) come from the TensorCache by one collective all-to-all, so they never
travel through Ray. The result is engine-neutral: a :class:`~rlrecipes.engines.base.SeqBatch`.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..engines.base import SeqBatch, TrainEngine
from .context import Context


def broadcast(obj: Any, src: int = 0, group=None) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def share_in_model_parallel_group(engine: TrainEngine, obj: Any) -> Any:
    """The data leader's object on every model-parallel peer of ``engine``."""
    group, src = engine.model_parallel_group()
    return obj if group is None else broadcast(obj, src=src, group=group)


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
    return share_in_model_parallel_group(engine, data)


def seq_batch(data: dict, per_token: Sequence[str] = (), per_sample: Sequence[str] = ()) -> SeqBatch:
    """Rows as an engine-neutral batch; ``advantages`` goes per-sample when it is one number a row."""
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
    return SeqBatch(list(data.get("prompt_ids", [])), list(data.get("response_ids", [])),
                    {c: list(data[c]) for c in per_token}, sample_cols, routed)


def subset(data: dict, idx: list[int]) -> dict:
    out = {}
    for k, v in data.items():
        if isinstance(v, torch.Tensor):
            out[k] = v[torch.tensor(idx, dtype=torch.long)] if idx else v[:0]
        else:
            out[k] = [v[i] for i in idx]
    return out


def global_counts(engine: TrainEngine, batch: SeqBatch) -> tuple[float, float, float]:
    """``(response tokens, sequences, prompt tokens)`` summed over all DP ranks (collective).

    Only data leaders count, so model-parallel peers holding copies do not count twice."""
    lead = engine.is_data_leader
    mine = torch.tensor([batch.response_tokens() if lead else 0, len(batch) if lead else 0,
                         batch.prompt_tokens() if lead else 0], dtype=torch.float64)
    dist.all_reduce(mine)
    return float(mine[0]), float(mine[1]), float(mine[2])
