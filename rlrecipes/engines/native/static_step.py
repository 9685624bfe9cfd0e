"""The static decode step's buffers (``decode.py``, ``FastDecoder(static=True)``): one batch-size
bucket's inputs, counters, keep-mask and rotary tables, fixed in shape and address so the step can
be captured into a device graph once and replayed (``device.capture_graph``)."""
from __future__ import annotations

import torch

#: largest batch-size bucket (powers of two up to it); a larger batch is its own bucket
MAX_BUCKET = 512


def bucket_rows(batch: int, max_bucket: int = MAX_BUCKET) -> int:
    """The rows of the static step that runs ``batch`` sequences: the next power of two, up to ``max_bucket``."""
    if batch > max_bucket:
        return batch
    return 1 << max(batch - 1, 0).bit_length()


class StaticStep:
    """The static buffers of one batch-size bucket's decode step, and its captured graph.

    ``tok [R]``: the tokens fed (rows ``>= B`` are padding); ``col, col0, t [1]``: the K/V column the
    step writes, the first decode column of the call, the rotary step index (``col`` and ``t``
    advance on the device inside the step); ``keep [R, L]``: the columns before ``col0`` each row
    attends to; ``cos, sin, sin_signed [R, L, 1, D]``: rotary per step index; ``cols [L]``: column ids.
    ``ptrs``: the K/V storage the graph was captured on (a new storage means a new capture).
    """

    def __init__(self, rows: int, capacity: int, device: torch.device):
        self.rows, self.capacity = rows, capacity
        self.tok = torch.zeros(rows, dtype=torch.long, device=device)
        self.col = torch.zeros(1, dtype=torch.long, device=device)
        self.col0 = torch.zeros(1, dtype=torch.long, device=device)
        self.t = torch.zeros(1, dtype=torch.long, device=device)
        self.cols = torch.arange(capacity, device=device)
        self.keep = torch.ones((rows, capacity), dtype=torch.bool, device=device)
        self.cos = self.sin = self.sin_signed = None
        self.graph = None
        self.logits = None  # the captured step's output
        self.ptrs: tuple | None = None
        self.warm = False  # ran eagerly once on this storage (what a capture needs first)
        self.failed = False  # capture raised: this bucket runs eagerly

    def fill_rotary(self, cos: torch.Tensor, sin: torch.Tensor, sin_signed: torch.Tensor) -> None:
        """Copy the call's rotary tables ``[B, S, 1, D]`` into the static ones (padding rows: zeros)."""
        if self.cos is None or self.cos.shape[-1] != cos.shape[-1] or self.cos.dtype != cos.dtype:
            shape = (self.rows, self.capacity, 1, cos.shape[-1])
            self.cos, self.sin, self.sin_signed = (cos.new_zeros(shape) for _ in range(3))
            self.graph, self.warm = None, False
        B, S = cos.shape[:2]
        for dst, src in ((self.cos, cos), (self.sin, sin), (self.sin_signed, sin_signed)):
            dst[:B, :S].copy_(src)


__all__ = ["MAX_BUCKET", "StaticStep", "bucket_rows"]
