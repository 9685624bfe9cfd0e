"""A full disk said as one: no space left on the device, the path being written and the space left.

Libraries report a full disk in their own words: ``OSError`` ENOSPC (``No space left on device``),
EDQUOT, or, from ``torch.save``'s zip writer after a short write, ``RuntimeError: [enforce fail at
inline_container.cc:...] . unexpected pos 704 vs 598`` (wrapped by DCP in a ``CheckpointException``
that carries each rank's error). :func:`no_space` recognises all of them; :func:`no_space_message`
names the path, what was being written and the file system's free space.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

#: errno values that mean the file system (or the user's quota on it) is full
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: how a full disk reads once a library has re-raised it (torch's zip writer: a short write)
_TEXTS = ("No space left on device", "Disk quota exceeded", "unexpected pos ")


def no_space(e: BaseException) -> bool:
    """``e``, or an exception it carries (cause, context, a DCP rank's failure), is a full disk."""
    stack, seen = [e], set()
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in NO_SPACE_ERRNOS:
            return True
        if any(t in str(x) for t in _TEXTS):
            return True
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            stack += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
    return False


def free_space(path: str | os.PathLike) -> str:
    """``"12.0 KiB free of 64.0 KiB"`` for the file system that holds ``path`` (or its nearest
    existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        u = shutil.disk_usage(p)
    except OSError:
        return "its free space could not be read"
    return f"{_size(u.free)} free of {_size(u.total)}"


def no_space_message(path: str | os.PathLike, what: str) -> str:
    """One line: the path, what was being written, the free space, and what to do."""
    return (f"{path}: no space left on the device while writing {what} ({free_space(path)} on that file "
            "system); free space there, or give the run a folder on a larger disk")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
