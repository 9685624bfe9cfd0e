"""Sandboxed execution of untrusted Python (the ``python`` tool).

Every run is a separate process with, in every case:

- rlimits set in the child before ``exec`` (``preexec_fn``): address space (``memory_mb``), CPU
  seconds, number of processes, size of a written file, open files, no core dumps;
- a wall-clock timeout after which the whole process tree is killed (its own session and process
  group, ``SIGKILL`` to the group; under bubblewrap the PID namespace dies with it);
- an empty environment: only ``PATH`` and a ``HOME`` inside the private work folder;
- stdin closed (``/dev/null``), stdout and stderr captured and truncated to ``max_output_bytes``
  each, with a marker that says how many bytes were cut; a run that floods its output past
  ``kill_output_bytes`` is killed;
- root drops to ``nobody`` (uid 65534) when that user can run the interpreter, because the kernel
  does not apply ``RLIMIT_NPROC`` to root.

Where bubblewrap (``bwrap``) is installed and can create namespaces, the process also runs inside
it: every namespace unshared (network included, so only a private loopback exists), the host root
bound read-only, ``/proc`` and a minimal read-only ``/dev`` of its own, ``/tmp`` and the folders in
``hide_paths`` replaced by empty read-only tmpfs (the interpreter's own folders are bound back
read-only), a size-limited tmpfs work folder as the cwd and a size-limited ``/dev/shm`` (the only
writable places), a new terminal session, no capabilities, the code as the namespace's init, and
killed when its parent dies. Whether bwrap works is probed once per configuration with a tiny
run; where it does not, the sandbox falls back to rlimits only, warns once that the network is
not isolated, and says so in :attr:`SandboxResult.sandbox`.

A failure of the sandboxed code (non-zero exit, a signal, the timeout, ``MemoryError``) is a
:class:`SandboxResult`, never an exception. docs/agent.md lists what this does and does not
protect against.
"""
from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .process import _collect, _decode, _kill_environ_holders

log = logging.getLogger(__name__)

NOBODY = 65534
WORK_INSIDE = "/tmp/work"  # the work folder's path inside bubblewrap
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class SandboxConfig:
    """How one sandboxed run is isolated and limited. Every field has a safe default."""

    timeout_s: float = 10.0
    """Wall-clock limit in seconds; at the limit the whole process tree is killed."""
    cpu_s: int | None = None
    """``RLIMIT_CPU`` in seconds (``SIGXCPU``, ``SIGKILL`` a second later); None: ``int(timeout_s) + 2``."""
    memory_mb: int = 512
    """``RLIMIT_AS``: the address space of each process, in MiB (an allocation past it raises
    ``MemoryError`` in Python)."""
    max_processes: int = 32
    """``RLIMIT_NPROC``: processes and threads. The kernel counts every process and thread of
    the sandbox's user on the machine (concurrent sandboxes share it) and does not apply it to
    root, hence ``drop_root``."""
    max_file_mb: int = 16
    """``RLIMIT_FSIZE``: the largest file the code may write, in MiB."""
    max_open_files: int = 64
    """``RLIMIT_NOFILE``."""
    max_output_bytes: int = 16384
    """Bytes kept of stdout and of stderr (each); the rest is cut and counted in a marker."""
    kill_output_bytes: int = 8 << 20
    """A run whose stdout + stderr exceed this many bytes is killed (output flood)."""
    work_mb: int = 64
    """Under bubblewrap, the size of the work folder and of ``/dev/shm`` (two tmpfs, the only
    writable places); not enforced in rlimits-only mode."""
    bwrap: str | bool = "auto"
    """``"auto"``: bubblewrap where it is installed and works, else rlimits only; True: require
    it (an error result when it cannot run); False: rlimits only; a path: that ``bwrap`` binary."""
    python: str = sys.executable
    """The interpreter that runs the code (``-I -X utf8``: isolated mode, UTF-8 streams)."""
    hide_paths: tuple[str, ...] = ("/home", "/root", "/run", "/var/tmp", "/mnt", "/media", "/srv")
    """Folders that bubblewrap replaces by an empty tmpfs (those that exist). The interpreter's
    own folders (``sys.prefix``, ``sys.base_prefix``, site-packages) are bound back read-only."""
    drop_root: bool = True
    """When running as root, run the code as ``nobody`` if that user can run the interpreter."""

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_processes", "max_file_mb", "max_open_files",
                     "max_output_bytes", "kill_output_bytes", "work_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0; got {getattr(self, name)!r}")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise ValueError(f"SandboxConfig.cpu_s must be > 0 or None; got {self.cpu_s!r}")

    @property
    def cpu_limit_s(self) -> int:
        return self.cpu_s if self.cpu_s is not None else int(self.timeout_s) + 2


