"""Ray bring-up (embedded local, or an existing cluster), resource check and placement.

``connect()`` starts an embedded single-node Ray when no cluster address is given (``--smoke``
runs), or joins ``address`` / ``$RAY_ADDRESS`` / ``auto``. ``check_resources`` compares what the
cluster has against what a plan needs *before* any worker is placed. The per-node part of a
multi-node launch (``rlrecipes launch``, which every recipe's ``launch.sh`` calls) is here too:
the node's environment, the ``ray start`` command of the head and of the other nodes, and the wait
for every node to join.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

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


def token_auth_like_ray_start() -> Optional[str]:
    """Apply `ray start`'s token rule to this process (see :func:`_token_auth_like_ray_start`) and
    return the ``RAY_AUTH_MODE`` it leaves in ``os.environ`` (None when unset). Processes started
    afterwards inherit it, so a node's ``ray start --head``, a joining ``ray start --address`` and the
    run's driver all use one mode (copy the token file to every node under the same path)."""
    _token_auth_like_ray_start()
    return os.environ.get("RAY_AUTH_MODE")


#: the node processes an embedded Ray runs as children of the driver (their /proc comm names)
RAY_NODE_PROCESSES = {"raylet": "raylet (its node manager)", "gcs_server": "GCS (gcs_server, its control store)"}


def dead_ray_processes(pid: Optional[int] = None) -> list[str]:
    """The embedded Ray's node processes (children of ``pid``, this process by default) that died (a
    zombie child), with any other that is not running; empty when no zombie is found. Read from /proc."""
    me, alive, dead = pid or os.getpid(), set(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm, rest = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 1:].split()
        if comm in RAY_NODE_PROCESSES and len(rest) > 1 and rest[1] == str(me):
            if rest[0] in ("Z", "X"):
                dead.append(f"{RAY_NODE_PROCESSES[comm]}, pid {d.name}, died")
            else:
                alive.add(comm)
    if not dead:  # only a zombie is proof: a Ray that starts its processes otherwise must not read as dead
        return []
    named = " ".join(dead)
    return dead + [f"{what} is not running" for comm, what in RAY_NODE_PROCESSES.items()
                   if comm not in alive and what not in named]


def ray_logs_dir() -> str:
    """The logs folder of this process's Ray session (or of the newest one under Ray's temp folder)."""
    try:
        import ray

        node = ray._private.worker._global_node
        if node is not None:
            return node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - Ray's internals moved: the newest session below
        pass
    return os.path.realpath(Path(os.environ.get("RAY_TMPDIR") or "/tmp/ray") / "session_latest" / "logs")


def ray_died(dead: Sequence[str], e: Optional[BaseException] = None) -> ClusterError:
    """The one paragraph for an embedded Ray whose node processes died: what, where the logs are, what to try.
    Its exit code is 1."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0] if e is not None else None
    err = ClusterError(
        f"{'; '.join(f'the embedded Ray' + chr(39) + f's {d}' for d in dead) or 'the embedded Ray did not start'}"
        f"{f' ({first})' if first else ''}; its logs are in "
        f"{ray_logs_dir()} (raylet.out, gcs_server.out and gcs_server.err end with the reason). Likely causes: the "
        "kernel's OOM killer (`dmesg | tail`), a full /tmp or /dev/shm (`df -h /tmp /dev/shm`), or a Ray left "
        "running on this machine (`ray stop`); free what is short, then run the command again.")
    err.code = 1
    return err


def _same_cluster_or_refuse(address: Optional[str]) -> None:
    """A process already joined to Ray (a notebook, an in-process test) may only be asked for that
    same cluster: Ray keeps one session per process, and running on the joined one while the user named
    another would put the run on machines they did not choose."""
    if not address or address in ("auto", "local") or address.startswith("ray://"):
        return  # (a Ray Client address names the client server, not the GCS: nothing to compare)
    import ray

    joined = ray.get_runtime_context().gcs_address or ""
    asked = address.split("://", 1)[-1]
    if not _same_host_port(asked, joined):
        raise ClusterError(f"no Ray cluster at {address!r} for this process: it is already joined to the Ray "
                           f"cluster at {joined!r}, and Ray keeps one cluster per process. Run from a fresh "
                           f"process, or call ray.shutdown() first")


def _same_host_port(a: str, b: str) -> bool:
    """Whether two ``host:port`` spellings name one endpoint: hosts resolved, and this machine's
    loopback and its Ray node address counted as one host."""
    import socket

    import ray

    here = {ray.util.get_node_ip_address()}

    def norm(x: str) -> tuple[str, str]:
        host, _, port = x.rpartition(":")
        try:
            ip = socket.gethostbyname(host or "127.0.0.1")
        except OSError:
            return host, port
        return ("this machine" if ip.startswith("127.") or ip in here else ip), port

    return norm(a) == norm(b)


def connect(address: Optional[str] = None, *, embedded: bool = False, num_cpus: Optional[int] = None,
            resources: Optional[dict] = None) -> str:
    """Initialise Ray; returns 'embedded' or the address joined."""
    import ray

    if ray.is_initialized():
        _same_cluster_or_refuse(address)
        return "existing"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if embedded:
        try:
            ray.init(address="local", num_cpus=num_cpus, resources=resources, include_dashboard=False,
                     log_to_driver=True, configure_logging=False, namespace="rlrecipes")
        except Exception as e:  # Ray raises a bare Exception ("The current node timed out during startup ...")
            raise ray_died(dead_ray_processes(), e) from None
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


@dataclass
class LostNode:
    """A node of the run that Ray's GCS reports dead (or no longer lists)."""

    node_id: str
    ip: str
    reason: str = ""
    """Ray's own words for the death (``DeathReasonMessage``), e.g. that its raylet received SIGTERM."""

    def describe(self) -> str:
        return f"node {self.node_id} ({self.ip})" + (f" [{self.reason}]" if self.reason else "")


