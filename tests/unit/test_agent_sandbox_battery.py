"""Hostile snippets through the real ``python`` tool (ToolRegistry + ToolExecutor, as the rollout calls
it): each is contained and comes back as an error observation, and the run (this test process)
goes on. Parametrised over the two modes: bubblewrap (skipped where it cannot create namespaces)
and rlimits only (``isolation="rlimits"``, which a user must choose: the default refuses to run
without bubblewrap), whose documented gaps (no network and no filesystem isolation: the host's
``/tmp``, ``/dev/shm`` and ``/var/tmp`` are writable) are asserted as such, and what rlimits can
close (file size, processes, the work folder's total) is asserted closed. docs/sandbox.md tables
what each snippet gives.
"""
from __future__ import annotations

import os
import resource
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import pytest

from rlrecipes.agent import SandboxConfig, ToolCall, ToolExecutor, ToolRegistry, ToolResult, sandbox_mode

TIMEOUT_S = 3.0  # per call: the snippets that hang are killed at this wall-clock limit
SLACK_S = 6.0  # start-up, kill and reap on a loaded 2-core machine
RLIMITS = SandboxConfig(isolation="rlimits")
BWRAP = SandboxConfig(isolation="bwrap")
TAG = uuid.uuid4().hex[:12]
SECRET_NAME, SECRET_VALUE = "RLRECIPES_BATTERY_API_KEY", f"sk-battery-{TAG}"
HOME = os.path.expanduser("~")
HOST_FILES = {  # what the escape snippets try to create on the host
    "home": os.path.join(HOME, f"rlrecipes-battery-{TAG}"),
    "tmp": f"/tmp/rlrecipes-battery-{TAG}",
    "home_sh": os.path.join(HOME, f"rlrecipes-battery-sh-{TAG}"),
    "tmp_sh": f"/tmp/rlrecipes-battery-sh-{TAG}",
    "shm": f"/dev/shm/rlrecipes-battery-{TAG}",
    "var_tmp": f"/var/tmp/rlrecipes-battery-{TAG}",
}
HOST_DIR = f"/tmp/rlrecipes-battery-dir-{TAG}"  # a run's private folder (0700) that a symlink points at
FILL_MB = 3000  # what the disk-filling snippet tries to write, in 1 MiB files
DAEMON_COMM = f"rlb{TAG}"  # process names (15 characters at most), to look for leftovers on the host
BOMB_COMM, SLEEPER_COMM = f"rlf{TAG}", f"rls{TAG}"
NAME = "import ctypes\nctypes.CDLL(None).prctl(15, {!r}, 0, 0, 0)\n"  # PR_SET_NAME


def _mode_param(cfg: SandboxConfig, kind: str):
    mode = sandbox_mode(cfg)
    marks = [] if mode.kind == kind else [pytest.mark.skip(reason=f"no {kind} sandbox here: {mode.describe()}")]
    return pytest.param(cfg, id=kind, marks=marks)


MODES = [_mode_param(BWRAP, "bwrap"), _mode_param(RLIMITS, "rlimits")]


def _separate_user(cfg: SandboxConfig) -> bool:
    """The code runs as another user than this process (root dropping to nobody)."""
    return sandbox_mode(cfg).uid is not None


def _isolated(cfg: SandboxConfig) -> bool:
    return sandbox_mode(cfg).kind == "bwrap"


# --------------------------------------------------------------------------------------------
# the snippets, each with the check of its result (cfg, result); checks that need the host
# (files, processes) look at it themselves


@dataclass
class Snippet:
    name: str
    code: str
    check: Callable[[SandboxConfig, ToolResult], None]
    needs: Callable[[SandboxConfig], str | None] = lambda cfg: None
    """Why this snippet cannot be contained with ``cfg`` (it is skipped then), or None."""


def _needs_other_user(cfg: SandboxConfig) -> str | None:
    if _separate_user(cfg) or (_isolated(cfg) and os.geteuid() != 0):
        return None
    return ("the code runs as this process's own root user (no uid to drop to): RLIMIT_NPROC is not enforced "
            "and, without bubblewrap, every process of the run can be signalled")


