"""One agent loop per rollout instance when the instance spans several ranks (TP / EP peers).

The ranks of one rollout instance must make the same engine calls in the same order (their
collectives pair up), but an agent loop's calls depend on when tools finish, which differs from
rank to rank. So only the instance's leader runs the loop and the tools; every call it makes on its
turn session is mirrored to the peers (:class:`LeaderSession`), which replay it on theirs
(:func:`follow`) until the leader sends the finished trajectories. The peers' engines still do
their share of every forward pass (their TP shards), and draw the same tokens (the engine
broadcasts the leader's).

Messages are small Python objects (row indices, token lists, budgets) sent with
``torch.distributed.broadcast_object_list`` over the instance's group.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


class LeaderSession:
    """Wraps the leader's turn session: every :meth:`generate` is announced to the peers first."""

    def __init__(self, inner: Any, group: Any, src: int):
        self.inner, self.group, self.src = inner, group, src

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=self.src, group=self.group)

    def generate(self, rows: Sequence[int], appended: Sequence, max_new_tokens: Sequence[int]):
        self._send(("call", list(rows), [None if a is None else a.tolist() for a in appended], list(max_new_tokens)))
        return self.inner.generate(rows, appended, max_new_tokens)

    def finish(self, result: Any) -> None:
        """End the peers' replay; they return ``result`` (the trajectories) from :func:`follow`."""
        self._send(("done", result))

    def fail(self, error: BaseException) -> None:
        """The leader's loop failed: the peers raise too (instead of waiting in the next broadcast
        until the collective times out, hiding the error)."""
        self._send(("error", f"{type(error).__name__}: {error}"))

    def close(self) -> None:
        self.inner.close()


def follow(inner: Any, group: Any, src: int) -> Any:
    """A peer's side: replay the leader's calls on ``inner`` until it finishes; its result."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        message = box[0]
        if message[0] == "done":
            return message[1]
        if message[0] == "error":
            raise RuntimeError(f"the rollout instance's leader failed in the agent loop: {message[1]}")
        _, rows, appended, budgets = message
        inner.generate(rows, [None if a is None else torch.tensor(a, dtype=torch.long) for a in appended], budgets)


__all__ = ["LeaderSession", "follow"]
