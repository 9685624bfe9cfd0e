"""Sliced reads of an HF folder's safetensors files: each rank reads only the box it owns.

A safetensors file is an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, byte range) and the raw row-major tensor bytes. :class:`SafetensorsFolder` indexes every
``*.safetensors`` file of a folder and reads a *box* (one ``(start, stop)`` per dimension) of a
tensor with positioned reads of the rows the box spans, in chunks of at most ``chunk_bytes``,
so a read never holds more than the box plus one chunk. It does not memory-map the files: mapped
pages of a 60 GB checkpoint would count against every rank's resident memory.

:meth:`SafetensorsFolder.read_param` reads by *model* parameter name (transformers v5 in-memory
names). It maps fused experts (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
onto the per-expert keys of published checkpoints (``mlp.experts.<e>.gate_proj.weight`` ...) and
a tied ``lm_head.weight`` onto the embedding, and converts to the caller's dtype.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .files import FIX_WEIGHTS, FileLoadError, reading
from .sharding import checkpoint_items, fused_expert_key, vl_checkpoint_name

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

Box = Sequence[tuple[int, int]]
"""One ``(start, stop)`` per dimension, in the tensor's global coordinates."""


class CheckpointError(ValueError):
    """A checkpoint lacks a tensor the model needs, or holds it with another shape."""


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's first element in the file