def _needs_nproc(cfg: SandboxConfig) -> str | None:
    if os.geteuid() != 0 or _separate_user(cfg):
        return None
    return "RLIMIT_NPROC is not enforced for root and root cannot drop to nobody here"


def check_network(cfg, r):
    if _isolated(cfg):
        assert not r.ok and "OSError" in r.content and "unreachable" in r.content.lower(), r.content
        assert "CONNECTED" not in r.content
    else:  # documented: the fallback does not isolate the network; it says so instead
        assert "network NOT isolated" in sandbox_mode(cfg).describe()


def check_write_outside(cfg, r):
    lines = r.content.splitlines()
    assert len(lines) >= 2 and all(ln.startswith(("denied", "WROTE")) for ln in lines[:2]), r.content
    if _isolated(cfg) or _separate_user(cfg):
        assert not os.path.exists(HOST_FILES["home"])
    if _isolated(cfg):
        assert lines[:2] == ["denied home Read-only file system", "denied tmp Read-only file system"], lines
        assert not os.path.exists(HOST_FILES["tmp"])
    elif _separate_user(cfg):  # documented: nobody cannot write the home, but the host's /tmp is open to all
        assert lines[0] == "denied home Permission denied", lines
        assert lines[1] == "WROTE tmp" and os.path.exists(HOST_FILES["tmp"])


def check_secret(cfg, r):
    assert SECRET_VALUE not in r.content and SECRET_NAME not in r.content
    env_line = r.content.splitlines()[0]
    assert set(eval(env_line)) <= {"PATH", "HOME", "PWD", "LC_CTYPE"}, env_line
    # the test process's own /proc/<pid>/environ: another pid namespace, or another user
    parent = next(ln for ln in r.content.splitlines() if ln.startswith("run environ"))
    if _isolated(cfg) or _separate_user(cfg):
        assert parent in ("run environ denied No such file or directory", "run environ denied Permission denied"), parent


def check_fork_bomb(cfg, r):
    assert not r.ok and r.error == "timeout" and f"timed out after {TIMEOUT_S:g} s" in r.content, r.content
    assert r.latency_s < TIMEOUT_S + SLACK_S
    assert "forks failed" in r.content  # the process limit stopped it, not only the clock
    _assert_gone(BOMB_COMM)


def check_infinite_loop(cfg, r):
    assert not r.ok and r.error == "timeout" and f"timed out after {TIMEOUT_S:g} s" in r.content
    assert r.latency_s < TIMEOUT_S + SLACK_S


def check_memory(cfg, r):
    assert not r.ok and "MemoryError" in r.content and f"memory limit is {cfg.memory_mb} MiB" in r.content
    assert "ALLOCATED" not in r.content


def check_flood(cfg, r):
    # the reason comes first: the registry cuts the observation to max_observation_chars
    assert not r.ok and r.content.startswith("[error] killed: the output exceeded 8388608 bytes"), r.content[:200]
    assert "truncated" in r.content and len(r.content) < 8192 + 100


def check_kill_parent(cfg, r):
    lines = dict(ln.split(": ", 1) for ln in r.content.splitlines() if ": " in ln)
    assert set(lines) >= {"kill ppid", "killpg ppid", "kill run", "killpg run"}, r.content
    if _isolated(cfg):  # its parent is outside its PID namespace (getppid() is 0): the run's pid means nothing
        assert lines["kill run"] in ("failed No such process", "sent"), lines
    else:
        assert all(v == "failed Operation not permitted" for v in lines.values()), lines
    assert os.getpid() == RUN_PID  # still here


def check_missing_module(cfg, r):
    assert not r.ok and r.error == "tool_error"
    assert "ModuleNotFoundError: No module named 'rlrecipes_battery_no_such_module'" in r.content


def check_os_system(cfg, r):
    assert "codes" in r.content, r.content
    if _isolated(cfg):
        assert not os.path.exists(HOST_FILES["home_sh"]) and not os.path.exists(HOST_FILES["tmp_sh"])
        assert r.content.count("Read-only file system") == 2, r.content
        assert "curl: (7)" in r.content or "curl: not found" in r.content, r.content
    elif _separate_user(cfg):  # documented: the fallback shares the host's filesystem (nobody's rights)
        assert not os.path.exists(HOST_FILES["home_sh"]) and "Permission denied" in r.content