@dataclass(frozen=True)
class SandboxMode:
    """Which isolation a configuration gets on this machine (probed once; ``plan`` can show it)."""

    kind: str
    """``"bwrap"`` (bubblewrap + rlimits) or ``"rlimits"`` (rlimits only: network not isolated)."""
    uid: int | None
    """The uid the code runs as when root drops privileges (``NOBODY``), else None (unchanged)."""
    bwrap_path: str | None
    notes: tuple[str, ...] = ()
    """Why bubblewrap or the privilege drop is not used, for the warning and for ``plan``."""
    drop: str = "preexec"
    """How root drops to ``uid``: ``"preexec"`` (before ``exec``: bubblewrap itself runs as that
    user, in a user namespace), ``"inside"`` (bubblewrap runs as root without a user namespace,
    binds the interpreter's folders, and the code drops to ``uid`` inside, before it starts) or
    ``"caps"`` (rlimits only: before ``exec``, keeping only ``CAP_DAC_READ_SEARCH`` so that the
    user can read an interpreter under a private folder such as ``/root``). Only with ``uid``."""

    def describe(self) -> str:
        who = f"as uid {self.uid}" if self.uid is not None else f"as uid {os.geteuid()}"
        if self.uid is not None and self.drop == "inside":
            who += " (dropped inside the sandbox)"
        elif self.uid is not None and self.drop == "caps":
            who += " (keeping CAP_DAC_READ_SEARCH: may read any file)"
        base = (f"bubblewrap ({self.bwrap_path}) + rlimits, {who}" if self.kind == "bwrap"
                else f"rlimits only (network NOT isolated), {who}")
        return base + "".join(f"; {n}" for n in self.notes)


