"""Images of vision-language prompts: reading them from data rows, and the smoke task's pictures.

A row's images (``data.image_key``, verl's ``images`` column) is a list whose items are any of:

* ``{"bytes": b"...", "path": ...}`` -- the Hugging Face ``datasets`` Image feature, as verl's
  geometry3k Parquet stores it (bytes win over the path when both are set);
* raw encoded bytes (PNG, JPEG, ... or a NumPy ``.npy`` array);
* a path (relative paths are relative to the data file's folder), e.g. in JSONL rows;
* an ``[H, W, 3]`` uint8 array (the smoke task's images, drawn in memory).

:func:`decode_image` turns one item into an ``[H, W, 3]`` uint8 NumPy array. PNG is decoded here
(zlib + the five PNG row filters, 8-bit grey / RGB / RGBA); other formats go through Pillow when it
is installed (it is not a dependency of this package), else the error says to convert the images to
PNG or install Pillow. :func:`encode_png` writes RGB arrays as PNG bytes (tests and tools writing
geometry3k-shaped files).

The smoke task (``data.synthetic: colors``, :func:`vision_smoke_dataset`): a filled square or
disc of one of :data:`COLORS` on a black canvas at a random place and size; the prompt is the same
for every row (``<image>?=``) and the answer is the colour's digit, so only the image answers it.
"""
from __future__ import annotations

import io
import os
import random
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError

IMAGE_MARK = "<image>"
"""Where a prompt's text places an image (verl's convention); images without a mark go first."""

#: the smoke task's colours: answer digit i is COLORS[i]
COLORS = ((230, 40, 40), (40, 200, 60), (50, 80, 240), (235, 220, 40))
SMOKE_IMAGE_SIZE = 56
VISION_SMOKE_PROMPT = f"{IMAGE_MARK}?="


def _png_chunks(data: bytes, where: str):
    pos = 8
    while pos + 8 <= len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        yield kind, data[pos + 8:pos + 8 + n]
        pos += 12 + n
    if pos > len(data):
        raise DataError(f"{where}: truncated PNG (a chunk runs past the end of the bytes)")


def _unfilter(raw: bytes, h: int, stride: int, bpp: int) -> np.ndarray:
    out = np.zeros((h, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.int32)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        if f == 0:
            cur = line
        elif f == 2:
            cur = (line + prev) & 255
        elif f in (1, 3, 4):  # depend on the reconstructed left neighbour: byte by byte
            cur = line.copy()
            for x in range(stride):
                a = int(cur[x - bpp]) if x >= bpp else 0
                b, c = int(prev[x]), (int(prev[x - bpp]) if x >= bpp else 0)
                if f == 1:
                    pred = a
                elif f == 3:
                    pred = (a + b) // 2
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[x] = (cur[x] + pred) & 255
        else:
            raise ValueError(f"unknown PNG filter {f}")
        out[y] = cur
        prev = cur
    return out


def decode_png(data: bytes, where: str = "image") -> np.ndarray:
    """8-bit non-interlaced PNG (grey, grey+alpha, RGB, RGBA) -> ``[H, W, 3]`` uint8."""
    header, idat = None, []
    for kind, body in _png_chunks(data, where):
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body[:13])
        elif kind == b"IDAT":
            idat.append(body)
    if header is None:
        raise DataError(f"{where}: PNG without an IHDR chunk")
    w, h, depth, ctype, _, _, interlace = header
    channels = {0: 1, 2: 3, 4: 2, 6: 4}.get(ctype)
    if depth != 8 or channels is None or interlace:
        raise DataError(f"{where}: PNG with bit depth {depth}, colour type {ctype}, interlace {interlace} is not "
                        "read without Pillow; install Pillow or re-save it as 8-bit RGB PNG")
    try:
        raw = zlib.decompress(b"".join(idat))
    except zlib.error as e:
        raise DataError(f"{where}: damaged PNG data ({e})") from None
    if len(raw) < h * (w * channels + 1):
        raise DataError(f"{where}: truncated PNG ({len(raw)} bytes of pixel data for {w}x{h})")
    px = _unfilter(raw, h, w * channels, channels).reshape(h, w, channels)
    if channels in (1, 2):
        px = np.repeat(px[:, :, :1], 3, axis=2)
    return np.ascontiguousarray(px[:, :, :3])