def check_read_secrets(cfg, r):
    lines = dict(ln.split(": ", 1) for ln in r.content.splitlines() if ": " in ln)
    if _isolated(cfg):
        assert lines["ssh"] == "denied No such file or directory", lines  # the home folders are empty tmpfs
        if _separate_user(cfg):
            assert lines["shadow"] == "denied Permission denied", lines
    assert "root:" not in r.content  # the snippet prints sizes, never contents


def check_shared_folders(cfg, r):
    lines = dict(ln.split(": ", 1) for ln in r.content.splitlines() if ": " in ln)
    assert set(lines) == {"tmp", "shm", "var_tmp"}, r.content
    if _isolated(cfg):  # read-only tmpfs; /dev/shm is its own size-limited tmpfs: nothing reaches the host
        assert lines["tmp"] == lines["var_tmp"] == "denied Read-only file system", lines
        assert lines["shm"] == "WROTE", lines
        assert not any(os.path.exists(HOST_FILES[k]) for k in ("tmp", "shm", "var_tmp"))
    else:  # documented gap of rlimits only (chosen explicitly): the host's shared folders are writable
        assert cfg.isolation == "rlimits" and "filesystem NOT isolated" in sandbox_mode(cfg).describe()
        assert all(v == "WROTE" for v in lines.values()), lines
        assert all(os.path.exists(HOST_FILES[k]) for k in ("tmp", "shm", "var_tmp"))


def check_symlink_out(cfg, r):
    lines = dict(ln.split(": ", 1) for ln in r.content.splitlines() if ": " in ln)
    assert r.ok, r.content  # a link to /usr is not measured as the work folder's (the watch does not follow it)
    assert os.path.exists(os.path.join(HOST_DIR, "secret"))  # the cleanup did not follow the link either
    if _isolated(cfg):  # the host's /tmp is an empty tmpfs inside: the link points at nothing
        assert lines["write"] == lines["read"] == "denied No such file or directory", lines
    elif _separate_user(cfg):  # as nobody: the link gives no right the code did not have
        assert lines["write"] == "denied Permission denied", lines
        assert not os.path.exists(os.path.join(HOST_DIR, "pwned"))
        # documented: root dropping to nobody keeps CAP_DAC_READ_SEARCH (it may read any file)
        assert lines["read"] in ("READ", "denied Permission denied"), lines


def check_fill_disk(cfg, r):
    written = [int(x) for x in r.content.split() if x.isdigit()]
    assert not r.ok and written and max(written) < FILL_MB, r.content[-300:]
    if _isolated(cfg):  # the work folder is a tmpfs of work_mb
        assert "No space left on device" in r.content and max(written) < cfg.work_mb, r.content[-300:]
    else:  # rlimits only: measured every 50 ms, the call is killed past work_mb
        assert r.error == "tool_error"
        assert f"the work folder grew past {cfg.work_mb} MiB" in r.content, r.content[-300:]
        assert max(written) < cfg.work_mb + 256, max(written)


def check_huge_file(cfg, r):
    assert not r.ok and "File too large" in r.content and "WROTE" not in r.content


def _assert_gone(comm: str) -> None:
    deadline = time.monotonic() + 3
    while _processes_named(comm) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_named(comm), f"processes named {comm} outlived the call"


def check_daemon(cfg, r):
    assert "daemon started" in r.content, r.content
    _assert_gone(DAEMON_COMM)


def check_close_stdout(cfg, r):
    assert not r.ok and r.error == "timeout" and "timed out" in r.content
    assert r.latency_s < TIMEOUT_S + SLACK_S
    _assert_gone(SLEEPER_COMM)  # it closed its pipes: found as bwrap's child, or by its environment


RUN_PID = os.getpid()