def lost_nodes(node_ids: Sequence[str], table: Optional[Sequence[Mapping]] = None) -> list[LostNode]:
    """Which of ``node_ids`` are no longer alive, in their first order; ``table`` is ``ray.nodes()``
    (fetched when None). A GCS that cannot answer counts as "nothing known lost"."""
    if table is None:
        import ray

        try:
            table = ray.nodes()
        except Exception:  # noqa: BLE001 - the caller reports what it already knows
            return []
    known = {n.get("NodeID"): n for n in table}
    out = []
    for node in dict.fromkeys(node_ids):
        n = known.get(node)
        if n is None or not n.get("Alive"):
            out.append(LostNode(node, (n or {}).get("NodeManagerAddress") or "address unknown",
                                ((n or {}).get("DeathReasonMessage") or "").strip()))
    return out


def unanswering_nodes(node_ids: Sequence[str], table: Optional[Sequence[Mapping]] = None,
                      timeout_s: float = 1.0) -> list[LostNode]:
    """Which of ``node_ids`` the GCS still lists alive but whose raylet does not accept a TCP
    connection on its port: a raylet that was killed, or a machine that went away, before Ray's
    health checks (15 s or more) mark the node dead."""
    import socket

    if table is None:
        import ray

        try:
            table = ray.nodes()
        except Exception:  # noqa: BLE001
            return []
    known = {n.get("NodeID"): n for n in table}
    out = []
    for node in dict.fromkeys(node_ids):
        n = known.get(node)
        if n is None or not n.get("Alive") or not n.get("NodeManagerPort"):
            continue
        ip, port = n.get("NodeManagerAddress"), int(n["NodeManagerPort"])
        try:
            socket.create_connection((ip, port), timeout=timeout_s).close()
        except OSError as e:
            out.append(LostNode(node, ip, f"its raylet at {ip}:{port} does not answer: "
                                          f"{e.strerror or type(e).__name__}"))
    return out


def wait_for_lost_nodes(node_ids: Sequence[str], wait_s: float, poll_s: float = 0.25) -> list[LostNode]:
    """:func:`lost_nodes`, polled for up to ``wait_s`` seconds until one shows up (the GCS may mark a
    node dead a moment after the actors on it failed)."""
    deadline = time.monotonic() + wait_s
    while True:
        lost = lost_nodes(node_ids)
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(poll_s)


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


