"""Bubblewrap for the ``python`` tool's sandbox: which binary, the interpreter's real locations,
and the ``bwrap`` command line. The sandbox itself (limits, running, mode selection) is
:mod:`.sandbox`; docs/sandbox.md says what each option isolates.

The bubblewrap options used (bubblewrap 0.8.0, ``bwrap --help`` / bwrap(1)): ``--unshare-all``
(or, when root drops to ``nobody`` inside, ``--unshare-ipc --unshare-pid --unshare-net
--unshare-uts --unshare-cgroup-try`` without a user namespace), ``--die-with-parent``,
``--new-session``, ``--as-pid-1``, ``--cap-drop ALL`` (``--cap-add CAP_SETUID/CAP_SETGID`` for
the drop inside), ``--ro-bind``, ``--dev``, ``--proc``, ``--tmpfs`` with ``--size`` and
``--perms``, ``--dir``, ``--remount-ro``, ``--chdir``, ``--setenv``.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path
# ``SandboxConfig`` / ``SandboxMode`` in the annotations are ``rlrecipes.agent.sandbox``'s, which imports
# this module (not imported back: one direction, no cycle)

BWRAP_ENV = "RLRECIPES_BWRAP"
"""An environment variable naming the bubblewrap binary to use (when ``SandboxConfig.bwrap_path``
is not set): a ``bwrap`` outside ``PATH``, or a path that does not exist to run as if bubblewrap
were not installed (what the refusal tests do)."""
WORK_INSIDE = "/tmp/work"  # the work folder's path inside bubblewrap
CODE_INSIDE = "/tmp/code"  # the folder holding the code's main.py, inside bubblewrap


def bwrap_binary(config: "SandboxConfig") -> str | None:
    """The bubblewrap binary ``config`` uses: ``bwrap_path``, else ``$RLRECIPES_BWRAP``, else
    ``bwrap`` on ``PATH``; None when that is not an executable file."""
    path = config.bwrap_path or os.environ.get(BWRAP_ENV) or shutil.which("bwrap")
    return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


_QUERY = ("import json, site, sys\n"
          "paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path]\n"
          "try:\n    paths += site.getsitepackages()\nexcept AttributeError:\n    pass\n"
          "print(json.dumps({'prefix': sys.prefix, 'paths': paths}))")


@functools.lru_cache(maxsize=None)
def interpreter_paths(python: str) -> tuple[str | None, tuple[str, ...]]:
    """``(sys.prefix, locations)`` of the interpreter ``python`` as the sandbox runs it (``-I``):
    every folder and file it reads at start-up and import time, wherever they are (a venv under
    ``/tmp``, pyenv under ``/root``): each hop of its symlink chain, the folder above each hop's
    ``bin``, its prefixes, site-packages and ``sys.path`` entries (``.pth`` files included). Asked
    of the interpreter itself, once; the prefix is None when it cannot be run."""
    found: list[str] = []
    hop = os.path.abspath(python)
    for _ in range(40):  # the symlink chain: python -> python3 -> /root/.pyenv/.../python3.11
        found += [os.path.dirname(hop), os.path.dirname(os.path.dirname(hop))]
        if not os.path.islink(hop):
            break
        hop = os.path.join(os.path.dirname(hop), os.readlink(hop))
    prefix = None
    try:
        p = subprocess.run([python, "-I", "-c", _QUERY], capture_output=True, timeout=60, env={}, text=True)
        if p.returncode == 0:
            got = json.loads(p.stdout.strip().splitlines()[-1])
            prefix, found = got["prefix"], found + [x for x in got["paths"] if x]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError):
        pass
    out = {os.path.normpath(x) for x in found if os.path.isabs(x) and os.path.exists(x)}
    return prefix, tuple(sorted(out - {"/"}))


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def bind_back(config: "SandboxConfig", hidden: list[str]) -> list[str]:
    """The interpreter's locations under a folder that bubblewrap hides (``/tmp`` or one of
    ``hidden``), outermost only (a bind covers what is under it), to bind back read-only. The
    sandbox's own folders inside (the work folder, the code) are never shadowed."""
    paths = [p for p in interpreter_paths(config.python)[1]
             if any(_under(p, h) for h in hidden) and not any(_under(p, o) or _under(o, p)
                                                             for o in (WORK_INSIDE, CODE_INSIDE))]
    return [p for p in paths if not any(o != p and _under(p, o) for o in paths)]


def bwrap_argv(mode: "SandboxMode", config: "SandboxConfig", code_dir: str) -> list[str]:
    """Everything read-only except two tmpfs of ``work_mb`` each: the work folder and ``/dev/shm``."""
    size = str(config.work_mb << 20)
    # --as-pid-1: the code is the namespace's init, a child of bwrap, so nothing is left as an orphan
    # zombie for the host's init to reap (zombies of nobody count toward its RLIMIT_NPROC); when it
    # exits or is killed, the kernel kills every process left in the namespace
    inside = mode.uid is not None and mode.drop == "inside"
    # inside: bwrap runs as root without a user namespace (in one, only root is mapped and the code
    # could not become nobody); it keeps only CAP_SETUID/SETGID for the drop before the code starts
    unshare = (["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
               if inside else ["--unshare-all"])
    caps = ["--cap-drop", "ALL"] + (["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if inside else [])
    argv = [mode.bwrap_path or "bwrap", *unshare, "--die-with-parent", "--new-session", "--as-pid-1", *caps,
            "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    hidden = [h for h in config.hide_paths if os.path.isdir(h) and h not in ("/", "/tmp")]
    for h in hidden:
        argv += ["--tmpfs", h]
    made: set[str] = set()
    for p in bind_back(config, ["/tmp", *hidden]):
        top = next(h for h in ["/tmp", *hidden] if _under(p, h))
        if inside and p != top:  # bwrap (root) would create the folders between the tmpfs and p as 0700
            for parent in reversed(Path(p).relative_to(top).parents[:-1]):
                d = os.path.join(top, str(parent))
                if d not in made:
                    made.add(d)
                    argv += ["--perms", "0755", "--dir", d]
        argv += ["--ro-bind", p, p]
    perms = ["--perms", "01777"] if inside else []
    argv += ["--ro-bind", code_dir, CODE_INSIDE, *perms, "--size", size, "--tmpfs", WORK_INSIDE,
             *perms, "--size", size, "--tmpfs", "/dev/shm"]
    for ro in ["/dev", "/tmp", *hidden]:
        argv += ["--remount-ro", ro]
    return argv + ["--chdir", WORK_INSIDE, "--setenv", "HOME", WORK_INSIDE]


DROP_INSIDE = ("import ctypes, os, sys\nu = int(sys.argv[1])\nos.setgroups([])\nos.setgid(u)\nos.setuid(u)\n"
               "if ctypes.CDLL(None).prctl(1, 9, 0, 0, 0) != 0:\n    sys.exit('prctl(PR_SET_PDEATHSIG) failed')\n"
               "os.execv(sys.argv[2], sys.argv[2:])")
"""Run by the interpreter (``-I -S``) as root inside bubblewrap (``drop="inside"``): become ``uid``
(which clears every capability, and the kernel's parent-death signal of ``--die-with-parent``,
hence set again: ``PR_SET_PDEATHSIG``, ``SIGKILL``) and exec the code in the same process. The
host also kills bwrap's children before bwrap at the timeout (``process._kill_group``)."""
