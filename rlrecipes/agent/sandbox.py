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

By default (``isolation="bwrap"``) the process also runs inside bubblewrap (``bwrap``): every
namespace unshared (network included, so only a private loopback exists), the host root bound
read-only, ``/proc`` and a minimal read-only ``/dev`` of its own, ``/tmp`` and the folders in
``hide_paths`` replaced by empty read-only tmpfs (the interpreter's own locations, wherever they
are, are bound back read-only: :mod:`.bwrap`), a size-limited tmpfs work folder as the cwd and a
size-limited ``/dev/shm`` (the only writable places), a new terminal session, no capabilities,
the code as the namespace's init, and killed when its parent dies. Whether bwrap works is probed
once per configuration with a tiny run; where it does not, the sandbox FAILS CLOSED:
:func:`run_python` runs nothing and returns an error naming the fix (install bubblewrap, or choose ``isolation="rlimits"``). Rlimits only
(``isolation="rlimits"``, the recipe's ``rollout.multi_turn.sandbox: rlimits``) is used only when
chosen in so many words: no network or filesystem isolation, but still the rlimits above and a
work folder whose total size and file count are watched while the code runs (killed past
``work_mb`` / ``max_work_files``).

A failure of the sandboxed code (non-zero exit, a signal, the timeout, ``MemoryError``) is a
:class:`SandboxResult`, never an exception. docs/sandbox.md lists what this does and does not
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

from .bwrap import BWRAP_ENV, CODE_INSIDE, DROP_INSIDE, bwrap_argv, bwrap_binary, interpreter_paths
from .process import WorkFolderWatch, _collect, _decode, _kill_environ_holders

log = logging.getLogger(__name__)

NOBODY = 65534
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
SANDBOX_KEY = "rollout.multi_turn.sandbox"  # the recipe key that sets SandboxConfig.isolation


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
    """The work folder's total size in MiB. Under bubblewrap the work folder and ``/dev/shm`` are
    two tmpfs of this size (the only writable places); rlimits only: the work folder (on the
    host's disk) is measured every 50 ms while the code runs and once after, and the call is
    killed past it (docs/sandbox.md: what this does not cover)."""
    max_work_files: int = 4096
    """rlimits only: the most files and folders the work folder may hold (the call is killed past it)."""
    isolation: str = "bwrap"
    """``"bwrap"``: bubblewrap + rlimits, required: without a working bubblewrap nothing runs and
    the result's error says how to fix it (fail closed). ``"rlimits"``: rlimits only, chosen
    explicitly (the network and the host's filesystem are NOT isolated: docs/sandbox.md)."""
    bwrap_path: str | None = None
    """The bubblewrap binary; None: ``$RLRECIPES_BWRAP`` if set, else ``bwrap`` on ``PATH``."""
    python: str = sys.executable
    """The interpreter that runs the code (``-I -X utf8``: isolated mode, UTF-8 streams)."""
    hide_paths: tuple[str, ...] = ("/home", "/root", "/run", "/var/tmp", "/mnt", "/media", "/srv")
    """Folders that bubblewrap replaces by an empty tmpfs (those that exist), as it does ``/tmp``.
    The interpreter's own locations there (its symlinks, prefixes, site-packages, ``sys.path``:
    :func:`.bwrap.interpreter_paths`) are bound back read-only."""
    drop_root: bool = True
    """When running as root, run the code as ``nobody`` if that user can run the interpreter."""

    def __post_init__(self):
        if self.isolation not in ("bwrap", "rlimits"):
            raise ValueError(f"SandboxConfig.isolation must be 'bwrap' or 'rlimits'; got {self.isolation!r}")
        for name in ("timeout_s", "memory_mb", "max_processes", "max_file_mb", "max_open_files",
                     "max_output_bytes", "kill_output_bytes", "work_mb", "max_work_files"):
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
    """``"bwrap"`` (bubblewrap + rlimits), ``"rlimits"`` (rlimits only, chosen: network not
    isolated) or ``"none"`` (the configured isolation cannot run here: nothing runs, see
    :meth:`refusal`)."""
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
    isolation: str = "bwrap"
    """The configuration's :attr:`SandboxConfig.isolation` this mode was probed for."""

    def refusal(self) -> str:
        """Why nothing runs (``kind == "none"``) and the two fixes, naming the recipe key."""
        why = "; ".join(self.notes) or "no sandbox could run Python here"
        if self.isolation == "rlimits":
            return f"the python tool's sandbox cannot run here (rlimits only: {why})"
        return (f"the python tool's sandbox needs bubblewrap, which does not work here ({why}). Install it "
                f"(apt-get install bubblewrap; it must be able to create namespaces), or accept rlimits only "
                f"(NO network or filesystem isolation, docs/sandbox.md) in so many words: set "
                f"{SANDBOX_KEY}=rlimits (SandboxConfig(isolation='rlimits'))")

    def describe(self) -> str:
        if self.kind == "none":
            return "NONE, the python tool refuses to run: " + self.refusal()
        who = f"as uid {self.uid}" if self.uid is not None else f"as uid {os.geteuid()}"
        if self.uid is not None and self.drop == "inside":
            who += " (dropped inside the sandbox)"
        elif self.uid is not None and self.drop == "caps":
            who += " (keeping CAP_DAC_READ_SEARCH: may read any file)"
        base = (f"bubblewrap ({self.bwrap_path}) + rlimits, {who}" if self.kind == "bwrap"
                else f"rlimits only, as chosen ({SANDBOX_KEY}=rlimits): network NOT isolated, filesystem NOT "
                f"isolated, {who}")
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
    """``"timeout"``, ``"output"`` (flooded past ``kill_output_bytes``), ``"work_folder"``
    (rlimits only: the work folder grew past ``work_mb`` or ``max_work_files``) or None."""
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


def sandbox_mode(config: SandboxConfig | None = None) -> SandboxMode:
    """The isolation ``config`` gets here: bubblewrap (required unless ``isolation="rlimits"``)
    and whether root drops to ``nobody``; kind ``"none"`` when that cannot run. Probed with a tiny
    run the first time, then cached (by the bubblewrap binary in use, too)."""
    config = config or SandboxConfig()
    key = (config.isolation, bwrap_binary(config), config.python, config.drop_root, config.hide_paths)
    with _MODES_LOCK:
        if key not in _MODES:
            _MODES[key] = _probe(config, key[1])
            mode = _MODES[key]
            if mode.kind != "bwrap" or mode.notes:
                _warn_once(f"python sandbox: {mode.describe()}")
        return _MODES[key]


def _probe(config: SandboxConfig, path: str | None) -> SandboxMode:
    """Try the configured isolation (bubblewrap, or rlimits only), as ``nobody`` (when root: every
    way of dropping, see :attr:`SandboxMode.drop`) then as ourselves, with the default limits; the
    first that runs the interpreter (and sees its own ``sys.prefix``) wins."""
    notes: list[str] = []
    kind = config.isolation
    if kind == "bwrap" and path is None:
        where = config.bwrap_path or os.environ.get(BWRAP_ENV)
        notes.append(f"bwrap {where!r} is not an executable file" if where else "bwrap is not installed (not on PATH)")
        return SandboxMode("none", None, None, tuple(notes), isolation=kind)
    root = os.geteuid() == 0 and config.drop_root
    want_prefix = interpreter_paths(config.python)[0]
    probe_cfg = SandboxConfig(isolation=kind, bwrap_path=path, python=config.python, hide_paths=config.hide_paths)
    nobody_failed = None
    drops = (["preexec", "inside"] if kind == "bwrap" else ["preexec", "caps"]) if root else []
    for uid, drop in [(NOBODY, d) for d in drops] + [(None, "preexec")]:
        mode = SandboxMode(kind, uid, path if kind == "bwrap" else None, drop=drop, isolation=kind)
        r = _run_code("import sys; print(sys.prefix)", probe_cfg, mode)
        if r.exit_code == 0 and (want_prefix is None or r.stdout.strip() == want_prefix):
            if nobody_failed and uid is None:
                notes.append(f"root could not run the code as nobody ({nobody_failed}): RLIMIT_NPROC is not "
                             "enforced for root, so a fork bomb is stopped only by the wall-clock timeout")
            return SandboxMode(kind, uid, mode.bwrap_path, tuple(notes), drop, isolation=kind)
        why = (r.stderr.strip().splitlines() or [r.error or "no output"])[-1][:200]
        if r.exit_code == 0:
            why = f"{config.python} does not find its own prefix {want_prefix} as that user"
        if uid == NOBODY:
            nobody_failed = nobody_failed or why
        else:
            notes.append(f"{kind} probe failed: {why}")
    return SandboxMode("none", None, None, tuple(notes), isolation=kind)


# --------------------------------------------------------------------------------------------
# running


def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` as a script in a fresh sandboxed interpreter; never raises for what the code does."""
    config = config or SandboxConfig()
    mode = sandbox_mode(config)
    if mode.kind == "none":  # fail closed: nothing runs
        return SandboxResult("", "", None, False, False, "none", error=mode.refusal(), notes=mode.notes)
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
            argv = bwrap_argv(mode, config, code_dir)
            if mode.uid is not None and mode.drop == "inside":  # drop to uid, then exec the code (same pid)
                argv += [config.python, "-I", "-S", "-c", DROP_INSIDE, str(mode.uid)]
            argv += [config.python, "-I", "-X", "utf8", f"{CODE_INSIDE}/main.py"]
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
    # rlimits only: no size-limited tmpfs, so the work folder is measured while the code runs, and after
    watch = WorkFolderWatch(cwd, config.work_mb, config.max_work_files) if mode.kind == "rlimits" else None
    out, err, timed_out, killed = _collect(proc, config, t0, watch)
    if mode.kind == "rlimits":  # what left the group and closed the pipes (a daemon) still has the run's HOME
        _kill_environ_holders(f"HOME={env['HOME']}".encode())
        if killed is None and watch():
            killed = "work_folder"
    code = proc.returncode
    if mode.kind == "bwrap" and code is not None and code > 128 and not timed_out:
        code = -(code - 128)  # bwrap reports a signal death of its child as 128 + signal
    stdout, cut_out = _decode(out, config.max_output_bytes)
    stderr, cut_err = _decode(err, config.max_output_bytes)
    result = SandboxResult(stdout, stderr, code, timed_out, cut_out or cut_err, mode.kind,
                           duration_s=time.monotonic() - t0, killed_reason=killed, notes=mode.notes)
    result.error = f"killed: {watch.problem}" if killed == "work_folder" else _summary(result, config)
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