@dataclass
class SandboxResult:
    """What one sandboxed run did. ``exit_code`` is the process's (negative: killed by that signal)."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    """stdout or stderr was cut to ``max_output_bytes`` (the text ends with a marker)."""
    sandbox: str
    """``"bwrap"`` or ``"rlimits"`` (the isolation that was used), ``"none"`` if nothing ran."""
    duration_s: float = 0.0
    killed_reason: str | None = None
    """``"timeout"``, ``"output"`` (flooded past ``kill_output_bytes``) or None."""
    error: str | None = None
    """A one-line summary of the failure (None when the code exited 0)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.killed_reason is None

    @property
    def memory_error(self) -> bool:
        return "MemoryError" in self.stderr

    def observation(self) -> str:
        """The text a model sees: stdout, then stderr and the failure summary when there are any.
        When the output was truncated the summary comes first instead, so that a consumer that
        cuts the text further (the registry's ``max_observation_chars``) still shows why it failed."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        if self.error:
            if self.truncated:
                parts.insert(0, f"[error] {self.error}")
            else:
                parts.append(f"[error] {self.error}")
        return "\n".join(parts) if parts else "(no output)"


# --------------------------------------------------------------------------------------------
# mode selection (probed once per configuration)

_MODES: dict[tuple, SandboxMode] = {}
_MODES_LOCK = threading.Lock()
_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        log.warning(msg)


def _bwrap_binary(setting: str | bool) -> str | None:
    if setting is False:
        return None
    if isinstance(setting, str) and setting != "auto":
        return setting if os.access(setting, os.X_OK) else None
    return shutil.which("bwrap")


def sandbox_mode(config: SandboxConfig | None = None) -> SandboxMode:
    """The isolation ``config`` gets here: bubblewrap if installed and working, and whether root
    drops to ``nobody``. Probed with a tiny run the first time, then cached."""
    config = config or SandboxConfig()
    key = (config.bwrap, config.python, config.drop_root, config.hide_paths)
    with _MODES_LOCK:
        if key not in _MODES:
            _MODES[key] = _probe(config)
            mode = _MODES[key]
            if mode.kind != "bwrap":
                _warn_once(f"python sandbox: {mode.describe()}. Install bubblewrap "
                           "(apt-get install -y bubblewrap) to isolate the network and the filesystem.")
            elif mode.notes:
                _warn_once(f"python sandbox: {mode.describe()}")
        return _MODES[key]


def _probe(config: SandboxConfig) -> SandboxMode:
    """Try bubblewrap then rlimits only, each as ``nobody`` (when root: every way of dropping, see
    :attr:`SandboxMode.drop`) then as ourselves, with the default limits; the first that runs the
    interpreter (and sees its ``sys.prefix``) wins."""
    notes: list[str] = []
    path = _bwrap_binary(config.bwrap)
    if config.bwrap is not False and path is None:
        notes.append("bwrap not found" if config.bwrap in ("auto", True) else f"bwrap {config.bwrap!r} not executable")
    root = os.geteuid() == 0 and config.drop_root
    want_prefix = sys.prefix if config.python == sys.executable else None
    probe_cfg = SandboxConfig(bwrap=config.bwrap, python=config.python, hide_paths=config.hide_paths)
    kinds = (["bwrap"] if path else []) + ([] if config.bwrap is True else ["rlimits"])
    for kind in kinds:
        nobody_failed = None
        drops = (["preexec", "inside"] if kind == "bwrap" else ["preexec", "caps"]) if root else []
        for uid, drop in [(NOBODY, d) for d in drops] + [(None, "preexec")]:
            mode = SandboxMode(kind, uid, path if kind == "bwrap" else None, drop=drop)
            r = _run_code("import sys; print(sys.prefix)", probe_cfg, mode)
            if r.exit_code == 0 and (want_prefix is None or r.stdout.strip() == want_prefix):
                if nobody_failed and uid is None:
                    notes.append(f"root could not run the code as nobody ({nobody_failed}): RLIMIT_NPROC is not "
                                 "enforced for root, so a fork bomb is stopped only by the wall-clock timeout")
                return SandboxMode(kind, uid, mode.bwrap_path, tuple(notes), drop)
            why = (r.stderr.strip().splitlines() or [r.error or "no output"])[-1][:200]
            if r.exit_code == 0:
                why = f"{config.python} does not find its own prefix {want_prefix} as that user"
            if uid == NOBODY:
                nobody_failed = nobody_failed or why
            else:
                notes.append(f"{kind} probe failed: {why}")
    return SandboxMode("none", None, None, tuple(notes) + ("no sandbox could run Python here",))


# --------------------------------------------------------------------------------------------
# running


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` as a script in a fresh sandboxed interpreter; never raises for what the code does."""
    config = config or SandboxConfig()
    mode = sandbox_mode(config)
    if mode.kind == "none":
        return SandboxResult("", "", None, False, False, "none",
                             error="the sandbox cannot run here: " + "; ".join(mode.notes), notes=mode.notes)
    return _run_code(code, config, mode)


