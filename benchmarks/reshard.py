"""Reshard benchmark: every strategy x layout pair, one JSON line each (never asserted in tests).

    python benchmarks/reshard.py                                  # 8 gloo ranks, ~200M fp32 params
    python benchmarks/reshard.py --params-m 50 --pairs tp2-tp4 --strategies allgather_naive,allgather_swap
    python benchmarks/reshard.py --world 4 --family deepseek_v3 --pairs ep2-ep8
    python benchmarks/reshard.py --world 4 --params-m 50 --pairs x-tp2-tp1     # disaggregated placement

Fields per line:
  strategy, layout ("<train> -> <rollout>"), family, params, seconds (max over ranks, barrier to barrier),
  bytes_sent / bytes_recv (max over ranks of the logical payload leaving / arriving at a rank),
  bytes_min (max over ranks of the plan minimum: what a rank must receive because it lacks it),
  peak_extra_bytes (max over ranks of the measured high-water mark minus the level before the call),
  tracked_peak_bytes (the executor's own count of its transient buffers, max over ranks),
  expert_* (the same figures for the expert tensors only, MoE pairs), swap_* (allgather_swap only).
  Disaggregated pairs (``x-...``): train on the first half of the ranks, rollout on the second
  (placement, train_ranks, rollout_ranks in the row); only ``auto`` (= cross_alltoallv) runs; the
  byte and peak figures are given for each side (``train_*`` / ``rollout_*``, max over that side).

Memory method (CPU): every rank runs with ``MALLOC_MMAP_THRESHOLD_=65536`` so large buffers are
mmap'ed and returned to the kernel when freed; before each call the rank resets its RSS
high-water mark (``echo 5 > /proc/self/clear_refs``) and reads VmRSS; after the call VmHWM - VmRSS(before)
is the peak extra, after one unreported warm-up pass (process groups' first-use buffers). Rollout
shards are consumed as they arrive (checked, then dropped, as a rollout
engine would copy them into its own weights), so the figure is the executor's transient memory.
On accelerators the same fields come from rlrecipes.device.memory_stats (allocator peak).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import zlib
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from rlrecipes import device as rdevice  # noqa: E402
from rlrecipes.core.parallel import ParallelLayout  # noqa: E402
from rlrecipes.core.resharder import STRATEGIES, Resharder, plan_reshard, shard_for  # noqa: E402
from rlrecipes.models import ModelDims  # noqa: E402
from rlrecipes.models.sharding import param_specs, split_layers  # noqa: E402

# Layout pairs mirroring the recipes (8 ranks): qwen25_7b TP2 PP2 -> TP1 style, TP up, qwen3_moe EP2 -> EP8.
PAIRS = {
    "tp4pp2-tp1": ("qwen2", lambda w: (ParallelLayout.of(4, pp=2, dp=w // 8), ParallelLayout.of(1, dp=w))),
    "tp2-tp4": ("qwen2", lambda w: (ParallelLayout.of(2, dp=w // 2), ParallelLayout.of(4, dp=w // 4))),
    "ep2-ep8": ("qwen3_moe", lambda w: (ParallelLayout.of(4, dp=w // 4, ep=2), ParallelLayout.of(1, dp=w, ep=8))),
    # disaggregated: train TP2 on ranks [0, w/2), rollout TP1 on [w/2, w) (every rollout rank gets the whole model)
    "x-tp2-tp1": ("qwen2", lambda w: (ParallelLayout.of(2, dp=w // 4), ParallelLayout.of(1, dp=w // 2))),
}
DISAGG = {"x-tp2-tp1"}


def bench_dims(family: str, params_m: float, pp: int = 2) -> ModelDims:
    """A model of the family with ~params_m million parameters; every tensor <= ~50 MB in fp32."""
    if family == "qwen2":
        base = ModelDims(family="qwen2", vocab_size=8192, hidden_size=1024, num_layers=2, num_heads=16,
                         num_kv_heads=8, head_dim=64, intermediate_size=4096, attention_bias=True)
    elif family == "qwen3_moe":
        base = ModelDims(family="qwen3_moe", vocab_size=8192, hidden_size=768, num_layers=2, num_heads=16,
                         num_kv_heads=8, head_dim=48, intermediate_size=2048, num_experts=16,
                         moe_intermediate_size=512, experts_per_token=2)
    elif family == "deepseek_v3":
        base = ModelDims(family="deepseek_v3", vocab_size=8192, hidden_size=768, num_layers=2, num_heads=16,
                         num_kv_heads=16, head_dim=64, intermediate_size=2048, num_experts=16,
                         moe_intermediate_size=512, experts_per_token=2, num_shared_experts=1, first_k_dense=1,
                         q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                         v_head_dim=32)
    else:
        raise SystemExit(f"unknown --family {family!r}")
    per_layer = (base.total_params() - base.embedding_params()) / base.num_layers
    layers = max(pp, round((params_m * 1e6 - base.embedding_params()) / per_layer))
    layers += (-layers) % pp
    return replace(base, num_layers=layers)


def _sum64(t: torch.Tensor) -> float:
    """Sum in float64, 1 Mi elements at a time (``t.sum(dtype=float64)`` makes a float64 copy of the
    whole tensor first, which the peak-memory figure would count)."""
    flat = t.reshape(-1)
    return sum(float(c.sum(dtype=torch.float64)) for c in flat.split(1 << 20))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Mem:
    """Peak-extra meter: RSS high-water mark on CPU, allocator peak on accelerators."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self.hwm_ok = False
        if dev.type == "cpu":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self.hwm_ok = True
            except OSError:
                pass

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0

    def start(self) -> None:
        if self.dev.type == "cpu":
            if self.hwm_ok:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            self.before = rdevice.host_rss_bytes()
        else:
            rdevice.reset_peak_memory(self.dev)
            self.before = rdevice.memory_stats(self.dev).allocated_bytes

    def peak_extra(self) -> int:
        if self.dev.type == "cpu":
            peak = self._status("VmHWM:") if self.hwm_ok else rdevice.host_peak_rss_bytes()
            return max(0, peak - self.before)
        return max(0, rdevice.memory_stats(self.dev).peak_bytes - self.before)


