"""What one TransferDock call costs on the Ray backend: one client actor, one warehouse, small rows,
over the dock's channel (ZeroMQ; between machines encrypted with CURVE unless ``--encryption off``;
on one machine the warehouse's socket files unless ``--wire tcp``).

Ops, each repeated ``--calls`` times by the client in its own loop:
  empty    an empty Ray actor call to a plain actor (what the same call would cost as a Ray call)
  control  a controller call through the warehouse (``step``)
  put      ``put`` of one column for 32 rows, then ``flush`` (the write's round trip)
  claim    ``put(..., defer=True)`` of one column, then a ``get`` of another for the same rows
           (the write rides on the claim: "write my outputs, hand me my next inputs")

One JSON line per op: ``{"op", "transport", "encrypted", "wire", "nodes", "calls", "us_per_call",
"cpu_us_per_call", "cpu_us_per_call_dock", "client_channels", "head_channels"}`` (the direct channels
open after the op); ``cpu_us_per_call`` counts every process of the local Ray session (caller,
warehouse, raylet, ...), the steadier figure on a shared host (see sample_flow.py);
``cpu_us_per_call_dock`` only the client's and the warehouses' processes (the transport's own cost,
without the idle Ray daemons' background).

``--nodes 2`` starts a local two-node Ray cluster (``ray.cluster_utils.Cluster``) and pins the client
to the second node, whose warehouse holds the client's rows (``writer_node`` placement) but not the
controller: each commit and claim then also crosses from that warehouse to the head's controller
(over a channel of its own).

    python benchmarks/dock_call.py [--calls 5000] [--rows 32] [--width 8] [--encryption on|off]
                                   [--wire files|tcp] [--nodes 1|2]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OPS = ("empty", "control", "put", "claim")


class _Plain:
    def noop(self):
        return None


class _Client:
    def __init__(self, dock, plain, rows: int, width: int):
        import torch
        self.d, self.plain = dock, plain
        self.rows = self.d.reset(0, groups=(max(rows // 8, 1), min(rows, 8)))
        self.x = torch.zeros(len(self.rows), width, dtype=torch.int64)   # [rows, width]
        self.d.put({"c0": self.x}, self.rows)
        self.d.flush()
        self.claims = 0   # each claim is a new consumer (a consumer takes each row once)

    def channels(self) -> int:
        """Channels this client has open."""
        return self.d.channels_open

    def loop(self, op: str, n: int) -> float:
        import ray
        from rlrecipes.core.dock.messages import CurrentStep
        d, rows, x = self.d, self.rows, self.x
        t0 = time.perf_counter()
        for i in range(n):
            if op == "empty":
                ray.get(self.plain.noop.remote())
            elif op == "control":
                d._wait(d._ctl(CurrentStep()))
            elif op == "put":
                d.put({"p": x}, rows)
                d.flush()
            else:
                d.put({"p": x}, rows, defer=True)
                self.claims += 1
                d.get(f"claim{self.claims}", ["c0"], None, dp_rank=0, dp_size=1)
        return (time.perf_counter() - t0) / n


def _actors_cpu() -> float:
    """CPU seconds of this session's client, plain and warehouse actor processes (by process title)."""
    import psutil
    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith(("ray::_Client", "ray::_Warehouse", "ray::_Plain")):
                t = p.cpu_times()
                total += t.user + t.system
        except (psutil.Error, IndexError):
            pass
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--width", type=int, default=8, help="int64 values per row")
    ap.add_argument("--encryption", default="on", choices=["on", "off"],
                    help="direct channels encrypted (CURVE) or in clear (TransferDock.ray(encryption=))")
    ap.add_argument("--wire", default="files", choices=["files", "tcp"],
                    help="a client on a warehouse's machine: its socket files (files, the default) or TCP as "
                         "from another node (tcp: what encryption costs; TransferDock.ray(same_host_files=))")
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--nodes", type=int, default=1, choices=[1, 2],
                    help="2: the client's warehouse is not the controller's (a local two-node cluster)")
    args = ap.parse_args(argv)

    import ray
    from benchmarks.sample_flow import _session_cpu
    from rlrecipes.core.dock import TransferDock

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {"env_vars": {"PYTHONPATH": root}}
    cluster, pin, nodes = None, {}, None
    if args.nodes == 1:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,   # never a running cluster
                 configure_logging=False, runtime_env=env)
    else:
        from ray.cluster_utils import Cluster
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        cluster.add_node(num_cpus=1, resources={"client_node": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False, runtime_env=env)
        pin = {"resources": {"client_node": 0.01}}
        # the controller's warehouse first (warehouse 0 hosts it), the client's second
        alive = [n for n in ray.nodes() if n["Alive"]]
        nodes = [n["NodeID"] for n in sorted(alive, key=lambda n: "client_node" in n["Resources"])]
    dock = TransferDock.ray(encryption=args.encryption == "on",
                            same_host_files=args.wire == "files", nodes=nodes,
                            placement="writer_node" if args.nodes > 1 else "round_robin")
    try:
        plain = ray.remote(num_cpus=0)(_Plain).options(**pin).remote()
        client = ray.remote(num_cpus=0)(_Client).options(**pin).remote(dock, plain, args.rows, args.width)
        for op in args.ops:
            ray.get(client.loop.remote(op, max(args.calls // 10, 1)))     # warm-up
            cpu0, dock0 = _session_cpu(), _actors_cpu()
            dt = ray.get(client.loop.remote(op, args.calls))
            cpu = (_session_cpu() - cpu0) / args.calls
            dock_cpu = (_actors_cpu() - dock0) / args.calls
            # open direct channels: the client's to warehouses, the warehouses' to the head's controller
            head_channels = sum(w["head_channels"] for w in dock.stats()["warehouses"])
            print(json.dumps({"op": op, "transport": "channel" if op != "empty" else "ray",
                              "encrypted": dock.encrypted if op != "empty" else False, "wire": args.wire,
                              "nodes": args.nodes, "calls": args.calls, "us_per_call": round(dt * 1e6),
                              "cpu_us_per_call": round(cpu * 1e6), "cpu_us_per_call_dock": round(dock_cpu * 1e6),
                              "client_channels": ray.get(client.channels.remote()),
                              "head_channels": head_channels}), flush=True)
    finally:
        dock.shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    main()
