"""TensorCache.exchange over a gloo group of 3 spawned ranks: exact, variable-length, mixed dtypes."""
from __future__ import annotations

import os
import random
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlrecipes.core.tensor_cache import CacheMiss, TensorCache

pytestmark = pytest.mark.dist

N_ROWS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row_ids(r: int) -> torch.Tensor:
    return torch.arange(1 + (r * 7) % 23, dtype=torch.int64) * 1000 + r       # [L_r]


def row_logp(r: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(r)
    return torch.randn(1 + (r * 7) % 23, generator=g)                         # [L_r]


def row_bf(r: int) -> torch.Tensor:
    return (torch.arange(6, dtype=torch.float32).reshape(2, 3) + r).to(torch.bfloat16)  # [2, 3]


def _worker(rank: int, world: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cache = TensorCache("cpu", rank=rank)
        cache.clear(step=0)
        held = [r for r in range(N_ROWS) if r % world == rank]                  # producer layout
        cache.put("ids", held, [row_ids(r) for r in held])
        cache.put("logp", held, [row_logp(r) for r in held])
        cache.put("bf", held, torch.stack([row_bf(r) for r in held]))          # [n, 2, 3]
        # consumer layout: a shuffled partition into uneven bins; one rank wants nothing
        perm = list(range(N_ROWS))
        random.Random(7).shuffle(perm)
        wanted = [perm[:17], [], perm[17:]] if world == 3 else [perm[: N_ROWS // 2], perm[N_ROWS // 2:]]
        out = cache.exchange(["ids", "logp", "bf"], wanted)
        mine = wanted[rank]
        assert len(out["ids"]) == len(mine)
        for r, a, b, c in zip(mine, out["ids"], out["logp"], out["bf"]):
            assert torch.equal(a, row_ids(r)) and a.dtype == torch.int64
            assert torch.equal(b, row_logp(r))
            assert torch.equal(c, row_bf(r)) and c.dtype == torch.bfloat16
        # rows this rank held itself did not travel; others did, and are now cached here
        expect_recv = [r for r in mine if r % world != rank]
        assert (cache.bytes_received > 0) == bool(expect_recv)
        assert cache.has("ids", mine)
        # exchange_mine: ranks only know their own wants
        back = cache.exchange_mine(["logp"], [r for r in range(N_ROWS) if r % world == (rank + 1) % world])
        for r, t in zip([r for r in range(N_ROWS) if r % world == (rank + 1) % world], back["logp"]):
            assert torch.equal(t, row_logp(r))
        # every rank wants what it holds (a balanced claim of cached rows): no bytes move
        cache.put("v", held, [row_logp(r) for r in held])
        sent = cache.bytes_sent
        own = cache.exchange(["v"], [[r for r in range(N_ROWS) if r % world == q] for q in range(world)])
        assert cache.bytes_sent == sent and [t.tolist() for t in own["v"]] == [row_logp(r).tolist() for r in held]
        # every rank wants what it holds, and says so (a dock claim's partition_holders): no collective
        cache.put("v", held, [row_logp(r) for r in held])
        wants = [[r for r in range(N_ROWS) if r % world == q] for q in range(world)]
        for _ in range(rank + 1):  # ranks call it unequally often: a collective would hang
            own = cache.exchange(["v"], wants, holders={"v": [[q] * len(w) for q, w in enumerate(wants)]})
        assert [t.tolist() for t in own["v"]] == [row_logp(r).tolist() for r in held]
        # a row nobody holds: the wanting rank gets CacheMiss, nobody hangs
        try:
            cache.exchange(["ids"], [[999] if q == 0 else [] for q in range(world)])
        except CacheMiss as e:
            assert rank == 0 and "999" in str(e)
        else:
            assert rank != 0
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3])
def test_exchange_moves_exactly_the_wanted_rows(world):
    mp.spawn(_worker, args=(world, _free_port()), nprocs=world, join=True)