def _worker(rank, world, port, args, q):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dev = torch.device("cpu")
    mem = _Mem(dev)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    try:
        for pair in args.pairs:
            fam_default, mk = PAIRS[pair]
            family = args.family or fam_default
            train, rollout = mk(world)
            placement = "disaggregated" if pair in DISAGG else "colocated"
            dims = bench_dims(family, args.params_m, pp=train.pp)
            pp_layers = split_layers(dims.num_layers, train.pp) if train.pp > 1 else None
            specs = param_specs(dims, pp_layers)
            plan = plan_reshard(train, rollout, specs, dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                                placement=placement)
            is_train = rank in plan.train_ranks
            j = plan.rollout_rank(rank)
            # local train shards, generated parameter by parameter (never the whole model)
            local, checks = {}, {}
            for s in specs:
                g = torch.Generator().manual_seed(zlib.crc32(s.name.encode()))
                full = torch.randn(s.shape, generator=g).to(dtype)
                t = shard_for(s, full, train, rank) if is_train else None
                if t is not None:
                    local[s.name] = t.clone()
                if j is not None:
                    checks[s.name] = float(shard_for(s, full, rollout, j).double().sum())
                del full
            ex = {s.name for s in specs if s.kind == "expert"}
            ex_idx = {i for i, s in enumerate(specs) if s.kind == "expert"}
            ex_min = sum(p.numel for p in plan.recv[rank] if p.spec in ex_idx) * plan.dtype_bytes
            # an unreported warm-up pass: gloo sets its communicators' buffers up on a group's first
            # collective (~36 MB per rank measured), which would be charged to the first strategy
            for bucket in Resharder(plan, "auto", bucket_mb=args.bucket_mb).reshard(local):
                del bucket
            for strategy in args.strategies:
                if plan.disaggregated and strategy != "auto":
                    continue
                rs = Resharder(plan, strategy, bucket_mb=args.bucket_mb)
                dist.barrier()
                mem.start()
                t0 = time.perf_counter()
                ok = True
                for bucket in rs.reshard(local):
                    for name, t in bucket:  # the rollout engine loads it; here: check, then drop
                        ok &= abs(_sum64(t) - checks[name]) <= 1e-6 * (1 + abs(checks[name]))
                    del bucket
                    t = None  # the loop variable would keep the last tensor (and a receive buffer it views) alive
                dist.barrier()
                secs = time.perf_counter() - t0
                peak = mem.peak_extra()
                row = {"strategy": strategy, "layout": f"{train.describe()} -> {rollout.describe()}", "family": family,
                       "params": sum(s.numel for s in specs), "world": world, "bucket_mb": args.bucket_mb,
                       "seconds": secs, "bytes_sent": rs.stats.sent_bytes, "bytes_recv": rs.stats.recv_bytes,
                       "bytes_min": plan.min_bytes(rank), "peak_extra_bytes": peak,
                       "tracked_peak_bytes": rs.stats.peak_transient_bytes, "exact": ok}
                if plan.disaggregated:
                    side = "train" if is_train else "rollout"
                    row.update(placement=placement, train_ranks=[0, train.world],
                               rollout_ranks=[train.world, plan.world], side=side,
                               **{f"{side}_{k}": row[k] for k in ("bytes_sent", "bytes_recv", "bytes_min",
                                                                  "peak_extra_bytes", "tracked_peak_bytes")})
                if ex:
                    m = "alltoallv_experts" if strategy in ("alltoallv_experts", "auto") else None
                    if m:
                        row.update(expert_bytes_recv=rs.stats.phases[m]["recv"], expert_peak_tracked=rs.stats.phases[m]["peak"])
                    row["expert_bytes_min"] = ex_min
                if strategy == "allgather_swap":
                    t1 = time.perf_counter()
                    released = rs.swap_out(local)
                    t2 = time.perf_counter()
                    freed = all(t.untyped_storage().nbytes() == 0 for t in local.values())
                    rs.swap_in()
                    row.update(swap_out_s=t2 - t1, swap_in_s=time.perf_counter() - t2, swap_bytes=released,
                               swap_storage_released=freed)
                q.put((rank, row))
            del local
    finally:
        dist.destroy_process_group()


