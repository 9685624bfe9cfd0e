"""What one blocking call costs on this host: an asyncio actor, a threaded actor, and a dock get.

The TransferDock's warehouses are threaded actors because of the first two lines; the third and
fourth price one ``get`` of ready rows (``--rows`` rows of ``--tokens`` int64 tokens) through a
Ray dock (one warehouse on this node) and through the in-process dock a one-worker run uses.
One JSON line each: ``{"what", "median_ms", "p90_ms", "calls"}``.

    python benchmarks/ray_latency.py [--calls 300] [--rows 64] [--tokens 24]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _timed(what: str, fn, calls: int) -> dict:
    for _ in range(max(5, calls // 10)):  # warm-up
        fn()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return {"what": what, "median_ms": round(statistics.median(ts) * 1e3, 3),
            "p90_ms": round(ts[int(0.9 * (len(ts) - 1))] * 1e3, 3), "calls": calls}


class _Echo:
    def f(self, x=None):
        return x


class _AsyncEcho:
    async def f(self, x=None):
        return x


def _dock_get(dock, n_rows: int, tokens: int):
    import torch

    state = {"i": 0}
    dock.reset(0)
    rows = dock.add_groups(max(1, n_rows // 8), 8)
    dock.put({"response_ids": [torch.arange(tokens) for _ in rows]}, rows)

    def one():  # a new consumer name each call: every get is a fresh claim of all rows
        state["i"] += 1
        dock.get(f"c{state['i']}", ["response_ids"], None)
    return one


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args(argv)
    import ray

    from rlrecipes.core.dock import TransferDock

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        sync_actor = ray.remote(_Echo).options(max_concurrency=16).remote()
        async_actor = ray.remote(_AsyncEcho).remote()
        print(json.dumps(_timed("asyncio_actor_call", lambda: ray.get(async_actor.f.remote()), a.calls)), flush=True)
        print(json.dumps(_timed("threaded_actor_call", lambda: ray.get(sync_actor.f.remote()), a.calls)), flush=True)
        for what, dock in (("ray_dock_get", TransferDock.ray()),
                           ("in_worker_dock_get", TransferDock.in_worker().build())):
            print(json.dumps(_timed(what, _dock_get(dock, a.rows, a.tokens), a.calls)), flush=True)
            dock.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
