"""`rlrecipes launch`: one node's part of a multi-node run; every recipe's launch.sh calls it.

Run the same command on every node. The node with ``NODE_RANK=0`` starts the Ray head, waits until
``NNODES`` nodes and their devices have joined, runs ``rlrecipes run <recipe> --address ...`` with
the arguments given after the recipe, and stops Ray when the run ends (its exit code is the
run's). Every other node joins the head with ``ray start --address ... --block`` and stays in the
foreground until the head stops Ray. The Ray parts (environment, ``ray start`` commands, the token
rule, the wait) live in ``rlrecipes/cluster.py``.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Mapping, Optional, Sequence

import typer

from .. import cluster
from .. import device as dev
from ._common import bounds, console, die, user_errors

#: the Ray resource each node advertises NPUS_PER_NODE of (the recipes target Atlas A3 nodes)
RESOURCE = dev.ray_resource("npu")

ENV_HELP = {
    "NNODES": "number of nodes (required)",
    "NODE_RANK": "this node's rank, 0 on the head (required)",
    "MASTER_ADDR": "the head node's IP address (required)",
    "RAY_PORT": "the head's Ray port (default 6379)",
    "NPUS_PER_NODE": f"{RESOURCE} devices each node gives Ray; an Atlas A3 node has 16 dies (default 16)",
    "JOIN_TIMEOUT_S": "seconds the head waits for every node to join (default 600)",
    "RAY_START_ARGS": "extra `ray start` flags, e.g. \"--num-cpus 32 --temp-dir /data/ray\"",
    "RAY_ADDRESS": "set by the launcher to MASTER_ADDR:RAY_PORT for the run on the head",
}


@dataclass(frozen=True)
class NodeSpec:
    """One node's part of the launch, from the environment contract (:data:`ENV_HELP`)."""

    nnodes: int
    node_rank: int
    master_addr: str
    ray_port: int = 6379
    npus_per_node: int = 16
    join_timeout_s: float = 600.0
    ray_start_args: tuple[str, ...] = ()

    @property
    def head(self) -> bool:
        return self.node_rank == 0

    @property
    def address(self) -> str:
        return f"{self.master_addr}:{self.ray_port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "NodeSpec":
        """Read the launch variables; a missing or bad one is an error naming it."""
        def number(name: str, default: Optional[str], kind: type = int, least: float = 0, most: float = 0):
            raw = env.get(name, "") or default
            if raw is None:
                die(f"set {name}: {ENV_HELP[name]}")
            try:
                value = kind(raw)
            except ValueError:
                value = None
            if value is None or not least <= value <= most:  # nan fails both
                die(f"{name}={raw!r}: expected {'an integer' if kind is int else 'a number'} from {least:g} to "
                    f"{most:g} ({ENV_HELP[name]})")
            return value

        nodes, per_node = bounds("resources.nodes"), bounds("resources.devices_per_node")
        nnodes = number("NNODES", None, least=nodes["min"], most=nodes["max"])
        rank = number("NODE_RANK", None, most=nodes["max"] - 1)
        if rank >= nnodes:
            die(f"NODE_RANK={rank} with NNODES={nnodes}: ranks are 0..{nnodes - 1}")
        master = env.get("MASTER_ADDR", "")
        if not master:
            die(f"set MASTER_ADDR: {ENV_HELP['MASTER_ADDR']}")
        try:
            extra = tuple(shlex.split(env.get("RAY_START_ARGS", "")))
        except ValueError as e:
            die(f"RAY_START_ARGS: {e}")
        return cls(nnodes, rank, master, number("RAY_PORT", "6379", least=1, most=65535),
                   number("NPUS_PER_NODE", "16", least=per_node["min"], most=per_node["max"]),
                   number("JOIN_TIMEOUT_S", "600", float, least=1, most=7 * 24 * 3600), extra)


@dataclass(frozen=True)
class NodeCommands:
    """What one node runs: ``ray_start``; on the head also ``run`` (the recipe) and ``stop``."""

    ray_start: list[str]
    run: Optional[list[str]] = None
    stop: Optional[list[str]] = None


def node_commands(node: NodeSpec, recipe_dir: Path, run_args: Sequence[str] = (), *, ray: str = "ray",
                  python: str = sys.executable) -> NodeCommands:
    """The commands of ``node``: the head starts Ray, then runs the recipe folder with ``run_args``
    passed through unchanged after the launcher's own ``--address --nodes --devices-per-node``."""
    start = cluster.ray_start_command(head=node.head, host=node.master_addr, port=node.ray_port,
                                      resources={RESOURCE: node.npus_per_node}, extra=node.ray_start_args, ray=ray)
    if not node.head:
        return NodeCommands(start)
    run = [python, "-m", "rlrecipes", "run", str(recipe_dir), "--address", node.address, "--nodes", str(node.nnodes),
           "--devices-per-node", str(node.npus_per_node), *run_args]
    return NodeCommands(start, run, [ray, "stop"])


