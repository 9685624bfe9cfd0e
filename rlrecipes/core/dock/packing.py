"""Columns as flat numpy arrays (one per column and warehouse call), and the column store a warehouse holds."""
from __future__ import annotations

import functools
import itertools
import math
import warnings

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .errors import DockError


# ----------------------------------------------------------------------------------------------
# Packing tensors for transport and storage: one flat numpy array per (column, call).
# ----------------------------------------------------------------------------------------------

_NUMPY_FREE = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu").contiguous()
    if t.dtype in _NUMPY_FREE:
        t = t.view(_NUMPY_FREE[t.dtype])
    return t.numpy()


def _from_numpy(a: np.ndarray, dtype_name: str, copy: bool) -> torch.Tensor:
    dtype = getattr(torch, dtype_name)
    if copy:
        a = a.copy()
    with warnings.catch_warnings():  # object-store arrays are read-only; see module docstring
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(dtype) if t.dtype != dtype else t


@dataclass
class Packed:
    """Rows of one column: ``flat`` holds them back to back; row i has shape ``shapes[i]``. Never
    changed once made (``offsets`` is computed once): a new Packed for other rows."""

    flat: np.ndarray            # [sum of row numels]
    shapes: list[tuple]         # per row
    dtype: str                  # torch dtype name
    stacked: bool               # put as one stacked tensor [rows, *shape] (else a list)

    @functools.cached_property
    def offsets(self) -> np.ndarray:
        """``[rows + 1]`` start of each row in ``flat``."""
        sizes = np.fromiter((math.prod(s) for s in self.shapes), np.int64, len(self.shapes))
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)


# On the wire a Packed pickles as ``(buffer, numpy dtype, shapes, dtype, stacked)`` (``to_wire``):
# buffers up to WIRE_BYTES_MAX as bytes inside the pickle, larger ones as arrays, which a channel
# sends out of band (pickle protocol 5) and the receiver's array wraps in the frame it arrived in.

WIRE_BYTES_MAX = 1 << 16


def to_wire(p: Packed) -> tuple:
    """``p`` as ``(buffer, numpy dtype, shapes, dtype, stacked)``; equal row shapes travel once, as
    ``(rows, shape)``. A small array that wraps a whole bytes object (one received, or made by
    :func:`detached`) sends that object, without another copy."""
    flat = p.flat
    if flat.nbytes > WIRE_BYTES_MAX:
        buf = flat
    elif isinstance(flat.base, bytes) and len(flat.base) == flat.nbytes:
        buf = flat.base
    else:
        buf = flat.tobytes()
    n = len(p.shapes)
    first = p.shapes[0] if n else ()
    shapes = (n, first) if p.shapes.count(first) == n else p.shapes
    return (buf, flat.dtype.str, shapes, p.dtype, p.stacked)


def from_wire(w: tuple) -> Packed:
    return _from_wire(*w)


def _from_wire(buf, np_dtype: str, shapes, dtype: str, stacked: bool) -> Packed:
    flat = np.frombuffer(buf, np.dtype(np_dtype)) if isinstance(buf, bytes) else buf
    if isinstance(shapes, tuple):
        shapes = [tuple(shapes[1])] * shapes[0]
    return Packed(flat, shapes, dtype, stacked)


Packed.__reduce__ = lambda self: (_from_wire, to_wire(self))


def detached(p: Packed) -> Packed:
    """``p`` as it travels: a small buffer copied now (bytes), a large one still the caller's array
    (a channel copies it as it sends). A put's rows so no longer depend on the caller's tensors
    once it returns, except large ones until the call that carries them is sent."""
    flat = p.flat
    if flat.nbytes > WIRE_BYTES_MAX or (isinstance(flat.base, bytes) and len(flat.base) == flat.nbytes):
        return p
    return Packed(np.frombuffer(flat.tobytes(), flat.dtype), p.shapes, p.dtype, p.stacked)


def positions_by(keys: Sequence[int]) -> dict[int, list[int]]:
    """The positions of each key (a warehouse per row): ``{key: [positions]}``, in order."""
    out: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        out.setdefault(int(k), []).append(i)
    return out


