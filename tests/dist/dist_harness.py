"""Run a test body on N gloo ranks: ``run_ranks(fn, world, *args)`` spawns N processes, each calls
``fn(rank, tmp, *args)``; a rank's traceback is written to a file and the parent reports it."""
from __future__ import annotations

import os
import socket
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, tmp, fn, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RLRECIPES_DEVICE="cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    err = ""
    try:
        fn(rank, tmp, *args)
    except Exception:  # noqa: BLE001 - reported by the parent
        err = traceback.format_exc()
    Path(tmp, f"rank{rank}.err").write_text(err)
    # every rank reaches teardown before any closes its gloo pairs (a rank tearing down while a peer
    # still sends can abort in gloo's transport); bounded, so a rank that failed mid-collective
    # cannot turn the failure into a hang
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=60))
    except RuntimeError:
        pass
    dist.destroy_process_group()


def run_ranks(fn, world: int, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, free_port(), tmp, fn, args), nprocs=world, join=True)
        errs = [Path(tmp, f"rank{r}.err").read_text() for r in range(world)]
    bad = [f"rank {r}:\n{e}" for r, e in enumerate(errs) if e]
    assert not bad, "\n".join(bad)