def _limits(config: SandboxConfig) -> list[tuple[int, tuple[int, int]]]:
    cpu = config.cpu_limit_s
    return [
        (resource.RLIMIT_AS, (config.memory_mb << 20,) * 2),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at the soft limit, SIGKILL a second later
        (resource.RLIMIT_NPROC, (config.max_processes,) * 2),
        (resource.RLIMIT_FSIZE, (config.max_file_mb << 20,) * 2),
        (resource.RLIMIT_NOFILE, (config.max_open_files,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]


_PR_SET_KEEPCAPS, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 8, 38, 47, 2
_CAP_DAC_READ_SEARCH = 2
_CAPABILITY_VERSION_3 = 0x20080522


def _keep_read_caps():
    """A function (for the child, after fork) that keeps only ``CAP_DAC_READ_SEARCH`` across the
    uid drop and ``exec`` (``prctl`` keep-caps, ``capset``, an ambient capability), and sets
    no-new-privileges. Every ctypes object is made here, beforehand."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    bit = 1 << _CAP_DAC_READ_SEARCH
    data = (ctypes.c_uint32 * 6)(bit, bit, bit, 0, 0, 0)  # {effective, permitted, inheritable} x 2
    prctl, capset, ulong = libc.prctl, libc.capset, ctypes.c_ulong

    def before_setuid():
        if prctl(_PR_SET_KEEPCAPS, ulong(1), ulong(0), ulong(0), ulong(0)) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS) failed")

    def after_setuid():
        if capset(header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset(CAP_DAC_READ_SEARCH) failed")
        if prctl(_PR_CAP_AMBIENT, ulong(_PR_CAP_AMBIENT_RAISE), ulong(_CAP_DAC_READ_SEARCH), ulong(0), ulong(0)) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAP_AMBIENT_RAISE) failed")
        if prctl(_PR_SET_NO_NEW_PRIVS, ulong(1), ulong(0), ulong(0), ulong(0)) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")

    return before_setuid, after_setuid


def _preexec(limits: list[tuple[int, tuple[int, int]]], uid: int | None, keep_read: bool = False):
    """The function the child runs between fork and exec. Built beforehand so that it only calls
    the setuid family, ``prctl``/``capset`` (``keep_read``), ``getrlimit`` and ``setrlimit`` (no
    imports, no locks: the pool calls this from threads). A limit above the inherited hard limit
    is lowered to it (only root may raise)."""
    getrlimit, setrlimit, infinity = resource.getrlimit, resource.setrlimit, resource.RLIM_INFINITY
    before, after = _keep_read_caps() if keep_read and uid is not None else (None, None)

    def fn():
        if uid is not None:
            if before is not None:
                before()
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            if after is not None:
                after()
        for which, (soft, hard) in limits:
            cur_hard = getrlimit(which)[1]
            if cur_hard != infinity:
                hard = min(hard, cur_hard)
            setrlimit(which, (min(soft, hard), hard))

    return fn


def _visible_prefixes(config: SandboxConfig) -> list[str]:
    """Folders the interpreter needs, to bind back read-only under a hidden folder: this
    interpreter's prefixes and site-packages, or for another one the folder above its ``bin``."""
    import site

    out = {str(Path(config.python).parent.parent), str(Path(os.path.realpath(config.python)).parent.parent)}
    if config.python == sys.executable:
        out |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages()}
    return sorted(p for p in out if p and os.path.isdir(p))


def _bwrap_argv(mode: SandboxMode, config: SandboxConfig, code_dir: str) -> list[str]:
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
    for p in _visible_prefixes(config):
        under = [h for h in hidden if p == h or p.startswith(h.rstrip("/") + "/")]
        if under:
            if inside:  # bwrap (root) would create the folders between the tmpfs and p as 0700
                for parent in reversed(Path(p).relative_to(under[0]).parents[:-1] if p != under[0] else []):
                    d = os.path.join(under[0], str(parent))
                    if d not in made:
                        made.add(d)
                        argv += ["--perms", "0755", "--dir", d]
            argv += ["--ro-bind", p, p]
    perms = ["--perms", "01777"] if inside else []
    argv += ["--ro-bind", code_dir, "/tmp/code", *perms, "--size", size, "--tmpfs", WORK_INSIDE,
             *perms, "--size", size, "--tmpfs", "/dev/shm"]
    for ro in ["/dev", "/tmp", *hidden]:
        argv += ["--remount-ro", ro]
    return argv + ["--chdir", WORK_INSIDE, "--setenv", "HOME", WORK_INSIDE]


_DROP_INSIDE = ("import ctypes, os, sys\nu = int(sys.argv[1])\nos.setgroups([])\nos.setgid(u)\nos.setuid(u)\n"
                "if ctypes.CDLL(None).prctl(1, 9, 0, 0, 0) != 0:\n    sys.exit('prctl(PR_SET_PDEATHSIG) failed')\n"
                "os.execv(sys.argv[2], sys.argv[2:])")
"""Run by the interpreter (``-I -S``) as root inside bubblewrap (``drop="inside"``): become ``uid``
(which clears every capability, and the kernel's parent-death signal of ``--die-with-parent``,
hence set again: ``PR_SET_PDEATHSIG``, ``SIGKILL``) and exec the code in the same process. The
host also kills bwrap's children before bwrap at the timeout (``process._kill_group``)."""


def _run_code(code: str, config: SandboxConfig, mode: SandboxMode) -> SandboxResult:
    tmp = tempfile.mkdtemp(prefix="rlrecipes-sandbox-")
    try:
        code_dir = os.path.join(tmp, "code")
        work = os.path.join(tmp, "work")
        os.mkdir(code_dir)
        os.mkdir(work, 0o700)
        Path(code_dir, "main.py").write_text(code, encoding="utf-8")
        os.chmod(tmp, 0o755)
        os.chmod(code_dir, 0o755)
        os.chmod(os.path.join(code_dir, "main.py"), 0o644)
        if mode.uid is not None:
            os.chown(work, mode.uid, mode.uid)
        if mode.kind == "bwrap":
            argv = _bwrap_argv(mode, config, code_dir)
            if mode.uid is not None and mode.drop == "inside":  # drop to uid, then exec the code (same pid)
                argv += [config.python, "-I", "-S", "-c", _DROP_INSIDE, str(mode.uid)]
            argv += [config.python, "-I", "-X", "utf8", "/tmp/code/main.py"]
            env = {"PATH": SANDBOX_PATH}
            cwd = "/"
        else:
            argv = [config.python, "-I", "-X", "utf8", os.path.join(code_dir, "main.py")]
            env = {"PATH": SANDBOX_PATH, "HOME": work}
            cwd = work
        return _execute(argv, env, cwd, config, mode)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _execute(argv: list[str], env: dict[str, str], cwd: str, config: SandboxConfig,
             mode: SandboxMode) -> SandboxResult:
    t0 = time.monotonic()
    # the uid drop happens before exec, so under bubblewrap bwrap itself runs as nobody (in an
    # unprivileged user namespace): root inside a user namespace would still be exempt from NPROC
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, cwd=cwd, start_new_session=True, close_fds=True,
                                restore_signals=True,
                                preexec_fn=_preexec(_limits(config), mode.uid if mode.drop != "inside" else None,
                                                    keep_read=mode.drop == "caps"))
    except (OSError, subprocess.SubprocessError) as e:
        return SandboxResult("", "", None, False, False, mode.kind, error=f"could not start the sandbox: {e}")
    out, err, timed_out, killed = _collect(proc, config, t0)
    if mode.kind == "rlimits":  # what left the group and closed the pipes (a daemon) still has the run's HOME
        _kill_environ_holders(f"HOME={env['HOME']}".encode())
    code = proc.returncode
    if mode.kind == "bwrap" and code is not None and code > 128 and not timed_out:
        code = -(code - 128)  # bwrap reports a signal death of its child as 128 + signal
    stdout, cut_out = _decode(out, config.max_output_bytes)
    stderr, cut_err = _decode(err, config.max_output_bytes)
    result = SandboxResult(stdout, stderr, code, timed_out, cut_out or cut_err, mode.kind,
                           duration_s=time.monotonic() - t0, killed_reason=killed, notes=mode.notes)
    result.error = _summary(result, config)
    return result


