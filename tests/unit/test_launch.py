"""`rlrecipes launch`, the one per-node launcher every recipe's launch.sh calls: which commands each
NODE_RANK runs, the environment contract, Ray's token rule, argument pass-through. Nothing is
started: commands go to fakes (the real two-raylet cluster is tests/e2e/test_ray_cluster.py)."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlrecipes import cluster
from rlrecipes.cli import app
from rlrecipes.cli._common import CLIError
from rlrecipes.cli.launch import NodeSpec, launch_node, node_commands
from rlrecipes.recipe import find_recipe

ENV = {"NNODES": "3", "MASTER_ADDR": "10.0.0.1", "RAY_PORT": "6400", "NPUS_PER_NODE": "16",
       "RAY_START_ARGS": "--num-cpus 32 --temp-dir '/data/ray tmp'"}
RECIPES = Path(find_recipe("qwen25_7b")).parent


def node(rank: int, **env: str) -> NodeSpec:
    return NodeSpec.from_env({**ENV, "NODE_RANK": str(rank), **env})


def test_the_head_starts_ray_and_runs_the_recipe_with_the_arguments_passed_through(tmp_path):
    cmds = node_commands(node(0), tmp_path, ["--smoke", "--steps", "2", "trainer.lr=1e-3", "--out", "a b"],
                         ray="ray", python="py")
    assert cmds.ray_start == ["ray", "start", "--head", "--port=6400", "--node-ip-address=10.0.0.1",
                              '--resources={"NPU": 16}', "--disable-usage-stats", "--num-cpus", "32", "--temp-dir",
                              "/data/ray tmp"]
    assert cmds.run == ["py", "-m", "rlrecipes", "run", str(tmp_path), "--address", "10.0.0.1:6400", "--nodes", "3",
                        "--devices-per-node", "16", "--smoke", "--steps", "2", "trainer.lr=1e-3", "--out", "a b"]
    assert cmds.stop == ["ray", "stop"]


@pytest.mark.parametrize("rank", [1, 2])
def test_other_nodes_join_the_head_and_block(tmp_path, rank):
    cmds = node_commands(node(rank), tmp_path, ["--smoke"], ray="ray")
    assert cmds.ray_start == ["ray", "start", "--address=10.0.0.1:6400", '--resources={"NPU": 16}',
                              "--disable-usage-stats", "--num-cpus", "32", "--temp-dir", "/data/ray tmp", "--block"]
    assert cmds.run is None and cmds.stop is None  # the run's arguments matter on the head only


def test_environment_contract_defaults_and_errors():
    n = NodeSpec.from_env({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h"})
    assert (n.ray_port, n.npus_per_node, n.join_timeout_s, n.ray_start_args) == (6379, 16, 600.0, ())
    assert n.address == "h:6379" and not n.head
    for env, says in (({"NODE_RANK": "0", "MASTER_ADDR": "h"}, "set NNODES"),
                      ({"NNODES": "2", "MASTER_ADDR": "h"}, "set NODE_RANK"),
                      ({"NNODES": "2", "NODE_RANK": "0"}, "set MASTER_ADDR"),
                      ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "ranks are 0..1"),
                      ({"NNODES": "two", "NODE_RANK": "0", "MASTER_ADDR": "h"}, "NNODES='two'"),
                      ({"NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "h", "JOIN_TIMEOUT_S": "-1"}, "JOIN_TIMEOUT_S"),
                      ({"NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "h", "RAY_START_ARGS": "'open"},
                       "RAY_START_ARGS")):
        with pytest.raises(CLIError, match=says):
            NodeSpec.from_env(env)


class Calls:
    def __init__(self, codes=None):
        self.argvs, self.envs, self.codes = [], [], dict(codes or {})

    def __call__(self, argv, env=None):
        self.argvs.append(argv)
        self.envs.append(env)
        return self.codes.get(argv[1] if argv[0] == "ray" else "run", 0)


def test_head_flow_start_wait_run_stop_and_the_run_exit_code(tmp_path):
    n, order = node(0), []
    call = Calls({"run": 3})
    code = launch_node(n, node_commands(n, tmp_path, ["--smoke"], ray="ray"), call=call,
                       wait=lambda: order.append(len(call.argvs)))
    assert code == 3
    assert [a[:2] for a in call.argvs] == [["ray", "start"], [sys.executable, "-m"], ["ray", "stop"]]
    assert order == [1]  # waited after `ray start --head`, before the run
    assert call.envs[1]["RAY_ADDRESS"] == "10.0.0.1:6400"


def test_head_stops_ray_when_the_wait_fails_and_refuses_a_failed_ray_start(tmp_path):
    n = node(0)
    call = Calls()

    def timeout():
        raise cluster.ClusterError("timed out")

    with pytest.raises(cluster.ClusterError, match="timed out"):
        launch_node(n, node_commands(n, tmp_path, ray="ray"), call=call, wait=timeout)
    assert call.argvs[-1] == ["ray", "stop"] and len(call.argvs) == 2
    call = Calls({"start": 1})
    with pytest.raises(cluster.ClusterError, match="failed with exit code 1"):
        launch_node(n, node_commands(n, tmp_path, ray="ray"), call=call, wait=lambda: None)
    assert len(call.argvs) == 1


def test_a_joining_node_hands_its_process_to_ray_start(tmp_path):
    n, replaced = node(1), []
    call = Calls()
    assert launch_node(n, node_commands(n, tmp_path, ray="ray"), call=call, replace=replaced.append,
                       wait=lambda: pytest.fail("only the head waits")) == 0
    assert replaced == [node_commands(n, tmp_path, ray="ray").ray_start] and call.argvs == []


def test_wait_for_nodes_reports_every_poll_and_times_out_naming_what_joined():
    seen, polls = [], iter([cluster.ClusterResources(1, [16], "NPU", 8), cluster.ClusterResources(2, [16, 8], "NPU", 8),
                            cluster.ClusterResources(2, [16, 16], "NPU", 8)])
    t = [0.0]
    found = cluster.wait_for_nodes(2, 16, "NPU", 60, probe=lambda: next(polls), report=seen.append,
                                   clock=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert found.total_devices == 32 and len(seen) == 3 and t[0] == 20  # both nodes, and every device
    with pytest.raises(cluster.ClusterError, match=r"timed out after 15s .* joined: 1 node\(s\), 16 NPU"):
        cluster.wait_for_nodes(2, 16, "NPU", 15, probe=lambda: cluster.ClusterResources(1, [16], "NPU", 8),
                               clock=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))


def test_node_environment_the_node_wins_then_the_recipe_then_the_defaults(tmp_path):
    env = cluster.node_environment({"HCCL_EXEC_TIMEOUT": "7", "SOCKET_IFNAME": "ib0"},
                                   {"HCCL_BUFFSIZE": "512", "HCCL_EXEC_TIMEOUT": "9", "X_NEW": "1"}, set_env=None)
    assert env["HCCL_EXEC_TIMEOUT"] == "7"  # the node's own setting
    assert env["HCCL_BUFFSIZE"] == "512" and env["X_NEW"] == "1"  # the recipe's --env
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800" and env["HCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert cluster.node_environment({}, set_env=None)["TP_SOCKET_IFNAME"] == "eth0"
    script = tmp_path / "set_env.sh"  # the Ascend toolkit's script, sourced as bash would
    script.write_text('export ASCEND_HOME=/opt/ascend\nexport HCCL_BUFFSIZE=128\necho noise\n')
    env = cluster.node_environment({"PATH": os.environ["PATH"]}, {"HCCL_BUFFSIZE": "512"}, set_env=script)
    assert env["ASCEND_HOME"] == "/opt/ascend" and env["HCCL_BUFFSIZE"] == "128"
    assert not {"_", "SHLVL", "PWD"} & set(env)  # bash's bookkeeping stays out


@pytest.fixture
def ray_token_state(monkeypatch, tmp_path):
    """Ray's token loader and config, reset before and after (the rule caches both in-process)."""
    pytest.importorskip("ray._private.authentication.authentication_token_setup")
    from ray._raylet import AuthenticationTokenLoader, Config

    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    AuthenticationTokenLoader.instance().reset_cache()
    yield monkeypatch
    monkeypatch.undo()
    AuthenticationTokenLoader.instance().reset_cache()
    Config.initialize("")