def encode_png(img: np.ndarray) -> bytes:
    """``[H, W, 3]`` uint8 -> PNG bytes (RGB, no filtering)."""
    img = np.ascontiguousarray(np.asarray(img, dtype=np.uint8))
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"encode_png: expected [H, W, 3] uint8, got shape {img.shape}")
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def _decode_bytes(data: bytes, where: str) -> np.ndarray:
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return decode_png(data, where)
    if data[:6] == b"\x93NUMPY":
        arr = np.load(io.BytesIO(data), allow_pickle=False)
        return _as_rgb(arr, where)
    try:
        from PIL import Image
    except ImportError:
        raise DataError(f"{where}: image bytes that are not PNG (first bytes {data[:4]!r}); install Pillow to read "
                        "other formats, or convert the images to PNG") from None
    try:
        with Image.open(io.BytesIO(data)) as im:
            return np.asarray(im.convert("RGB"))
    except Exception as e:  # noqa: BLE001 - re-raised with the row
        raise DataError(f"{where}: cannot decode the image bytes ({e})") from None


def _as_rgb(arr: np.ndarray, where: str) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4) or min(arr.shape[:2]) < 1:
        raise DataError(f"{where}: an image array must be [height, width, 3]; got shape {list(arr.shape)}")
    if arr.dtype != np.uint8:
        if not np.issubdtype(arr.dtype, np.number) or arr.min() < 0 or arr.max() > 255:
            raise DataError(f"{where}: image values must be 0..255 (uint8); got {arr.dtype}")
        arr = arr.astype(np.uint8)
    return np.ascontiguousarray(arr[:, :, :3])


def decode_image(item: Any, where: str, base: Path | None = None) -> np.ndarray:
    """One image of a row (see the module docstring) -> ``[H, W, 3]`` uint8; errors name ``where``."""
    if isinstance(item, dict):
        if item.get("bytes"):
            return _decode_bytes(bytes(item["bytes"]), where)
        if item.get("path"):
            return decode_image(str(item["path"]), where, base)
        raise DataError(f"{where}: image entry has neither 'bytes' nor 'path' (keys: {', '.join(sorted(item))})")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _decode_bytes(bytes(item), where)
    if isinstance(item, (str, os.PathLike)):
        p = Path(os.path.expanduser(str(item)))
        if not p.is_absolute() and base is not None:
            p = base / p
        if not p.is_file():
            raise DataError(f"{where}: image file {p} does not exist; fix the path (relative paths are relative to "
                            "the data file's folder) or store the image bytes in the row")
        return _decode_bytes(p.read_bytes(), f"{where} ({p})")
    if isinstance(item, np.ndarray):
        return _as_rgb(item, where)
    raise DataError(f"{where}: an image must be bytes, a path, {{'bytes': ..., 'path': ...}} or an array; "
                    f"got {type(item).__name__}")


def row_images(row: dict, key: str, where: str) -> list | None:
    """The raw image items of a row's ``key`` (None when the row has no such field or it is empty)."""
    v = row.get(key)
    if v is None:
        return None
    if isinstance(v, (str, bytes, dict, np.ndarray)):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise DataError(f"{where}: {key!r} must be a list of images (bytes, paths or {{'bytes', 'path'}}); got "
                        f"{type(v).__name__}. Set data.image_key to the images column")
    return list(v) or None


# ----------------------------------------------------------------------------------- the smoke task
def draw_shape(rng: random.Random, color: tuple[int, int, int], size: int = SMOKE_IMAGE_SIZE) -> np.ndarray:
    """A filled square or disc of ``color`` on black, at a random place and size (a quarter to most of
    the canvas: every image token sees some of it)."""
    img = np.zeros((size, size, 3), dtype=np.uint8)
    r = rng.randint(size // 4, size // 2 - 2)
    cy, cx = rng.randint(r, size - r - 1), rng.randint(r, size - r - 1)
    yy, xx = np.mgrid[:size, :size]
    if rng.random() < 0.5:
        mask = (np.abs(yy - cy) <= r) & (np.abs(xx - cx) <= r)
    else:
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    img[mask] = color
    return img


def vision_smoke_dataset(n: int, seed: int = 0, *, classes: int = len(COLORS)) -> list[dict]:
    """``n`` deterministic rows ``{"prompt": "<image>?=", "answer": "<digit>", "images": [array]}``."""
    if not 2 <= classes <= len(COLORS):
        raise ValueError(f"classes must be in [2, {len(COLORS)}]; got {classes}")
    rng = random.Random(f"rlrecipes-vision-smoke-{seed}")
    rows = []
    for _ in range(n):
        k = rng.randrange(classes)
        rows.append({"prompt": VISION_SMOKE_PROMPT, "answer": str(k), "images": [draw_shape(rng, COLORS[k])]})
    return rows


__all__ = ["COLORS", "IMAGE_MARK", "SMOKE_IMAGE_SIZE", "VISION_SMOKE_PROMPT", "decode_image", "decode_png",
           "draw_shape", "encode_png", "row_images", "vision_smoke_dataset"]
