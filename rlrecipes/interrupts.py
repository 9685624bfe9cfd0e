"""Ctrl-C for the length of a command: one clean exit 130, whatever moment it comes at.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be: in
Ray's shutdown, a ``finally`` that stops the workers, or an atexit callback, where it is printed as
a traceback and ignored (the process then exits 0). :func:`guard` installs a handler instead:

* the first Ctrl-C raises :class:`KeyboardInterrupt` as usual, unless the code is in a
  :func:`deferred` block (the run's clean-up and summary), where it is only recorded;
* later ones are recorded (the clean-up the first one started is not cut short);
* one that comes after the command returned, while the interpreter shuts down, ends the process
  with 130 at once; after one was seen, SIGINT is ignored from then on (Python's finalisation
  would otherwise restore the default, and a late press would kill the process by the signal).

:func:`pending` says whether one came; the caller then exits 130 (the driver raises
:class:`RunInterrupted` with the message, the CLI prints it)."""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

MESSAGE = "interrupted"


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C, with the one line to show for it (e.g. the ``--resume`` command)."""

    def __init__(self, message: str = MESSAGE):
        super().__init__(message)
        self.message = message


class _State:
    installed = False
    finished = False
    count = 0  # Ctrl-C presses seen
    raised = False
    defer = 0  # depth of deferred() blocks


_state = _State()
#: set by the process's entry point (cli.main): the process ends with the command, so the handler
#: stays for the interpreter's shutdown; elsewhere (a command invoked in-process) it is put back
PROCESS_EXIT = False


def _handler(signum, frame) -> None:
    s = _state
    s.count += 1
    if s.finished:  # the command returned: atexit callbacks run now; never let them turn it into exit 0
        if s.count == 1:
            try:
                sys.stdout.flush()
                sys.stderr.write(f"{MESSAGE}\n")
                sys.stderr.flush()
            finally:
                os._exit(130)
        return
    if s.raised or s.defer:
        return
    s.raised = True
    raise KeyboardInterrupt


def pending() -> bool:
    """Whether Ctrl-C was pressed since :func:`guard` began (False without a guard)."""
    return _state.installed and _state.count > 0


@contextmanager
def deferred() -> Iterator[None]:
    """Ctrl-C inside is recorded (see :func:`pending`), not raised: for clean-up that must finish."""
    _state.defer += 1
    try:
        yield
    finally:
        _state.defer -= 1


@contextmanager
def guard() -> Iterator[None]:
    """Install the handler for a command's length (main thread only, and not where SIGINT is ignored).
    A Ctrl-C that was only recorded raises :class:`RunInterrupted` when the block ends without
    another error. In the CLI's process (:data:`PROCESS_EXIT`) the handler stays installed after the
    block, for the interpreter's shutdown."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):  # started with Ctrl-C ignored (nohup, &): keep it so
        yield
        return
    global _state
    _state = _State()
    _state.installed = True
    previous = signal.signal(signal.SIGINT, _handler)
    try:
        yield
        if _state.count and not _state.raised:
            _state.raised = True
            raise RunInterrupted()
    finally:
        _state.finished = True
        if not PROCESS_EXIT:
            signal.signal(signal.SIGINT, previous)
            _state.installed = False
        elif _state.count:  # the exit is decided (130, or the error's): Ctrl-C now must not kill the process with
            # SIGINT (-2): Python's finalisation puts Ctrl-C's default back for any handler but SIG_IGN
            signal.signal(signal.SIGINT, signal.SIG_IGN)