def _merge(rows: list[dict]) -> dict:
    out = dict(rows[0])
    out.pop("side", None)
    for side in ("train", "rollout"):
        for k in ("bytes_sent", "bytes_recv", "bytes_min", "peak_extra_bytes", "tracked_peak_bytes"):
            vals = [r[f"{side}_{k}"] for r in rows if f"{side}_{k}" in r]
            out.pop(f"{side}_{k}", None)
            if vals:
                out[f"{side}_{k}"] = max(vals)
    for k in ("seconds", "bytes_sent", "bytes_recv", "bytes_min", "peak_extra_bytes", "tracked_peak_bytes",
              "expert_bytes_recv", "expert_peak_tracked", "expert_bytes_min", "swap_out_s", "swap_in_s", "swap_bytes"):
        if k in out:
            out[k] = max(r[k] for r in rows)
    for k in ("exact", "swap_storage_released"):
        if k in out:
            out[k] = all(r[k] for r in rows)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8, help="gloo ranks (multiple of 8 for the default pairs)")
    ap.add_argument("--family", choices=["qwen2", "qwen3_moe", "deepseek_v3"], default=None,
                    help="override the family of every pair (default: qwen2 for dense pairs, qwen3_moe for EP)")
    ap.add_argument("--params-m", type=float, default=200.0, help="model size in millions of parameters")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--pairs", default=",".join(PAIRS), help=f"comma list of {', '.join(PAIRS)}")
    ap.add_argument("--strategies", default=",".join(STRATEGIES + ("auto",)))
    args = ap.parse_args(argv)
    args.pairs = [p for p in args.pairs.split(",") if p]
    args.strategies = [s for s in args.strategies.split(",") if s]
    for p in args.pairs:
        if p not in PAIRS:
            raise SystemExit(f"unknown pair {p!r}; choose from {', '.join(PAIRS)}")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed buffers go back to the kernel
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(_worker, args=(args.world, _free_port(), args, q), nprocs=args.world, join=True)
    rows: dict[tuple, list] = {}
    while not q.empty():
        rank, row = q.get()
        rows.setdefault((row["layout"], row["strategy"]), []).append(row)
    for key in rows:
        print(json.dumps(_merge(rows[key])), flush=True)


if __name__ == "__main__":
    main()