SNIPPETS = [
    Snippet("network", "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('CONNECTED')",
            check_network),
    Snippet("write_outside", f"for name, path in [('home', {HOST_FILES['home']!r}), ('tmp', {HOST_FILES['tmp']!r})]:\n"
            "    try:\n        open(path, 'w').write('pwned')\n        print('WROTE', name)\n"
            "    except OSError as e:\n        print('denied', name, e.strerror)", check_write_outside),
    Snippet("read_env_secret", "import os\nprint(dict(os.environ))\n"
            f"for name, pid in [('parent', os.getppid()), ('run', {RUN_PID})]:\n"
            "    try:\n        data = open(f'/proc/{pid}/environ', 'rb').read()\n"
            "        print(name, 'environ', data.replace(b'\\0', b' ').decode(errors='replace'))\n"
            "    except OSError as e:\n        print(name, 'environ denied', e.strerror)", check_secret),
    Snippet("fork_bomb", NAME.format(BOMB_COMM.encode()) + "import os, sys\nfailed = 0\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        failed += 1\n        if failed == 1000:\n"
            "            print('forks failed', flush=True)", check_fork_bomb, needs=_needs_nproc),
    Snippet("infinite_loop", "while True:\n    pass", check_infinite_loop),
    Snippet("alloc_10gb", "b = bytearray(10 * 1024**3)\nprint('ALLOCATED')", check_memory),
    Snippet("print_100mb", "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)",
            check_flood),
    Snippet("kill_parent", "import os, signal\n"
            "for name, fn in [('kill ppid', lambda: os.kill(os.getppid(), signal.SIGKILL)),\n"
            "                 ('killpg ppid', lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)),\n"
            f"                 ('kill run', lambda: os.kill({RUN_PID}, signal.SIGKILL)),\n"
            f"                 ('killpg run', lambda: os.killpg({os.getpgid(0)}, signal.SIGKILL))]:\n"
            "    try:\n        fn()\n        print(f'{name}: sent')\n"
            "    except OSError as e:\n        print(f'{name}: failed {e.strerror}')",
            check_kill_parent, needs=_needs_other_user),
    Snippet("missing_module", "import rlrecipes_battery_no_such_module", check_missing_module),
    Snippet("os_system", "import os\ncodes = [os.system('curl -sS -m 2 http://1.1.1.1/ -o /dev/null'),\n"
            f"         os.system('echo pwned > {HOST_FILES['home_sh']}'),\n"
            f"         os.system('echo pwned > {HOST_FILES['tmp_sh']}')]\nprint('codes', codes)", check_os_system),
    Snippet("read_secrets", "import os\n"
            f"for name, path in [('shadow', '/etc/shadow'), ('ssh', {os.path.join(HOME, '.ssh')!r})]:\n"
            "    try:\n        n = len(open(path).read()) if os.path.isfile(path) else len(os.listdir(path))\n"
            "        print(f'{name}: READ {n}')\n"
            "    except OSError as e:\n        print(f'{name}: denied {e.strerror}')", check_read_secrets),
    Snippet("shared_folders", f"for name, path in [('tmp', {HOST_FILES['tmp']!r}), ('shm', {HOST_FILES['shm']!r}),\n"
            f"                   ('var_tmp', {HOST_FILES['var_tmp']!r})]:\n"
            "    try:\n        open(path, 'w').write('pwned')\n        print(f'{name}: WROTE')\n"
            "    except OSError as e:\n        print(f'{name}: denied {e.strerror}')", check_shared_folders),
    Snippet("symlink_out", f"import os, time\nos.symlink('/usr', 'usr')\nos.symlink({HOST_DIR!r}, 'host')\n"
            "for name, fn in [('write', lambda: open('host/pwned', 'w').write('x')),\n"
            "                 ('read', lambda: open('host/secret').read())]:\n"
            "    try:\n        fn()\n        print(f'{name}: READ' if name == 'read' else f'{name}: WROTE')\n"
            "    except OSError as e:\n        print(f'{name}: denied {e.strerror}')\ntime.sleep(0.3)",
            check_symlink_out),
    Snippet("fill_disk", f"for i in range({FILL_MB}):\n    with open(f'f{{i}}', 'wb') as f:\n"
            "        f.write(b'x' * (1 << 20))\n    print(i, flush=True)", check_fill_disk),
    Snippet("huge_file", "with open('big', 'wb') as f:\n    for _ in range(64):\n        f.write(b'x' * (1 << 20))\n"
            "print('WROTE')", check_huge_file),
    Snippet("daemon", "import os, time, ctypes\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        ctypes.CDLL(None).prctl(15, {DAEMON_COMM.encode()!r}, 0, 0, 0)\n"
            "        for fd in (0, 1, 2):\n            os.close(fd)\n        while True:\n            time.sleep(0.05)\n"
            "    os._exit(0)\nos.wait()\ntime.sleep(0.3)\nprint('daemon started')", check_daemon,
            needs=_needs_other_user),
    Snippet("close_stdout", NAME.format(SLEEPER_COMM.encode()) + "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", check_close_stdout),
]


