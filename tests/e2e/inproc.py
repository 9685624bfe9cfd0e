"""`rlrecipes <command>` in this pytest process, under one Ray session shared by the e2e tests.

A smoke run through a subprocess spends most of its time before the first step: the interpreter
and the CLI's imports, then an embedded ``ray.init``. The run itself is the same whichever process
drives it: ``rlrecipes run`` joins a Ray session that is already up (``cluster.connect`` returns
"existing") and removes its own actors and placement group when it ends, leaving the session to
its owner. So the e2e tests drive their runs through the CLI's own typer app here, on a Ray
session started once (``ensure_ray``) with the embedded run's settings. A test that needs its
own interpreter (signals, exit codes of a killed process, environment variables read at import)
keeps its subprocess.

What a subprocess would have printed is kept: the result carries ``returncode``, ``stdout`` and
``stderr``, and an exception that escaped the command is appended to ``stderr`` as the
interpreter's traceback would have been, so ``"Traceback" not in out.stderr`` still means no crash.
"""
from __future__ import annotations

import os
import subprocess
import sys
import traceback


def ensure_ray() -> None:
    """The shared session: the embedded run's settings (``cluster.connect(embedded=True)``).
    Started again if a test shut it down (``test_device_placement`` starts its own cluster)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 1), include_dashboard=False,
                 log_to_driver=True, configure_logging=False, namespace="rlrecipes")


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def rlrecipes(*args: str, extra_env: dict | None = None, timeout: float = 600,
              own_process: bool = False) -> subprocess.CompletedProcess:
    """``rlrecipes *args``: in this process (:func:`invoke`), or in a subprocess when the call needs
    its own process or environment (``own_process``, ``extra_env``: Ray's workers inherit the
    environment Ray started with), or every call with RLRECIPES_E2E_SUBPROCESS=1. ``timeout``
    applies to a subprocess only."""
    if own_process or extra_env or os.environ.get("RLRECIPES_E2E_SUBPROCESS") == "1":
        return subprocess.run([sys.executable, "-m", "rlrecipes", *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(extra_env or {})})
    return invoke(*args)


def invoke(*args: str) -> subprocess.CompletedProcess:
    """``rlrecipes *args`` through the CLI's typer app in this process."""
    from typer.testing import CliRunner

    from rlrecipes.cli import app

    if args and args[0] == "run":
        ensure_ray()
    result = CliRunner().invoke(app, list(args))
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "Traceback (most recent call last):\n" + "".join(
            traceback.format_exception(type(result.exception), result.exception, result.exception.__traceback__)[1:])
    return subprocess.CompletedProcess(["rlrecipes", *args], result.exit_code, result.stdout, stderr)
