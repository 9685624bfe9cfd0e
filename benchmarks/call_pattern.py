"""What a step's control pattern costs on this host with no data: the floor under sample_flow.py.

Two ways to run S stages over W workers on a local Ray, every call empty:
  fan_out        the driver makes S rounds of W calls, waiting for each round (centralised mode).
  worker_claims  every worker runs its own loop and makes S blocking calls per step to one
                 threaded actor; each call returns once all W workers' calls of that stage arrived
                 (what a TransferDock "everything" claim does). The driver starts the loops once.

One JSON line each: ``{"pattern", "workers", "stages", "ms_per_step", "cpu_ms_per_step"}``;
``cpu_ms_per_step`` counts every process of the local Ray session (the steadier figure on a
shared machine; see sample_flow.py).

    python benchmarks/call_pattern.py [--workers 8] [--stages 5 4 2] [--steps 60]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Barrier:
    """Answers a stage's call once ``world`` calls of it arrived (threads block on a condition)."""

    def __init__(self, world: int):
        self.world, self.seen, self.cond = world, {}, threading.Condition()

    def arrive(self, key) -> None:
        with self.cond:
            self.seen[key] = self.seen.get(key, 0) + 1
            self.cond.notify_all()
            while self.seen[key] < self.world:
                self.cond.wait()


class _Worker:
    def stage(self) -> None:
        return None

    def loop(self, barrier, steps: int, stages: int, tag: int) -> None:
        import ray
        for step in range(steps):
            for s in range(stages):
                ray.get(barrier.arrive.remote((tag, step, s)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--stages", type=int, nargs="+", default=[5, 4, 2])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)

    import ray
    from benchmarks.sample_flow import _session_cpu

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        W = args.workers
        workers = [ray.remote(num_cpus=0)(_Worker).remote() for _ in range(W)]
        barrier = ray.remote(num_cpus=0)(_Barrier).options(max_concurrency=4 * W + 16).remote(W)
        ray.get([w.stage.remote() for w in workers])
        for tag, S in enumerate(args.stages):
            for pattern in ("fan_out", "worker_claims"):
                if pattern == "fan_out":
                    def run(n):
                        for _ in range(n * S):
                            ray.get([w.stage.remote() for w in workers])
                else:
                    def run(n, key=[0]):
                        key[0] += 1
                        ray.get([w.loop.remote(barrier, n, S, (tag, key[0])) for w in workers])
                run(3)  # warm-up
                cpu0, t0 = _session_cpu(), time.perf_counter()
                run(args.steps)
                dt, cpu = (time.perf_counter() - t0) / args.steps, (_session_cpu() - cpu0) / args.steps
                print(json.dumps({"pattern": pattern, "workers": W, "stages": S,
                                  "ms_per_step": round(dt * 1e3, 2), "cpu_ms_per_step": round(cpu * 1e3, 2)}),
                      flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
