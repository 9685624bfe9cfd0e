"""Ray bring-up (embedded local, or an existing cluster), resource check and placement.

``connect()`` starts an embedded single-node Ray when no cluster address is given (``--smoke``
runs), or joins ``address`` / ``$RAY_ADDRESS`` / ``auto``. ``check_resources`` compares what the
cluster has against what a plan needs *before* any worker is placed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import device as dev


class ClusterError(RuntimeError):
    """The cluster cannot host the run; the message says what was found and what to do."""


@dataclass
class ClusterResources:
    nodes: int
    devices_per_node: list[int]
    resource: str
    cpus: float

    @property
    def total_devices(self) -> int:
        return sum(self.devices_per_node)

    def describe(self) -> str:
        per = ", ".join(str(d) for d in self.devices_per_node) or "none"
        return f"{self.nodes} node(s), {self.total_devices} {self.resource} device(s) (per node: {per}), {self.cpus:g} CPUs"


def _token_auth_like_ray_start() -> None:
    """Ray >= 2.5x: `ray start` turns token authentication on when a token exists (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and RAY_AUTH_MODE is unset, but a driver joining with
    ``ray.init(address=...)`` does not, and is refused ("InvalidAuthToken"). Apply `ray start`'s own
    rule (it also refreshes Ray's cached config, which an environment variable alone would not)."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def connect(address: Optional[str] = None, *, embedded: bool = False, num_cpus: Optional[int] = None,
            resources: Optional[dict] = None) -> str:
    """Initialise Ray; returns 'embedded' or the address joined."""
    import ray

    if ray.is_initialized():
        return "existing"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if embedded:
        ray.init(address="local", num_cpus=num_cpus, resources=resources, include_dashboard=False, log_to_driver=True,
                 configure_logging=False, namespace="rlrecipes")
        return "embedded"
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    _token_auth_like_ray_start()
    host, sep, port = target.rpartition(":")
    if sep and port.isdigit() and "://" not in target:  # fail fast instead of Ray's minutes of retries
        import socket

        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise ClusterError(f"no Ray cluster at {target!r}: cannot reach the head's GCS port ({e})") from None
    try:
        ray.init(address=target, include_dashboard=False, log_to_driver=True, namespace="rlrecipes")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"no Ray cluster at {target!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return target


def cluster_resources(resource: str) -> ClusterResources:
    import ray

    per_node = []
    cpus = 0.0
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        r = n.get("Resources", {})
        per_node.append(int(r.get(resource, 0)))
        cpus += r.get("CPU", 0)
    return ClusterResources(len(per_node), per_node, resource, cpus)


def check_resources(found: ClusterResources, nodes: int, devices_per_node: int, recipe_dir: Optional[Path] = None,
                    cpus_needed: float = 0) -> None:
    """Raise ClusterError unless the cluster has `nodes` nodes with `devices_per_node` devices each."""
    full = sum(1 for d in found.devices_per_node if d >= devices_per_node)
    if full >= nodes and found.cpus >= cpus_needed:
        return
    need = f"{nodes} node(s) x {devices_per_node} {found.resource} devices"
    if cpus_needed and found.cpus < cpus_needed:
        need += f" and {cpus_needed:g} CPUs"
    raise ClusterError(f"the Ray cluster is too small: found {found.describe()}; the plan needs {need}.\n"
                       + start_hint(nodes, recipe_dir))


def start_hint(nodes: int, recipe_dir: Optional[Path] = None) -> str:
    """How to bring up a cluster for a recipe with its launch.sh."""
    launch = f"{recipe_dir}/launch.sh" if recipe_dir else "recipes/<recipe>/launch.sh"
    return (f"Start a cluster by running on every node:\n"
            f"  NNODES={nodes} NODE_RANK=<0..{nodes - 1}> MASTER_ADDR=<head node IP> bash {launch}\n"
            f"(the head, NODE_RANK=0, runs the recipe once all nodes have joined), or try it on this "
            f"machine with `rlrecipes run <recipe> --smoke`.")


def placement_group(world: int, resource: str, cpus_per_worker: float = 1.0, timeout_s: float = 60.0):
    """One bundle per worker ({resource: 1, CPU: c}), packed onto as few nodes as possible."""
    import ray
    from ray.util.placement_group import placement_group as _pg

    bundle = {"CPU": cpus_per_worker}
    if resource != "CPU":
        bundle[resource] = 1
    pg = _pg([dict(bundle) for _ in range(world)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise ClusterError(f"could not place {world} workers with {bundle} each within {timeout_s:.0f}s; "
                           f"cluster has {cluster_resources(resource).describe()}")
    return pg



def _runtime_probe(device_type: str) -> tuple[str, Optional[str]]:
    import ray

    return ray.util.get_node_ip_address(), dev.runtime_problem(device_type)


def check_device_runtime(device_type: str) -> None:
    """Refuse a run whose device runtime is missing, before any worker is placed: on every alive node
    that advertises the device's Ray resource, a zero-CPU task checks that the Python environment
    there can drive the device (torch_npu for NPUs, a CUDA build of torch for GPUs). A cluster that
    advertises NPUs would otherwise place every worker, which then fails in setup with
    ``module 'torch' has no attribute 'npu'``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if device_type == "cpu":
        return
    resource = dev.ray_resource(device_type)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(resource, 0) > 0]
    probe = ray.remote(_runtime_probe)
    found = ray.get([probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                     .remote(device_type) for node in nodes])
    bad = sorted({(ip, why) for ip, why in found if why})
    if bad:
        where = ", ".join(ip for ip, _ in bad)
        raise ClusterError(f"nothing was placed: on node(s) {where}, {bad[0][1]}")
