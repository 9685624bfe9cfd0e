"""core.collectives on 3 gloo ranks: objects small enough for one collective, objects larger than
the buffer (a second collective on every rank alike), subgroups, and the same answers as torch's
object collectives."""
from __future__ import annotations

import torch
import torch.distributed as dist

from rlrecipes.core.collectives import all_gather_objects, broadcast_object
from dist_harness import run_ranks


def _body(rank, tmp):
    small = {"rank": rank, "rows": list(range(rank * 4, rank * 4 + 4)), "t": (1.5, None)}
    big = {"rank": rank, "blob": "x" * (20000 if rank == 1 else 10)}   # only rank 1's exceeds 8 KiB
    for obj in (small, big, None, [rank] * rank):
        got = all_gather_objects(obj)
        ref = [None] * 3
        dist.all_gather_object(ref, obj)
        assert got == ref, (got, ref)
    # broadcast from each rank, small and larger than the buffer, on the world and on a subgroup
    sub = dist.new_group([1, 2])
    for src in range(3):
        for payload in ({"src": src, "x": [src] * 5}, "y" * 30000):
            mine = payload if rank == src else "ignored"
            got = broadcast_object(mine, src)
            assert got == payload, (src, got if len(str(got)) < 80 else len(got))
    if rank in (1, 2):
        got = broadcast_object({"from": 2, "v": torch.arange(3).tolist()} if rank == 2 else None, 2, group=sub)
        assert got == {"from": 2, "v": [0, 1, 2]}
        assert all_gather_objects(rank * 10, group=sub, cap=16) == [10, 20]
        assert all_gather_objects("z" * 100 * rank, group=sub, cap=16) == ["z" * 100, "z" * 200]


def test_object_collectives_match_torch_and_take_large_objects():
    run_ranks(_body, 3)


def test_one_rank_needs_no_process_group():
    assert all_gather_objects({"a": 1}) == [{"a": 1}]
    assert broadcast_object([1, 2]) == [1, 2]
