"""A sandboxed child's output: read both pipes without blocking, keep a bounded prefix of each, and
kill the whole process group (and any process still holding the pipes) at the deadline."""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from typing import Callable, Protocol


class Limits(Protocol):
    """What the reader needs of a ``SandboxConfig``."""

    max_output_bytes: int
    timeout_s: float
    kill_output_bytes: int


class _Stream:
    """Keeps the first ``keep`` bytes of a pipe and counts the rest."""

    def __init__(self, keep: int):
        self.keep = keep
        self.data = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.data)
        if room > 0:
            self.data += chunk[:room]


class WorkFolderWatch:
    """Measures a work folder on the host's disk (rlimits only, where no size-limited tmpfs holds
    it): true, with :attr:`problem` set, once it holds more than ``max_mb`` MiB of blocks or more
    than ``max_files`` entries, or has a folder that cannot be listed. Symlinks are not followed
    (a link counts as one entry, its target as nothing). Each measure stops at ``max_files``
    entries, so a folder of many tiny files costs a bounded walk."""

    def __init__(self, folder: str, max_mb: int, max_files: int):
        self.folder, self.max_mb, self.max_bytes, self.max_files = folder, max_mb, max_mb << 20, max_files
        self.problem: str | None = None

    def __call__(self) -> bool:
        used, entries, todo = 0, 0, [self.folder]
        while todo:
            d = todo.pop()
            try:
                with os.scandir(d) as it:
                    for e in it:
                        entries += 1
                        if entries > self.max_files:
                            self.problem = (f"the work folder holds more than {self.max_files} files and folders "
                                            "(the limit, SandboxConfig.max_work_files)")
                            return True
                        st = e.stat(follow_symlinks=False)
                        used += st.st_blocks * 512
                        if e.is_dir(follow_symlinks=False):
                            todo.append(e.path)
            except FileNotFoundError:
                continue  # removed meanwhile
            except OSError as err:
                self.problem = f"a folder in the work folder cannot be measured ({err.strerror}: {d})"
                return True
            if used > self.max_bytes:
                self.problem = (f"the work folder grew past {self.max_mb} MiB (the limit, SandboxConfig.work_mb)")
                return True
        return False


WATCH_EVERY_S = 0.05  # how often a work folder is measured while the code runs


def _collect(proc: subprocess.Popen, config: Limits, t0: float, watch: Callable[[], bool] | None = None):
    """Read both pipes until they close or the deadline passes. The process group is killed at the
    deadline, on an output flood, when ``watch()`` says so (checked every ``WATCH_EVERY_S``; the
    reason is ``"work_folder"``), and once the main process has exited (children it left behind);
    a process that still holds a pipe after that (it left the group with ``setsid``) is found
    through ``/proc`` and killed too."""
    streams = {proc.stdout.fileno(): _Stream(config.max_output_bytes),
               proc.stderr.fileno(): _Stream(config.max_output_bytes)}
    pipes = {os.fstat(fd).st_ino for fd in streams}
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = t0 + config.timeout_s
    timed_out, killed, drain_until, swept, next_watch = False, None, None, False, t0
    try:
        while sel.get_map():
            now = time.monotonic()
            if drain_until is None:
                if now >= deadline:
                    timed_out, killed = True, "timeout"
                elif watch is not None and killed is None and now >= next_watch:
                    next_watch = now + WATCH_EVERY_S
                    if watch():
                        killed = "work_folder"
                if killed or _exited(proc):
                    _kill_group(proc)
                    drain_until = now + 0.2
            elif now >= drain_until:
                if swept:
                    break
                _kill_pipe_holders(pipes)
                swept, drain_until = True, now + 0.2
            limit = (drain_until if drain_until is not None else deadline) - now
            for key, _ in sel.select(timeout=max(0.0, min(limit, 0.05))):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                streams[key.fd].add(chunk)
            if killed is None and sum(s.total for s in streams.values()) > config.kill_output_bytes:
                killed = "output"
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # it closed its pipes and went on running
        timed_out, killed = True, killed or "timeout"
        _kill_group(proc)
        proc.wait()
    out, err = streams.values()
    return out, err, timed_out, killed


def _kill_pipe_holders(pipes: set[int]) -> None:
    """SIGKILL every process (that we may signal) holding the write end of one of the pipes
    ``pipes`` (inodes). Only the sandboxed code holds write ends; a process the trainer forks
    meanwhile inherits read ends only, and is left alone."""
    names = {f"pipe:[{ino}]" for ino in pipes}
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in names and _writes(pid, fd):
                    os.kill(int(pid), signal.SIGKILL)
                    break
        except OSError:
            continue


def _kill_environ_holders(marker: bytes, rounds: int = 5) -> int:
    """SIGKILL every process (that we may signal and read) whose initial environment holds the
    entry ``marker`` (rlimits mode: the run's own ``HOME=<work folder>``, unique per run): the
    ones that left the process group *and* closed the pipes, such as a daemon. Repeated while it
    finds some (a process may fork meanwhile). A process that re-``exec``s with another
    environment escapes this; bubblewrap's PID namespace does not have that gap. Returns how many
    were killed."""
    me, killed = os.getpid(), 0
    for _ in range(rounds):
        found = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    entries = f.read().split(b"\0")
                if marker in entries:
                    os.kill(int(pid), signal.SIGKILL)
                    found += 1
            except OSError:
                continue
        killed += found
        if not found:
            break
    return killed


def _writes(pid: str, fd: str) -> bool:
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & (os.O_WRONLY | os.O_RDWR) != 0
    return False


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the main process has exited, without reaping it (its pid keeps naming the group)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the main process's direct children first (under bubblewrap: the code, the init of
    its PID namespace, which runs in a session of its own), then its whole process group. The
    main process is not reaped yet, so its pid still names it and its children."""
    _kill_children(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_children(ppid: int) -> None:
    """SIGKILL every process (that we may signal) whose parent is ``ppid``."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            if int(stat[stat.rindex(")") + 2:].split()[1]) == ppid:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


def _decode(stream: _Stream, keep: int) -> tuple[str, bool]:
    text = bytes(stream.data).decode("utf-8", errors="replace")
    cut = stream.total - len(stream.data)
    if cut > 0:
        return text + f"\n[... output truncated: {cut} more bytes not shown (limit {keep} bytes)]", True
    return text, False
