"""A real Ray cluster, started the way users start one: the recipe's launch.sh in worker mode (a
second raylet) and in head mode (`ray start --head`, wait for the nodes, `rlrecipes run --address`),
on this machine, each raylet with one CPU. The workers must land on both raylets and
each raylet must hold its own TransferDock warehouse. The cluster is stopped even when the test fails."""
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from rlrecipes.recipe import find_recipe

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster_env(tmp_path):
    if shutil.which("ray") is None:
        pytest.skip("the `ray` CLI is not on PATH")
    # this test ends with `ray stop --force`, which stops every Ray on the machine: the e2e tests'
    # shared in-process session (inproc.py) ends first and starts again on the next run that needs it
    from inproc import shutdown_ray

    shutdown_ray()
    port = free_port()
    # Ray rewrites 127.0.0.1 in an address to this machine's node IP and then looks for a raylet
    # there, so the cluster uses that IP (a local interface: nothing leaves the machine)
    from ray._private.services import get_node_ip_address

    ip = get_node_ip_address()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", NNODES="2", MASTER_ADDR=ip, RAY_PORT=str(port),
               NPUS_PER_NODE="1", JOIN_TIMEOUT_S="120", RAY_START_ARGS="--num-cpus 1",
               RAY_ADDRESS=f"{ip}:{port}")
    yield env
    subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_launch_sh_head_and_worker_modes_on_a_two_raylet_cluster(tmp_path, cluster_env):
    launch = find_recipe("qwen25_7b") / "launch.sh"
    env = cluster_env
    worker = head = None
    try:
        head = subprocess.Popen(["bash", str(launch), "--smoke", "--steps", "2", "--quiet", "--out", str(tmp_path / "run")],
                                env=dict(env, NODE_RANK="0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        # the worker node joins once the head's GCS answers
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                socket.create_connection((env["MASTER_ADDR"], int(env["RAY_PORT"])), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None, head.communicate()
                time.sleep(0.5)
        worker = subprocess.Popen(["bash", str(launch)], env=dict(env, NODE_RANK="1"), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        out, err = head.communicate(timeout=600)
        assert head.returncode == 0, (out[-3000:], err[-3000:])
        assert "2/2 nodes" in out, out[-2000:]
        run = tmp_path / "run"
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1]
        info = json.loads((run / "workers.json").read_text())
        assert len(set(info["nodes"])) == 2, info  # one worker on each raylet
        assert sorted(info["dock_warehouse_nodes"]) == sorted(set(info["nodes"]))  # a warehouse per raylet
        assert info["dock_transport"] == "direct"  # workers reach both warehouses over channels
    finally:
        for p in (worker, head):  # the whole session: `ray start --block` outlives a killed bash
            if p is not None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