_SIGNAL_REASONS = {
    signal.SIGXCPU: "CPU time limit ({cpu} s) reached",
    # under bubblewrap the code is its namespace's init, which ignores SIGXCPU: the hard limit's SIGKILL ends it
    signal.SIGKILL: "killed: the CPU time limit ({cpu} s), or the machine ran out of memory",
    signal.SIGXFSZ: "file size limit ({fsize} MiB) exceeded",
    signal.SIGSEGV: "segmentation fault",
}


def _summary(r: SandboxResult, config: SandboxConfig) -> str | None:
    if r.killed_reason == "timeout":
        return f"timed out after {config.timeout_s:g} s; the process was killed"
    if r.killed_reason == "output":
        return f"killed: the output exceeded {config.kill_output_bytes} bytes"
    if r.exit_code == 0:
        return None
    if r.exit_code is None:
        return "the process did not report an exit status"
    if r.exit_code < 0:
        sig = -r.exit_code
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        reason = _SIGNAL_REASONS.get(sig, "killed by a signal")
        return reason.format(cpu=config.cpu_limit_s, fsize=config.max_file_mb) + f" ({name})"
    if r.memory_error:
        return f"MemoryError: the memory limit is {config.memory_mb} MiB (exit code {r.exit_code})"
    last = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip() and not ln.startswith("[...")), "")
    return f"exit code {r.exit_code}" + (f": {last.strip()[:300]}" if last else "")
