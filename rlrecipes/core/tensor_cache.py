"""TensorCache: tensors a worker produced, kept on its device for its next stages.

Keyed by ``(column, row id)``. The worker tells the dock only "held on rank r"
(``dock.mark_cached(columns, rows, rank)``); when a stage on another rank, or under another DP
layout, needs the rows, every worker of the process group calls :meth:`TensorCache.exchange`
collectively and the rows move with one all-to-all between the workers -- never through a driver
or the object store. Cleared each step (:meth:`clear`).

Wire format of :meth:`exchange` (works on gloo, nccl and hccl):

1. ``all_to_all_single`` of a fixed ``[world]`` int64 tensor: bytes this rank sends to each peer.
2. ``all_to_all_single`` of one uint8 buffer with uneven ``input_split_sizes`` /
   ``output_split_sizes`` -- for each peer a header (int64: rows, columns, dtype codes, per row and
   column the shape) followed by the raw bytes of every tensor. Variable-length rows need no
   padding: their lengths travel in the header.

Gloo in torch 2.13 implements ``all_to_all_single`` with uneven splits (``alltoall_base`` over
gloo's ``alltoallv``) for CPU tensors, so no fallback is needed; with gloo the buffers live on CPU.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from rlrecipes import device as dev

# dtype <-> code for the header; every dtype a worker caches in practice.
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def comm_device(group, device: torch.device) -> torch.device:
    """Where a collective's buffers live on ``group``: host memory on gloo, ``device`` otherwise."""
    return torch.device("cpu") if dist.get_backend(group) == "gloo" else device


class CacheMiss(KeyError):
    """A requested (column, row) is in no rank's cache."""