def test_token_rule_is_rays_own_and_the_commands_inherit_it(ray_token_state, tmp_path):
    assert cluster.token_auth_like_ray_start() is None  # no token anywhere: no mode
    ray_token_state.setenv("RAY_AUTH_MODE", "disabled")
    ray_token_state.setenv("RAY_AUTH_TOKEN", "x" * 32)
    assert cluster.token_auth_like_ray_start() == "disabled"  # an explicit mode is kept
    ray_token_state.delenv("RAY_AUTH_MODE")
    assert cluster.token_auth_like_ray_start() == "token"  # a token and no mode: token auth, as `ray start`
    assert os.environ["RAY_AUTH_MODE"] == "token"  # in this process's environment: `ray start` inherits it
    from ray._raylet import AuthenticationTokenLoader

    ray_token_state.delenv("RAY_AUTH_MODE")
    ray_token_state.delenv("RAY_AUTH_TOKEN")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("y" * 32)  # the token file of `ray get-auth-token --generate`
    AuthenticationTokenLoader.instance().reset_cache()
    assert cluster.token_auth_like_ray_start() == "token"


def test_cli_passes_unknown_options_and_overrides_through_and_takes_env(monkeypatch, tmp_path):
    res = CliRunner().invoke(app, ["launch", "qwen25_7b", "--smoke", "--steps", "2", "-q", "trainer.lr=1e-3",
                                   "--env", "HCCL_BUFFSIZE=512", "--dry-run"],
                             env={**ENV, "NODE_RANK": "0", "HCCL_BUFFSIZE": None})
    assert res.exit_code == 0, res.output
    run_line = next(line for line in res.output.splitlines() if " -m rlrecipes run " in line)
    assert shlex.split(run_line)[-5:] == ["--smoke", "--steps", "2", "-q", "trainer.lr=1e-3"]
    assert str(find_recipe("qwen25_7b").resolve()) in run_line
    assert "HCCL_BUFFSIZE=512" in res.output
    res = CliRunner().invoke(app, ["launch", "qwen25_7b", "--env", "oops", "--dry-run"], env={**ENV, "NODE_RANK": "0"})
    assert res.exit_code == 2 and "KEY=VALUE" in res.output


def test_every_recipe_launch_sh_calls_the_launcher_with_its_own_folder():
    for sh in sorted(RECIPES.glob("*/launch.sh")):
        text = sh.read_text()
        body = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert len(body) <= 4, f"{sh}: a launch.sh is a few lines calling `rlrecipes launch`"
        assert 'exec rlrecipes launch "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"' in text, sh
        assert "ray start" not in text and "RAY_AUTH" not in text, sh  # the logic lives in the package
        assert os.access(sh, os.X_OK), sh