def _processes_named(comm: str) -> list[int]:
    """Living (not zombie) processes whose name is ``comm``."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if name == comm and rest[0] != "Z":
            out.append(int(pid))
    return out


@pytest.fixture
def host(monkeypatch):
    """The run's secret in its environment, and no escaped file left behind."""
    monkeypatch.setenv(SECRET_NAME, SECRET_VALUE)
    os.makedirs(HOST_DIR, mode=0o700, exist_ok=True)
    with open(os.path.join(HOST_DIR, "secret"), "w") as f:
        f.write("s3cret")
    yield
    for path in HOST_FILES.values():
        if os.path.exists(path):
            os.remove(path)
    shutil.rmtree(HOST_DIR, ignore_errors=True)


def _registry(cfg: SandboxConfig) -> ToolRegistry:
    return ToolRegistry(["python"], sandbox=cfg, default_timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("cfg", MODES)
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.name for s in SNIPPETS])
def test_snippet_is_contained(cfg, snippet, host):
    why = snippet.needs(cfg)
    if why:
        pytest.skip(f"{snippet.name} cannot be contained in this mode: {why}")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with ToolExecutor(_registry(cfg), max_workers=2) as pool:
        (r,) = pool.run([ToolCall("python", {"code": snippet.code})])
        assert r.name == "python" and r.content  # always an observation
        snippet.check(cfg, r)
        assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
        # the run goes on: the same pool answers a normal call
        assert pool.run([ToolCall("python", {"code": "print(1 + 1)"})])[0].content == "2"
    if snippet.name == "print_100mb":  # the output was not buffered by the run (ru_maxrss: KiB)
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 64 * 1024


@pytest.mark.parametrize("cfg", MODES)
def test_all_snippets_at_once_then_the_run_goes_on(cfg, host):
    snippets = [s for s in SNIPPETS if s.needs(cfg) is None]
    t0 = time.monotonic()
    with ToolExecutor(_registry(cfg), max_workers=len(snippets)) as pool:
        results = pool.run([ToolCall("python", {"code": s.code}) for s in snippets])
        elapsed = time.monotonic() - t0
        after = pool.run([ToolCall("python", {"code": "print(1 + 1)"})])[0]
    assert os.getpid() == RUN_PID and after.ok and after.content == "2", after
    assert elapsed < TIMEOUT_S + 2 * SLACK_S
    assert len(results) == len(snippets)
    by_name = {s.name: r for s, r in zip(snippets, results)}
    for name, r in by_name.items():
        assert r.name == "python" and r.content and SECRET_VALUE not in r.content, (name, r)
        assert len(r.content) <= 8192 + 100, name
    # the calls that must fail whatever ran beside them (a fork bomb may also make a start fail)
    for name in ("infinite_loop", "alloc_10gb", "print_100mb", "missing_module", "huge_file", "close_stdout",
                 "fill_disk"):
        assert not by_name[name].ok, (name, by_name[name])
    if _isolated(cfg):
        assert not by_name["network"].ok and "CONNECTED" not in by_name["network"].content
        assert not any(os.path.exists(p) for p in HOST_FILES.values())
    for comm in (DAEMON_COMM, BOMB_COMM, SLEEPER_COMM):
        _assert_gone(comm)


def test_fallback_says_the_network_is_not_isolated():
    """The documented gap of the rlimits-only mode, made visible: the host's loopback is reachable."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        port = srv.getsockname()[1]
        r = _registry(RLIMITS).run("python", {"code": f"import socket\nsocket.create_connection(('127.0.0.1', {port}),"
                                              " timeout=2)\nprint('CONNECTED')"})
        assert r.ok and r.content == "CONNECTED", r
        assert "network NOT isolated" in sandbox_mode(RLIMITS).describe()
    finally:
        srv.close()
