"""A pooled rollout's groups and where they live between steps: the carry-over dock and the step's
dock (``workflow/pool.py`` generates them; the ``carried`` share, ``workflow/shares.py``, reads and
writes them through here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..algos.columns import CARRY_COLUMNS
from ..core.collectives import broadcast_object
from .context import Context


@dataclass
class Sample:
    tokens: list = field(default_factory=list)
    logps: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    done: bool = False


@dataclass
class Group:
    """One prompt's ``n`` samples, from the step it was drawn (``born``) until it is trained on."""

    index: int
    born: int
    prompt: torch.Tensor
    samples: list
    scores: Optional[torch.Tensor] = None
    acc: Optional[torch.Tensor] = None

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    @property
    def version(self) -> int:
        """The newest policy version any of its tokens was generated under."""
        return max((s.versions[-1] for s in self.samples if s.versions), default=-1)

    @property
    def oldest(self) -> Optional[int]:
        """The oldest policy version any of its tokens was generated under (versions only grow along a
        sample, so its first token's); None before it has a token."""
        return min((s.versions[0] for s in self.samples if s.versions), default=None)


@dataclass
class PoolBatch:
    """What the pooled rollout stage gets (the carried groups, every rollout rank alike) and what it
    hands back to the I/O object: this rank's committed and carried groups with their positions in
    the rollout workers' common order."""

    carried: list
    committed: list = field(default_factory=list)
    committed_at: list = field(default_factory=list)
    n_committed: int = 0
    carry: list = field(default_factory=list)
    carry_at: list = field(default_factory=list)
    n_carry: int = 0
    numbers: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- dock side
def load_carried(ctx: Context, timeout: float) -> list[Group]:
    """The groups the previous step left in the carry-over dock, on every rollout rank (rollout rank 0
    claims them, one broadcast shares them)."""
    got = None
    if ctx.rank == 0 and ctx.carried_groups:
        b = ctx.carry_dock.get("continue", list(CARRY_COLUMNS), None, whole_groups=True, timeout=timeout)
        got = {c: b[c] for c in CARRY_COLUMNS}
    got = broadcast_object(got, device=ctx.device)
    if not got:
        return []
    n = ctx.recipe.trainer.n_samples_per_prompt
    groups = []
    for g in range(len(got["prompt_index"]) // n):
        rows = range(g * n, (g + 1) * n)
        samples = [Sample(got["response_ids"][i].tolist(), got["rollout_log_probs"][i].tolist(),
                          got["token_versions"][i].tolist(), bool(got["done"][i])) for i in rows]
        grp = Group(int(got["prompt_index"][g * n]), int(got["born"][g * n]), got["prompt_ids"][g * n], samples)
        if grp.done:
            grp.scores, grp.acc = got["scores"][g * n:(g + 1) * n], got["acc"][g * n:(g + 1) * n]
        groups.append(grp)
    return groups


def row_columns(groups: list[Group], n: int) -> dict:
    """Row columns of ``groups`` (``n`` rows each) shared by the committed and the carried rows."""
    rows = [(g, s) for g in groups for s in g.samples]
    zeros = torch.zeros(n)
    return {"prompt_ids": [g.prompt for g, _ in rows],
            "response_ids": [torch.tensor(s.tokens, dtype=torch.long) for _, s in rows],
            "rollout_log_probs": [torch.tensor(s.logps, dtype=torch.float32) for _, s in rows],
            "token_versions": [torch.tensor(s.versions, dtype=torch.long) for _, s in rows],
            "prompt_index": torch.tensor([g.index for g, _ in rows], dtype=torch.long),
            "scores": torch.cat([g.scores if g.scores is not None else zeros for g in groups]) if groups else zeros[:0],
            "acc": torch.cat([g.acc if g.acc is not None else zeros for g in groups]) if groups else zeros[:0]}


def commit(ctx: Context, pb: PoolBatch, writes: dict, step: int, leader: bool) -> dict:
    """The stage's complete groups to the step's dock (rows allocated now, by rollout rank 0, in the
    common order), the rest to the carry-over dock (replacing the last step's). Returns rank 0's
    row entries of the pool (its own numbers, and the carry-over dock's row count)."""
    n = ctx.recipe.trainer.n_samples_per_prompt
    rows = ctx.dock.add_groups(pb.n_committed, n) if ctx.rank == 0 and pb.n_committed else []
    rows = broadcast_object(rows, device=ctx.device)  # allocated before any rank puts
    if leader and pb.committed:
        ctx.dock.put(writes, [rows[p * n + j] for p in pb.committed_at for j in range(n)])
    carry = ctx.carry_dock
    crow = []
    if ctx.rank == 0:
        carry.reset(step)
        crow = carry.add_groups(pb.n_carry, n) if pb.n_carry else []
        ctx.carried_groups = pb.n_carry
    crow = broadcast_object(crow, device=ctx.device)
    if leader and pb.carry:
        cols = row_columns(pb.carry, n)
        cols.update(born=torch.tensor([g.born for g in pb.carry for _ in range(n)], dtype=torch.long),
                    done=torch.tensor([s.done for g in pb.carry for s in g.samples], dtype=torch.long))
        carry.put(cols, [crow[p * n + j] for p in pb.carry_at for j in range(n)])
        carry.flush()
    dist.barrier()  # every carried row is in before rank 0 counts the dock's rows
    if ctx.rank != 0:
        return {}
    return {**pb.numbers, "rollout/pool_dock_rows": int(carry.stats()["live_rows"])}