def pack_column(name: str, value: Any, n_rows: int, own: bool = False) -> Packed:
    """``own``: copy a stacked tensor so later in-place writes by the caller cannot reach the dock
    (list columns are concatenated, which copies anyway)."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != n_rows:
            raise DockError(f"put column {name!r}: stacked tensor of shape {tuple(value.shape)} "
                            f"must have its first dim equal to the number of rows ({n_rows})")
        row_shape = tuple(value.shape[1:])
        flat = _to_numpy(value).reshape(-1)
        return Packed(flat.copy() if own else flat, [row_shape] * n_rows, _dtype_name(value.dtype), True)
    if isinstance(value, (list, tuple)):
        if len(value) != n_rows:
            raise DockError(f"put column {name!r}: {len(value)} tensors for {n_rows} rows")
        if n_rows == 0:
            return Packed(np.zeros(0, np.float32), [], "float32", False)
        dtypes = {t.dtype for t in value if isinstance(t, torch.Tensor)}
        if len(dtypes) != 1 or not all(isinstance(t, torch.Tensor) for t in value):
            raise DockError(f"put column {name!r}: a list column needs tensors of one dtype, got "
                            f"{sorted(str(d) for d in dtypes) or [type(v).__name__ for v in value[:3]]}")
        dtype = dtypes.pop()
        flat = _to_numpy(torch.cat([t.reshape(-1) for t in value])) if value else np.zeros(0)
        return Packed(flat, [tuple(t.shape) for t in value], _dtype_name(dtype), False)
    raise DockError(f"put column {name!r}: expected a tensor [rows, ...] or a list of tensors, "
                    f"got {type(value).__name__}")


def slice_packed(p: Packed, idx: Sequence[int]) -> Packed:
    """The rows ``idx`` (positions in ``p``) as a new Packed: a view of ``p`` for one run of
    consecutive positions, else one gather copy."""
    n = len(p.shapes)
    if len(idx) == n and list(idx) == list(range(n)):
        return p
    if not len(idx):
        return Packed(p.flat[:0], [], p.dtype, p.stacked)
    pos = np.asarray(idx, np.int64)
    off = p.offsets
    if pos[-1] - pos[0] == pos.size - 1 and (pos.size == 1 or (np.diff(pos) == 1).all()):
        return Packed(p.flat[off[pos[0]]:off[pos[-1] + 1]], p.shapes[pos[0]:pos[-1] + 1], p.dtype, p.stacked)  # a view
    if p.stacked and len(set(p.shapes)) == 1:   # equal rows: one fancy-index gather
        flat = p.flat.reshape(n, -1)[pos].reshape(-1)
    else:  # runs of consecutive positions are one slice each
        cut = np.flatnonzero(np.diff(pos) != 1) + 1
        flat = np.concatenate([p.flat[off[run[0]]:off[run[-1] + 1]] for run in np.split(pos, cut)])
    return Packed(flat, [p.shapes[i] for i in pos.tolist()], p.dtype, p.stacked)


def concat_packed(parts: Sequence[Packed]) -> Packed:
    if len(parts) == 1:
        return parts[0]
    flat = np.concatenate([p.flat for p in parts]) if parts else np.zeros(0)
    return Packed(flat, [s for p in parts for s in p.shapes], parts[0].dtype,
                  all(p.stacked for p in parts))


def unpack(p: Packed, copy: bool) -> torch.Tensor | list[torch.Tensor]:
    t = _from_numpy(p.flat, p.dtype, copy)  # [sum of numels]
    if p.stacked and len(set(p.shapes)) <= 1:
        shape = p.shapes[0] if p.shapes else ()
        return t.reshape(len(p.shapes), *shape)  # [rows, *row_shape]
    # one C++ split into views (a Python slice per row costs several times more)
    rows = torch.split(t, np.diff(p.offsets).tolist())
    if all(len(s) == 1 for s in p.shapes):
        return list(rows)
    return [r.view(s) for r, s in zip(rows, p.shapes)]


class _ColumnStore:
    """Tensors of some rows, by column: appended chunks plus a (column, row) -> position index.

    Used by the local backend and by every warehouse. Not thread-safe on its own.
    """

    def __init__(self):
        self.chunks: dict[str, list[Packed]] = {}
        self.index: dict[str, dict[int, tuple[int, int]]] = {}   # col -> row -> (chunk, position)
        self.live_bytes = 0

    def clear(self):
        self.__init__()

    def write(self, col: str, rows: Sequence[int], p: Packed) -> list:
        """Store ``p`` (one row per entry of ``rows``); returns what :meth:`undo` needs."""
        chunks = self.chunks.setdefault(col, [])
        idx = self.index.setdefault(col, {})
        chunks.append(p)
        c = len(chunks) - 1
        before = [(col, int(r), idx.get(int(r)), (c, j)) for j, r in enumerate(rows)]
        for _, r, _, at in before:
            idx[r] = at
        self.live_bytes += p.nbytes
        return before

    def undo(self, before: list) -> None:
        """Point the rows of a rejected write back at what they held before it -- only rows that
        still point at it: a write stored meanwhile (a warehouse runs calls on several threads, so a
        writer's earlier put can be stored after its later, rejected one) keeps its rows."""
        for col, r, old, at in reversed(before):
            idx = self.index[col]
            if idx.get(r) != at:
                continue
            if old is None:
                idx.pop(r, None)
            else:
                idx[r] = old

    def read(self, col: str, rows: Sequence[int]) -> Packed:
        idx = self.index.get(col, {})
        missing = [r for r in rows if r not in idx]
        if missing:
            raise DockError(f"column {col!r} has no data for rows {missing[:8]}"
                            f"{' ...' if len(missing) > 8 else ''} in this store")
        # consecutive reads from the same chunk are one slice (a view for a run of its positions)
        parts = [slice_packed(self.chunks[col][c], [j for _, j in run])
                 for c, run in itertools.groupby((idx[r] for r in rows), key=lambda at: at[0])]
        if not parts:
            return Packed(np.zeros(0, np.float32), [], "float32", True)
        return concat_packed(parts)

    def drop(self, rows: Sequence[int]):
        for idx in self.index.values():
            for r in rows:
                idx.pop(int(r), None)
        # Free chunks no row points to any more.
        for col, idx in self.index.items():
            used = {c for c, _ in idx.values()}
            for c, p in enumerate(self.chunks[col]):
                if c not in used and p.flat.size:
                    self.live_bytes -= p.nbytes
                    self.chunks[col][c] = Packed(p.flat[:0], [], p.dtype, p.stacked)

    def stats(self) -> dict:
        return {"bytes": int(self.live_bytes), "columns": {c: len(i) for c, i in self.index.items()}}