def parse_env_args(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum():
            die(f"--env {item!r}: expected KEY=VALUE, e.g. --env HCCL_BUFFSIZE=512")
        out[key] = value
    return out


def launch_node(node: NodeSpec, cmds: NodeCommands, *, wait: Callable[[], None],
                call: Callable[..., int] = subprocess.call,
                replace: Optional[Callable[[list[str]], None]] = None,
                say: Callable[[str], None] = lambda s: None) -> int:
    """Run ``node``'s part and return its exit code. A joining node hands its process to
    ``ray start --block`` (through ``replace``, or ``call`` when None). The head starts Ray, calls
    ``wait`` (which returns once every node has joined), runs the recipe, and stops Ray afterwards
    whatever happened."""
    if not node.head:
        say(f"[launch] node {node.node_rank} of {node.nnodes}: joining the Ray head at {node.address}")
        if replace is not None:
            replace(cmds.ray_start)  # does not return
            return 0
        return call(cmds.ray_start)
    say(f"[launch] head of {node.nnodes} node(s): starting Ray at {node.address}")
    code = call(cmds.ray_start)
    if code != 0:
        raise cluster.ClusterError(f"`{shlex.join(cmds.ray_start)}` failed with exit code {code}")
    try:
        wait()
        say(f"[launch] running: {shlex.join(cmds.run)}")
        return call(cmds.run, env=dict(os.environ, RAY_ADDRESS=node.address))
    finally:
        call(cmds.stop)


def _ray_executable(required: bool = True) -> str:
    here = Path(sys.executable).parent / "ray"  # the `ray` of this Python environment first
    found = str(here) if here.is_file() else shutil.which("ray")
    if not found and required:
        die("the `ray` command is not on PATH; install Ray in this Python environment (pip install -e .)")
    return found or "ray"


def _exec(argv: list[str]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(argv[0], argv)


def register(app: typer.Typer) -> None:
    env_lines = "\n".join(f"- `{k}`: {v}" for k, v in ENV_HELP.items())

    @app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
                 help="Start one node of a multi-node run; run the same command on every node (each recipe's "
                      "launch.sh does). NODE_RANK=0 starts the Ray head, waits for NNODES nodes, runs "
                      "`rlrecipes run RECIPE --address ... [RUN_ARGS]` and stops Ray when it ends; the other "
                      "nodes join the head and stay in the foreground. Every argument after RECIPE that is not "
                      "an option of `launch` goes to `rlrecipes run` (`--smoke`, `--steps N`, `a.b=value`, ...).\n\n"
                      "Each node's environment gets the Ascend defaults (HCCL, NPU allocator, vllm-ascend; "
                      "`--env` adds or changes them) for every variable it does not set itself, and the Ascend "
                      "toolkit's set_env.sh when it exists. With a Ray auth token (RAY_AUTH_TOKEN, "
                      "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and RAY_AUTH_MODE unset, every node uses token "
                      "authentication, as `ray start --head` does.\n\n"
                      f"Environment:\n\n{env_lines}\n\n"
                      "Examples: `NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 rlrecipes launch qwen25_7b`  ·  "
                      "`NNODES=16 NODE_RANK=3 MASTER_ADDR=10.0.0.1 bash recipes/deepseek_r1_671b/launch.sh`  ·  "
                      "`NNODES=1 NODE_RANK=0 MASTER_ADDR=127.0.0.1 rlrecipes launch ./my_recipe --smoke --steps 5 "
                      "--dry-run`")
    @user_errors
    def launch(ctx: typer.Context,
               recipe: str = typer.Argument(..., help="Registered name or path to a recipe folder."),
               env: Optional[List[str]] = typer.Option(None, "--env", metavar="KEY=VALUE",
                                                       help="A default for this node's environment (the node's own "
                                                            "setting wins); repeat for more. How a recipe sets its "
                                                            "own values, e.g. --env HCCL_BUFFSIZE=512."),
               dry_run: bool = typer.Option(False, "--dry-run", help="Print this node's environment defaults and "
                                                                      "commands; start nothing.")) -> None:
        from ..recipe import find_recipe

        node = NodeSpec.from_env(os.environ)
        recipe_dir = find_recipe(recipe).resolve()
        extra_env = parse_env_args(env or [])
        node_env = cluster.node_environment(os.environ, extra_env)
        cmds = node_commands(node, recipe_dir, list(ctx.args), ray=_ray_executable(required=not dry_run))
        say = lambda s: console.print(s, markup=False, highlight=False, soft_wrap=True)  # noqa: E731
        if dry_run:
            from ..inputs import command_problems

            added = {k: v for k, v in node_env.items() if os.environ.get(k) != v}
            say(f"node {node.node_rank} of {node.nnodes}{' (head)' if node.head else ''}; environment set:")
            for k in sorted(added):
                say(f"  {k}={added[k]}")
            say("commands:")
            missing: list[str] = []
            for argv in (cmds.ray_start, cmds.run, cmds.stop):
                if argv:
                    say(f"  {shlex.join(argv)}")
                    found = [m for m in command_problems(argv) if m not in missing]
                    for m in found:
                        say(f"    missing: {m}")
                    missing += found
            if missing:  # the commands above would fail on these: say so now, not on the cluster
                die(f"--dry-run: the commands above name {len(missing)} path(s) that are not there:\n  - "
                    + "\n  - ".join(missing))
            return
        os.environ.update(node_env)
        cluster.token_auth_like_ray_start()  # `ray start`'s own rule; the commands below inherit the mode

        def wait() -> None:
            import ray

            cluster.connect(node.address)
            try:
                want = node.nnodes * node.npus_per_node
                cluster.wait_for_nodes(node.nnodes, node.npus_per_node, RESOURCE, node.join_timeout_s,
                                       report=lambda f: say(f"[launch] {f.nodes}/{node.nnodes} nodes, "
                                                            f"{f.total_devices}/{want} {RESOURCE}s joined"))
            finally:
                ray.shutdown()

        code = launch_node(node, cmds, wait=wait, replace=_exec, say=say)
        if code:
            raise typer.Exit(code)