def full_box(shape: Sequence[int]) -> list[tuple[int, int]]:
    return [(0, int(n)) for n in shape]


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _read_header(f: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and its length, after checking the file holds every
    byte the header describes: a truncated or foreign file is named here, before any tensor is read."""
    what = "safetensors weight file"
    size = f.stat().st_size
    with reading(f, what, FIX_WEIGHTS), open(f, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise FileLoadError(f, what, f"truncated: {size} bytes, not even the 8-byte header length", FIX_WEIGHTS)
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise FileLoadError(f, what, f"its header says {n} bytes of header, the file has {size} bytes: truncated, "
                                "or not a safetensors file", FIX_WEIGHTS)
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise FileLoadError(f, what, f"unreadable header ({e})", FIX_WEIGHTS) from None
    if not isinstance(header, dict):
        raise FileLoadError(f, what, "the header is not a JSON object", FIX_WEIGHTS)
    try:
        end = max((int(m["data_offsets"][1]) for k, m in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise FileLoadError(f, what, f"a header entry has no valid data_offsets ({e})", FIX_WEIGHTS) from None
    if 8 + n + end > size:
        raise FileLoadError(f, what, f"truncated: the header's tensors end at byte {8 + n + end}, the file has "
                            f"{size} bytes", FIX_WEIGHTS)
    return header, n


class SafetensorsFolder:
    """Index of every ``*.safetensors`` file in ``folder``; reads boxes of tensors by key."""

    def __init__(self, folder: str | os.PathLike, *, chunk_bytes: int = 64 << 20):
        self.folder = Path(folder)
        self.chunk_bytes = int(chunk_bytes)
        self.entries: dict[str, _Entry] = {}
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.folder}: no *.safetensors weights")
        for f in files:
            header, n = _read_header(f)
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if meta["dtype"] not in _DTYPES:
                    raise CheckpointError(f"{f}: {key}: dtype {meta['dtype']} is not supported")
                self.entries[key] = _Entry(f, _DTYPES[meta["dtype"]], tuple(meta["shape"]),
                                           8 + n + int(meta["data_offsets"][0]))

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def _entry(self, key: str) -> _Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise CheckpointError(f"{self.folder}: no tensor {key!r} in the checkpoint") from None

    def read(self, key: str, box: Box | None = None, dtype: torch.dtype | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The box of tensor ``key`` (whole tensor when ``box`` is None): into ``out`` (any device and
        dtype, the box's shape) or a new CPU tensor. Rows are converted chunk by chunk straight into
        the destination, so no second copy of the box is ever made."""
        e = self._entry(key)
        box = full_box(e.shape) if box is None else [(int(a), int(b)) for a, b in box]
        if len(box) != len(e.shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, e.shape)):
            raise CheckpointError(f"{self.folder}: {key}: box {box} outside the stored shape {e.shape}")
        if out is None:
            out = torch.empty(box_shape(box), dtype=dtype or e.dtype)
        elif tuple(out.shape) != box_shape(box):
            raise CheckpointError(f"{self.folder}: {key}: box {box} does not match the destination {tuple(out.shape)}")
        if out.numel() == 0:
            return out
        if not e.shape:  # a scalar
            out.copy_(self._pread(e, 0, e.dtype.itemsize).view(e.dtype).reshape(()))
            return out
        row = math.prod(e.shape[1:]) * e.dtype.itemsize  # bytes of one dim-0 slice
        step = max(1, self.chunk_bytes // max(row, 1))
        (r0, r1), rest = box[0], [slice(a, b) for a, b in box[1:]]
        with open(e.file, "rb", buffering=0) as fh:
            for s in range(r0, r1, step):
                t = min(r1, s + step)
                raw = self._pread(e, s * row, (t - s) * row, fh)
                rows = raw.view(e.dtype).reshape(t - s, *e.shape[1:])
                out[s - r0:t - r0].copy_(rows[(slice(None), *rest)])
        return out

    @staticmethod
    def _pread(e: _Entry, start: int, size: int, fh=None) -> torch.Tensor:
        buf = bytearray(size)
        own = fh is None
        fh = open(e.file, "rb", buffering=0) if own else fh
        try:
            fh.seek(e.offset + start)
            view, got = memoryview(buf), 0
            while got < size:
                n = fh.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"{e.file}: truncated (wanted {size} bytes at {e.offset + start})")
                got += n
        finally:
            if own:
                fh.close()
        return torch.frombuffer(buf, dtype=torch.uint8)

    # ------------------------------------------------------------------ model names
    def read_param(self, name: str, shape: Sequence[int], box: Box | None = None, *,
                   dtype: torch.dtype | None = None, tied_to: str | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Box of the model parameter ``name`` (global shape ``shape``) from the checkpoint.

        A fused expert tensor is assembled from the per-expert keys when the file stores those;
        ``tied_to`` names the tensor to read when ``name`` itself is absent (a tied LM head).
        """
        shape = tuple(int(n) for n in shape)
        box = full_box(shape) if box is None else [(int(a), int(b)) for a, b in box]
        if name not in self.entries and vl_checkpoint_name(name) in self.entries:
            name = vl_checkpoint_name(name)  # a Qwen2.5-VL checkpoint's on-disk name
        if name not in self.entries:
            if tied_to is not None and tied_to in self.entries:
                name = tied_to
            else:
                parts = self._expert_parts(name, shape)
                if parts is not None:
                    return self._read_experts(name, box, parts, dtype, out)
        stored = self.shape(name)
        if stored != shape:
            raise CheckpointError(f"{self.folder}: {name}: checkpoint shape {stored}, the model expects {shape} "
                                  "(does config.json match the weights?)")
        return self.read(name, box, dtype, out=out)

    def _expert_parts(self, name: str, shape: tuple[int, ...]) -> list[list[tuple[str, tuple[int, ...]]]] | None:
        """Per expert ``e``: the checkpoint keys (and shapes) whose rows, stacked, make ``name[e]``."""
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or leaf not in ("gate_up_proj", "down_proj") or len(shape) != 3:
            return None
        parts: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(shape[0])]
        for key, piece in checkpoint_items(name, torch.empty(shape, device="meta")):
            parts[fused_expert_key(key)[1]].append((key, tuple(piece.shape)))
        return parts

    def _read_experts(self, name: str, box: Box, parts, dtype, out=None) -> torch.Tensor:
        (e0, e1), (r0, r1), (c0, c1) = box
        if out is None:
            out = torch.empty(box_shape(box), dtype=dtype or torch.float32)
        for e in range(e0, e1):
            base = 0
            for key, want in parts[e]:
                if key not in self.entries:
                    raise CheckpointError(f"{self.folder}: no tensor {name!r} and no per-expert {key!r}: the "
                                          "checkpoint does not hold this model's experts")
                if self.shape(key) != want:
                    raise CheckpointError(f"{self.folder}: {key}: checkpoint shape {self.shape(key)}, the model "
                                          f"expects {want}")
                a, b = max(r0, base), min(r1, base + want[0])
                if a < b:
                    self.read(key, [(a - base, b - base), (c0, c1)], out=out[e - e0, a - r0:b - r0])
                base += want[0]
        return out


__all__ = ["Box", "CheckpointError", "SafetensorsFolder", "box_shape", "full_box"]