# ------------------------------------------------------------------------------ multi-node launch
#: Environment every node of an Ascend cluster gets unless it already sets the variable (HCCL
#: timeouts and ports, NPU allocator, task queue, CPU affinity, vllm-ascend). A recipe adds or
#: changes entries with ``rlrecipes launch --env KEY=VALUE`` in its launch.sh.
NODE_ENV_DEFAULTS: dict[str, str] = {
    "HCCL_CONNECT_TIMEOUT": "1800",
    "HCCL_EXEC_TIMEOUT": "3600",
    "HCCL_IF_BASE_PORT": "48000",
    "HCCL_BUFFSIZE": "256",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "TASK_QUEUE_ENABLE": "2",
    "CPU_AFFINITY_CONF": "1",
    "VLLM_USE_V1": "1",
    "VLLM_ENABLE_GRAPH_MODE": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
}
#: Socket interfaces, each defaulting to ``$SOCKET_IFNAME`` (else eth0).
SOCKET_IFNAME_VARS = ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
#: The Ascend toolkit's own environment script, sourced when present.
ASCEND_SET_ENV = Path("/usr/local/Ascend/ascend-toolkit/set_env.sh")


def sourced_environment(script: Path, base: Mapping[str, str]) -> dict[str, str]:
    """The environment after ``source script`` in bash, starting from ``base``."""
    out = subprocess.run(["bash", "-c", 'source "$0" >/dev/null 2>&1; env -0', str(script)], env=dict(base),
                         capture_output=True, timeout=120)
    if out.returncode != 0:
        why = out.stderr.decode(errors="replace")[-500:]
        raise ClusterError(f"sourcing {script} failed (exit {out.returncode}): {why}")
    env = dict(item.split("=", 1) for item in out.stdout.decode(errors="replace").split("\0") if "=" in item)
    for k in ("_", "SHLVL", "PWD", "OLDPWD"):  # bash's own bookkeeping, not the script's
        if k in base:
            env[k] = base[k]
        else:
            env.pop(k, None)
    return env


def node_environment(base: Mapping[str, str], extra: Optional[Mapping[str, str]] = None,
                     set_env: Optional[Path] = ASCEND_SET_ENV) -> dict[str, str]:
    """A launch node's environment: ``base`` with the Ascend toolkit's ``set_env.sh`` sourced (when
    it exists), then :data:`NODE_ENV_DEFAULTS` updated by ``extra`` (a recipe's own values) for
    every variable the node does not set itself. The node's own settings always win."""
    env = sourced_environment(set_env, base) if set_env is not None and set_env.is_file() else dict(base)
    defaults = dict(NODE_ENV_DEFAULTS)
    defaults.update({k: env.get("SOCKET_IFNAME", "eth0") for k in SOCKET_IFNAME_VARS})
    defaults.update(extra or {})
    for k, v in defaults.items():
        env.setdefault(k, v)
    return env


def ray_start_command(*, head: bool, host: str, port: int, resources: Mapping[str, int],
                      extra: Sequence[str] = (), ray: str = "ray") -> list[str]:
    """``ray start`` for one node: the head (``--head`` on ``host:port``, returns once it is up) or
    a node joining it (``--address host:port``, stays in the foreground with ``--block`` until the
    head stops Ray). ``resources`` are the node's custom resources (``{"NPU": 16}``), ``extra`` the
    user's own flags (``RAY_START_ARGS``), passed last."""
    res = f"--resources={json.dumps(dict(resources), separators=(', ', ': '))}"
    if head:
        return [ray, "start", "--head", f"--port={port}", f"--node-ip-address={host}", res, "--disable-usage-stats",
                *extra]
    return [ray, "start", f"--address={host}:{port}", res, "--disable-usage-stats", *extra, "--block"]


def wait_for_nodes(nodes: int, devices_per_node: int, resource: str, timeout_s: float, *,
                   probe: Optional[Callable[[], ClusterResources]] = None,
                   report: Callable[[ClusterResources], None] = lambda found: None, poll_s: float = 10.0,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
                   ) -> ClusterResources:
    """Poll the connected cluster (``probe``, default :func:`cluster_resources`) until it has
    ``nodes`` alive nodes and ``nodes * devices_per_node`` devices of ``resource``; ``report`` sees
    every poll. Raises ClusterError after ``timeout_s``, saying what had joined."""
    probe = probe or (lambda: cluster_resources(resource))
    deadline = clock() + timeout_s
    while True:
        found = probe()
        report(found)
        if found.nodes >= nodes and found.total_devices >= nodes * devices_per_node:
            return found
        if clock() > deadline:
            raise ClusterError(f"timed out after {timeout_s:g}s waiting for {nodes} node(s) with {devices_per_node} "
                               f"{resource} device(s) each; joined: {found.describe()}. Run the same launch command "
                               "on every node (NODE_RANK 1.. join the head at MASTER_ADDR:RAY_PORT), or raise "
                               "JOIN_TIMEOUT_S.")
        sleep(poll_s)