class TensorCache:
    """A per-worker cache of ``(column, row) -> tensor`` on the worker's device."""

    def __init__(self, device: torch.device | str | None = None, rank: int | None = None):
        self.device = torch.device(device) if device is not None else dev.torch_device()
        self._rank = rank
        self._data: dict[str, dict[int, torch.Tensor]] = {}
        self.step: int | None = None
        self.bytes_sent = 0       # through exchange(), since the last clear
        self.bytes_received = 0

    # -- local ------------------------------------------------------------------------------------
    def clear(self, step: int | None = None) -> None:
        """Drop everything (call at the start of each step)."""
        self._data.clear()
        self.step = step
        self.bytes_sent = self.bytes_received = 0

    def put(self, column: str, rows: Sequence[int], tensors: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Cache row ``rows[i]`` of ``column`` = ``tensors[i]`` (a stacked ``[rows, ...]`` tensor or a
        list of per-row tensors, moved to this worker's device; stacked rows are views)."""
        if len(tensors) != len(rows):
            raise ValueError(f"TensorCache.put({column!r}): {len(tensors)} tensors for {len(rows)} rows")
        col = self._data.setdefault(column, {})
        for r, t in zip(rows, tensors):
            if t.dtype not in _CODE:
                raise TypeError(f"TensorCache.put({column!r}): dtype {t.dtype} not supported "
                                f"(supported: {[str(d) for d in _DTYPES]})")
            col[int(r)] = t.to(self.device)

    def has(self, column: str, rows: Sequence[int]) -> bool:
        col = self._data.get(column, {})
        return all(int(r) in col for r in rows)

    def rows(self, column: str) -> list[int]:
        return sorted(self._data.get(column, {}))

    def get(self, column: str, rows: Sequence[int]) -> list[torch.Tensor]:
        """The cached tensors of ``rows`` (same order); a clear error naming what is missing."""
        col = self._data.get(column, {})
        missing = [int(r) for r in rows if int(r) not in col]
        if missing:
            raise CacheMiss(f"TensorCache (rank {self._rank}): column {column!r} has no rows "
                            f"{missing[:8]}{' ...' if len(missing) > 8 else ''} (holds {len(col)} rows)")
        return [col[int(r)] for r in rows]

    def stacked(self, column: str, rows: Sequence[int]) -> torch.Tensor:
        """``[rows, *shape]`` for rows of one shape."""
        return torch.stack(self.get(column, rows))

    def pop(self, column: str, rows: Sequence[int]) -> list[torch.Tensor]:
        out = self.get(column, rows)
        for r in rows:
            del self._data[column][int(r)]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self._data.values() for t in c.values())

    # -- collective -------------------------------------------------------------------------------
    def exchange(self, columns: Sequence[str], wanted_rows_per_rank: Sequence[Sequence[int]],
                 group: dist.ProcessGroup | None = None, *, keep: bool = True,
                 holders: dict[str, Sequence[Sequence[int]]] | None = None) -> dict[str, list[torch.Tensor]]:
        """Collective: every rank of ``group`` calls it with the same ``wanted_rows_per_rank``
        (entry ``r`` = the rows rank ``r`` needs, e.g. the dock's bins for a consumer). Each rank
        sends the wanted rows it holds to whoever wants them -- one all-to-all of bytes, after one
        of counts -- and returns ``{column: [tensor per wanted row]}`` for its own wanted rows, in
        order. Rows it holds itself are not sent. With ``keep`` the received rows are added to this
        cache (so later stages on this rank find them locally).

        ``holders`` (e.g. a dock claim's ``Batch.partition_holders``; the same on every rank): per
        column, the holder rank of each wanted row, laid out like ``wanted_rows_per_rank``. When
        every rank holds all it wants, every rank sees so and the exchange is a local lookup, with
        no collective (group ranks count as holder ranks).

        A row that no rank holds raises :class:`CacheMiss` on the rank that wanted it, after the
        collective finished (so no other rank hangs)."""
        world = dist.get_world_size(group)
        me = dist.get_rank(group)
        if len(wanted_rows_per_rank) != world:
            raise ValueError(f"TensorCache.exchange: wanted_rows_per_rank has {len(wanted_rows_per_rank)} "
                             f"entries for a group of {world} ranks")
        columns = list(columns)
        in_place = holders is not None and all(
            c in holders and len(holders[c]) == world
            and all(h == q for q, hs in enumerate(holders[c]) for h in hs) for c in columns)
        if world == 1 or in_place:  # no collective, only the local lookup (and its CacheMiss)
            mine = [int(r) for r in wanted_rows_per_rank[me]]
            return {c: self.get(c, mine) for c in columns}
        # Per destination: rows it wants that this rank holds (for every requested column).
        sends: list[list[int]] = []
        for dst in range(world):
            if dst == me:
                sends.append([])
                continue
            sends.append([int(r) for r in wanted_rows_per_rank[dst]
                          if all(int(r) in self._data.get(c, {}) for c in columns)])
        payloads = [self._encode(columns, rows) for rows in sends]          # uint8 [n_bytes] each
        comm_dev = self._comm_device(group)
        send_sizes = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device=comm_dev)  # [world]
        recv_sizes = torch.empty(world, dtype=torch.int64, device=comm_dev)                          # [world]
        dist.all_to_all_single(recv_sizes, send_sizes, group=group)
        in_splits = send_sizes.tolist()
        out_splits = recv_sizes.tolist()
        send_buf = torch.cat(payloads).to(comm_dev) if payloads else torch.empty(0, dtype=torch.uint8)
        recv_buf = torch.empty(sum(out_splits), dtype=torch.uint8, device=comm_dev)               # [sum bytes]
        dist.all_to_all_single(recv_buf, send_buf, output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=group)
        self.bytes_sent += sum(in_splits)
        self.bytes_received += sum(out_splits)
        received: dict[str, dict[int, torch.Tensor]] = {c: {} for c in columns}
        for chunk in torch.split(recv_buf, out_splits):
            if chunk.numel():
                for c, rows_t in self._decode(chunk).items():
                    for r, t in rows_t.items():
                        received[c].setdefault(r, t)
        out: dict[str, list[torch.Tensor]] = {}
        mine = [int(r) for r in wanted_rows_per_rank[me]]
        for c in columns:
            local = self._data.get(c, {})
            missing = [r for r in mine if r not in local and r not in received[c]]
            if missing:
                raise CacheMiss(f"TensorCache.exchange (rank {me}): column {c!r} rows {missing[:8]} "
                                f"are held by no rank of the group")
            out[c] = [local[r] if r in local else received[c][r] for r in mine]
            if keep:
                self._data.setdefault(c, {}).update(received[c])
        return out

    def exchange_mine(self, columns: Sequence[str], my_rows: Sequence[int],
                      group: dist.ProcessGroup | None = None, *, keep: bool = True) -> dict[str, list[torch.Tensor]]:
        """Like :meth:`exchange` when each rank only knows its own wanted rows: all-gathers the
        wants first (one more small collective)."""
        world = dist.get_world_size(group)
        if world == 1:  # nothing to ask anyone: the rows are here or nowhere
            return self.exchange(columns, [list(my_rows)], group, keep=keep)
        wants: list = [None] * world
        dist.all_gather_object(wants, [int(r) for r in my_rows], group=group)
        return self.exchange(columns, wants, group, keep=keep)

    # -- wire format ------------------------------------------------------------------------------
    def _comm_device(self, group) -> torch.device:
        return comm_device(group, self.device)

    def _encode(self, columns: list[str], rows: list[int]) -> torch.Tensor:
        if not rows:
            return torch.empty(0, dtype=torch.uint8, device=self.device)
        tensors = [[self._data[c][r] for r in rows] for c in columns]  # [col][row]
        header = [len(rows), len(columns)]
        header += [_CODE[tensors[i][0].dtype] for i in range(len(columns))]
        header += rows
        for i in range(len(columns)):
            for t in tensors[i]:
                if _CODE[t.dtype] != header[2 + i]:
                    raise TypeError(f"TensorCache: column {columns[i]!r} mixes dtypes")
                header += [t.dim(), *t.shape]
        names = "\0".join(columns).encode()
        head = torch.tensor([len(header), len(names)] + header, dtype=torch.int64)  # [2 + header]
        parts = [head.view(torch.uint8), torch.frombuffer(bytearray(names), dtype=torch.uint8)]
        parts = [p.to(self.device) for p in parts]
        for col in tensors:
            parts += [t.contiguous().reshape(-1).view(torch.uint8) for t in col]
        return torch.cat(parts)

    def _decode(self, buf: torch.Tensor) -> dict[str, dict[int, torch.Tensor]]:
        buf = buf.to(self.device)
        lens = buf[:16].cpu().clone().view(torch.int64).tolist()
        n_header, n_names = lens
        pos = 16
        header = buf[pos:pos + 8 * n_header].cpu().clone().view(torch.int64).tolist()
        pos += 8 * n_header
        names = bytes(buf[pos:pos + n_names].cpu().tolist()).decode().split("\0")
        pos += n_names
        n_rows, n_cols = header[0], header[1]
        dtypes = [_DTYPES[c] for c in header[2:2 + n_cols]]
        rows = header[2 + n_cols:2 + n_cols + n_rows]
        h = 2 + n_cols + n_rows
        out: dict[str, dict[int, torch.Tensor]] = {}
        for ci in range(n_cols):
            shapes = []
            for _ in range(n_rows):
                nd = header[h]
                shapes.append(tuple(header[h + 1:h + 1 + nd]))
                h += 1 + nd
            col = out[names[ci]] = {}
            item = torch.empty(0, dtype=dtypes[ci]).element_size()
            for r, shape in zip(rows, shapes):
                nb = math.prod(shape) * item
                # clone: the received buffer is shared by all rows; a row must own its memory
                col[r] = buf[pos:pos + nb].clone().view(dtypes[ci]).reshape(shape)
                pos += nb
        return out
