"""Sample-flow benchmark: centralised driver vs TransferDock vs TransferDock + TensorCache.

The five-stage flow of one RL step, rollout -> reward -> ref -> advantage -> update, on a local
Ray with W cheap worker actors (no models; ``num_cpus=0``). Every row holds ``input_ids [L]``
int64 and ``log_probs [L]`` float32; each later stage reads its inputs and writes one new column
(``scores [1]``, ``ref_log_probs [L]``, ``advantages [1]``, update writes ``loss [1]``).

Modes:
  centralised  the driver gathers every stage's output (``ray.get``) into one batch and scatters
               contiguous chunks as the next stage's input (the single-controller design).
  dock         every worker runs its own loop over the steps and stages (one call from the driver
               for the whole run, as the workflow's workers do), pulling a token-balanced share of
               the rows from the TransferDock at each stage. A stage's outputs are put with
               ``defer=True``, so they ride on the next stage's claim: one round trip per worker
               and stage ("write my outputs, hand me my next inputs").
  dock+cache   like dock, but columns a worker produces and consumes itself (ids, log-probs,
               scores, ref log-probs, advantages) stay in its TensorCache and the dock records
               only "held on rank r" -- the marks ride on the update's claim. The update stage
               uses the dock's balanced layout; the dock keeps rows with their holder where that
               costs no balance, and ``TensorCache.exchange`` moves whatever the layout moved (with
               this benchmark's equal-length rows: nothing, and no collective).

Prints one JSON line per (mode, W): mode, workers, rows, seq_len, seconds_per_step,
driver_bytes (sample bytes that passed through the driver process, counted where the driver
receives or sends arrays), skew_p50_s / skew_p99_s (last minus first worker start of a stage,
over all stages and measured steps), a2a_bytes_per_step (sample bytes the dock+cache mode's
TensorCache exchange moved between workers), and cpu_s_per_step: CPU seconds used per measured step by
every process of the local Ray session (driver, raylet, GCS, workers, dock actors; warm-up step
excluded; each worker opens its channel to the warehouses before the clock starts, as a run does
once). On a shared 2-core machine the wall time mostly measures how much CPU a mode burns, and
the CPU figure is the steadier of the two.

What is timed, per mode (the same things a real step pays):
  centralised  per stage: one call per worker whose input chunks the driver pickled into the object
               store, results gathered (ray.get) and concatenated in the driver, then split again
               for the next stage -- "the driver splits it, pickles it, sends it, gathers it and
               concatenates it". Row ids are made by the driver itself (no allocation call).
  dock / dock+cache  rank 0 opens each step: a claim that waits for every worker's last write
               of the step before, ``dock.reset(step, groups=...)`` (controller and warehouses
               cleared in parallel and the groups allocated: one round trip) and one broadcast of
               the rows (gloo). Rank 0's clock at each opening delimits the steps; the workflow
               pays the same per step (on worker rank 0).

The dock modes' clients call the warehouses over the dock's channels (ZeroMQ; between machines
encrypted with CURVE unless ``--encryption off``; on one machine the warehouses' socket files
unless ``--wire tcp``); each JSON line says whether it was encrypted.

    python benchmarks/sample_flow.py                       # W = 2, 4, 8, 16; L = 1024; 64 rows/worker
    python benchmarks/sample_flow.py --workers 8 --seq-len 512 --rows-per-worker 32 --steps 5
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GROUP = 8                # samples per prompt (GRPO n)
VOCAB = 32000
STAGES = ["rollout", "reward", "ref", "advantage", "update"]


# ---- stage math (tiny, deterministic, numpy so every mode computes the same) ----------------------
def rollout(rows: np.ndarray, seq_len: int, step: int):
    rng = np.random.default_rng(step * 1_000_003 + int(rows[0]))
    ids = rng.integers(0, VOCAB, size=(rows.size, seq_len), dtype=np.int64)      # [n, L]
    logp = -rng.random((rows.size, seq_len), dtype=np.float32)                   # [n, L]
    return ids, logp


def reward(ids: np.ndarray) -> np.ndarray:
    return ((ids[:, :16].sum(1) % 7) / 7.0).astype(np.float32)                  # [n]


def ref(ids: np.ndarray) -> np.ndarray:
    return -((ids % 13).astype(np.float32) / 13.0)                              # [n, L]


def advantage(scores: np.ndarray) -> np.ndarray:
    g = scores.reshape(-1, GROUP)                                               # [groups, G]
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)).reshape(-1).astype(np.float32)


def update(ids, logp, ref_logp, adv) -> np.ndarray:
    kl = (logp - ref_logp).mean(1)                                              # [n]
    return (-(adv * logp.mean(1)) + 0.01 * kl).astype(np.float32)               # [n]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_worker_class(ray):
    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, rank: int, world: int, seq_len: int, rows_per_worker: int):
            import torch
            torch.set_num_threads(1)
            self.rank, self.world, self.L, self.R = rank, world, seq_len, rows_per_worker
            self.dock = None
            self.cache = None
            self.pg = False

        def ready(self):
            return True

        def init_group(self, port: int):
            import torch.distributed as dist
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world)
            self.pg = True

        def set_dock(self, dock):
            from rlrecipes.core.tensor_cache import TensorCache
            self.dock = dock
            self.cache = TensorCache("cpu", rank=self.rank)
            dock.all_consumed("warm-up")   # opens this thread's channel: once per run, not timed

        # -- centralised: one call per stage, data in and out through the driver --------------
        def stage(self, name: str, step: int, inputs: dict):
            t0 = time.time()
            if name == "rollout":
                ids, logp = rollout(inputs["rows"], self.L, step)
                out = {"input_ids": ids, "log_probs": logp}
            elif name == "reward":
                out = {"scores": reward(inputs["input_ids"])}
            elif name == "ref":
                out = {"ref_log_probs": ref(inputs["input_ids"])}
            elif name == "advantage":
                out = {"advantages": advantage(inputs["scores"])}
            else:
                out = {"loss": update(inputs["input_ids"], inputs["log_probs"],
                                      inputs["ref_log_probs"], inputs["advantages"])}
            return t0, out

        # -- dock modes: the worker's own controller loop over the stages -----------------------
        def run_step(self, step: int, rows: list[int], use_cache: bool):
            import torch
            d, me, W = self.dock, self.rank, self.world
            starts = {}
            rows_np = np.asarray(rows, np.int64)

            starts["rollout"] = time.time()
            ids, logp = rollout(rows_np, self.L, step)
            if use_cache:
                self.cache.clear(step)
                self.cache.put("input_ids", rows, torch.from_numpy(ids))
                self.cache.put("log_probs", rows, torch.from_numpy(logp))
                # metadata is published in one call before the first stage that needs another rank's
                # rows (update); the worker's own stages read its cache directly
                pending = {"input_ids": [self.L] * len(rows), "log_probs": [self.L] * len(rows)}
            else:
                d.put({"input_ids": torch.from_numpy(ids), "log_probs": torch.from_numpy(logp)}, rows, defer=True)

            starts["reward"] = time.time()
            if use_cache:  # same worker, same rows: straight from the cache
                r_rows = rows
                r_ids = self.cache.stacked("input_ids", rows).numpy()
            else:
                b = d.get("reward", ["input_ids"], None, dp_rank=me, dp_size=W)
                r_rows, r_ids = b.rows, b["input_ids"].numpy()
            sc = reward(r_ids)
            if use_cache:
                self.cache.put("scores", rows, torch.from_numpy(sc))
                pending["scores"] = None
            else:
                d.put({"scores": torch.from_numpy(sc)}, r_rows, defer=True)

            starts["ref"] = time.time()
            if use_cache:
                rl = ref(self.cache.stacked("input_ids", rows).numpy())
                self.cache.put("ref_log_probs", rows, torch.from_numpy(rl))
                pending["ref_log_probs"] = [self.L] * len(rows)
            else:
                b = d.get("ref", ["input_ids"], None, dp_rank=me, dp_size=W)
                d.put({"ref_log_probs": torch.from_numpy(ref(b["input_ids"].numpy()))}, b.rows, defer=True)

            starts["advantage"] = time.time()
            if use_cache:  # this worker generated whole groups: its own scores are all it needs
                adv = advantage(self.cache.stacked("scores", rows).numpy())
                self.cache.put("advantages", rows, torch.from_numpy(adv)[:, None])
                pending["advantages"] = None
            else:
                b = d.get("advantage", ["scores"], None, dp_rank=me, dp_size=W, whole_groups=True)
                d.put({"advantages": torch.from_numpy(advantage(b["scores"].numpy()))}, b.rows, defer=True)

            starts["update"] = time.time()
            cols = ["input_ids", "log_probs", "ref_log_probs", "advantages"]
            if use_cache:
                d.mark_cached(pending, rows, me, defer=True)
            b = d.get("update", cols, None, dp_rank=me, dp_size=W)
            if use_cache:  # another DP layout: one all-to-all between the workers
                got = self.cache.exchange(cols, b.partition, holders=b.partition_holders)
                arr = {c: torch.stack(got[c]).numpy() if got[c] else np.zeros((0, self.L))
                       for c in cols}
                loss = update(arr["input_ids"], arr["log_probs"], arr["ref_log_probs"],
                              arr["advantages"].reshape(-1))
                moved = self.cache.bytes_received
            else:
                loss = update(b["input_ids"].numpy(), b["log_probs"].numpy(),
                              b["ref_log_probs"].numpy(), b["advantages"].numpy())
                moved = 0
            d.put({"loss": torch.from_numpy(loss)}, b.rows)
            d.flush()  # the step ends when its last write is committed (puts are sent without waiting)
            return {"starts": starts, "a2a_bytes": moved}

        def run_steps(self, steps: int, use_cache: bool):
            """This worker's own loop over ``steps + 1`` steps (step 0 warms up), as the workflow's
            workers run theirs. Rank 0 opens each step: it waits until every worker's last write of
            the previous step is in (its claim of the ``loss`` column), resets the dock with the
            step's groups, and broadcasts the rows. Rank 0's clock at each opening (and after the
            last step's claim) delimits the steps."""
            import torch
            import torch.distributed as dist
            d, me, W, R = self.dock, self.rank, self.world, self.R
            groups = (W * R // GROUP, GROUP)
            marks, starts, moved = [], [], 0
            for step in range(steps + 2):
                rows = torch.empty(W * R, dtype=torch.int64)
                if me == 0:
                    if step > 0:
                        d.get("step_end", ["loss"], None)      # every worker's last write is in
                    marks.append(time.time())
                    if step <= steps:
                        rows = torch.tensor(d.reset(step, groups=groups), dtype=torch.int64)
                if step > steps:
                    break
                dist.broadcast(rows, 0)
                out = self.run_step(step, rows[me * R:(me + 1) * R].tolist(), use_cache)
                if step > 0:
                    starts.append([out["starts"][s] for s in STAGES])
                    moved += out["a2a_bytes"]
            return {"marks": marks, "starts": starts, "a2a_bytes": moved}

    return Worker


def _session_cpu() -> float:
    """CPU seconds (user + system) of this process and all its descendants (the local Ray)."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    me = psutil.Process()
    total = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_centralised(ray, workers, W, R, L, steps):
    rows_all = np.arange(W * R, dtype=np.int64)
    step_times, skews, driver_bytes = [], [], 0
    for step in range(steps + 1):
        t0 = time.time()
        starts = {s: [] for s in STAGES}
        nbytes = 0
        # rollout: the driver hands out row ids (tiny) and gathers the generated batch
        res = ray.get([w.stage.remote("rollout", step, {"rows": rows_all[i * R:(i + 1) * R]})
                       for i, w in enumerate(workers)])
        batch = {}
        for k in ("input_ids", "log_probs"):
            batch[k] = np.concatenate([o[k] for _, o in res])
            nbytes += batch[k].nbytes
        starts["rollout"] = [t for t, _ in res]
        for name, ins in (("reward", ["input_ids"]), ("ref", ["input_ids"]), ("advantage", ["scores"]),
                          ("update", ["input_ids", "log_probs", "ref_log_probs", "advantages"])):
            chunks = {k: np.split(batch[k], W) for k in ins}                  # contiguous DP chunks
            nbytes += sum(batch[k].nbytes for k in ins)                       # scattered by the driver
            res = ray.get([w.stage.remote(name, step, {k: chunks[k][i] for k in ins})
                           for i, w in enumerate(workers)])
            starts[name] = [t for t, _ in res]
            for k in res[0][1]:
                batch[k] = np.concatenate([o[k] for _, o in res])
                nbytes += batch[k].nbytes                                     # gathered by the driver
        dt = time.time() - t0
        if step > 0:   # step 0 warms up
            step_times.append(dt)
            driver_bytes += nbytes
            skews += [max(v) - min(v) for v in starts.values()]
    return step_times, skews, driver_bytes // steps, driver_bytes // steps


def run_dock(ray, workers, dock, W, R, L, steps, use_cache):
    """Every worker runs its own loop over the steps (one call each, as the workflow's workers do);
    the driver starts them and reads the timings."""
    res = ray.get([w.run_steps.remote(steps, use_cache) for w in workers])
    marks = res[0]["marks"]                    # step s runs from marks[s] to marks[s + 1]
    step_times = [b - a for a, b in zip(marks[1:], marks[2:])]
    skews = [max(col) - min(col) for per_step in zip(*(r["starts"] for r in res)) for col in zip(*per_step)]
    moved = sum(r["a2a_bytes"] for r in res)
    return step_times, skews, 0, moved // steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--rows-per-worker", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10,
                    help="measured steps (after one warm-up step); CPU is read in 10 ms ticks per process, "
                         "so a few steps give a coarse figure")
    ap.add_argument("--modes", nargs="+", default=["centralised", "dock", "dock+cache"],
                    choices=["centralised", "dock", "dock+cache"])
    ap.add_argument("--encryption", default="on", choices=["on", "off"],
                    help="direct channels encrypted (CURVE) or in clear (TransferDock.ray(encryption=))")
    ap.add_argument("--wire", default="files", choices=["files", "tcp"],
                    help="a client on a warehouse's machine: its socket files (files, the default) or TCP as "
                         "from another node (tcp: what encryption costs; TransferDock.ray(same_host_files=))")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray")
    args = ap.parse_args(argv)
    if args.rows_per_worker % GROUP:
        ap.error(f"--rows-per-worker must be a multiple of the group size {GROUP}")

    import ray
    from rlrecipes.core.dock import TransferDock

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": root}})
    try:
        Worker = make_worker_class(ray)
        for W in args.workers:
            R, L = args.rows_per_worker, args.seq_len
            workers = [Worker.remote(i, W, L, R) for i in range(W)]
            ray.get([w.ready.remote() for w in workers])
            port = _free_port()
            ray.get([w.init_group.remote(port) for w in workers])
            dock = TransferDock.ray(encryption=args.encryption == "on",
                                    same_host_files=args.wire == "files")
            ray.get([w.set_dock.remote(dock) for w in workers])
            try:
                for mode in args.modes:
                    # warm-up step 0 is inside run_*; CPU is counted over all steps + 1 and
                    # scaled to the measured ones (the warm-up step costs about the same)
                    cpu0 = _session_cpu()
                    if mode == "centralised":
                        st, sk, db, moved = run_centralised(ray, workers, W, R, L, args.steps)
                    else:
                        st, sk, db, moved = run_dock(ray, workers, dock, W, R, L, args.steps,
                                                     mode == "dock+cache")
                    cpu = (_session_cpu() - cpu0) / (args.steps + 1)
                    print(json.dumps({
                        "mode": mode, "workers": W, "rows": W * R, "seq_len": L,
                        "transport": "channel" if mode != "centralised" else None,
                        "encrypted": dock.encrypted if mode != "centralised" else None, "wire": args.wire,
                        "seconds_per_step": round(float(np.median(st)), 4),
                        "cpu_s_per_step": round(float(cpu), 4),
                        "driver_bytes": int(db),
                        "skew_p50_s": round(float(np.percentile(sk, 50)), 4),
                        "skew_p99_s": round(float(np.percentile(sk, 99)), 4),
                        "a2a_bytes_per_step": int(moved) if mode == "dock+cache" else 0,
                    }), flush=True)
            finally:
                dock.shutdown()
                for w in workers:
                    ray.kill(w)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
