"""How a stage's declared columns reach it and how its writes leave it: one I/O object per step.

A stage declares what it reads and writes and how its rows are shared out (``algos/spec.py``:
``Stage.reads``, ``writes``, ``share``). The worker's loop asks this step's I/O object for the
stage's batch, runs the stage function ``(ctx, batch) -> writes`` and hands the writes back. Where
the columns travel is the I/O object's business, chosen once per step by the placement:

- :class:`DockIO` (disaggregated train workers, rollout workers): every read is a TransferDock claim
  (sample data goes warehouse -> worker, never through the driver); columns a forward pass produced
  stay in the TensorCache of the worker that computed them and follow a claim by one all-to-all.
- :class:`OwnRowsIO` (colocated workers): a worker's own rollout rows (``own_rows.OwnRows``) serve
  every stage whose rows can stay where they were generated -- reward, outcome advantage, dynamic
  sampling, a forward pass whose engine has one DP rank per worker, an update whose loads are in
  balance -- with no dock claim. The first stage that needs re-balanced rows publishes them to the
  dock (one put) and from then on reads as :class:`DockIO` does.

A :class:`StageBatch` holds only the declared reads, and reading any other column raises
:class:`StageContractError` naming the stage and the column. In tests and ``--smoke`` runs (every
smoke recipe) the writes are checked too: an undeclared write, or a declared one left out on a
worker that has rows, raises the same error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..algos.spec import Stage
from ..core.collectives import all_gather_objects, broadcast_object
from ..engines.base import RolloutEngine, SeqBatch, TrainEngine
from .batching import (all_gather, gather_in_model_parallel_group, global_counts, local_counts, seq_batch, subset,
                       train_rows)
from .context import Context, Role
from .own_rows import CACHED, OwnRows
from .pool_rows import PoolBatch, commit, load_carried

#: columns the rollout stage writes (the rows' own columns)
GENERATED = ("prompt_ids", "response_ids", "prompt_index", "rollout_log_probs", "policy_version", "routed_experts",
             "token_versions")
#: per-token columns of a train batch besides the response itself
PER_TOKEN = ("rollout_log_probs", "ref_log_probs", "old_log_probs", "values", "returns", "response_mask")


class StageContractError(RuntimeError):
    """A stage touched a column it did not declare, or left out a declared write."""


@dataclass
class StepState:
    """What one step's stages share on a worker: the batch target, DAPO's rounds and kept groups,
    and the numbers the metrics row sums over workers."""

    step: int
    target: int
    round: int = 0
    more: bool = False
    kept_rows: list = field(default_factory=list)
    sums: dict = field(default_factory=dict)
    """Summed over workers in the metrics row (reward, errors, staleness, DAPO's group counts)."""
    maxes: dict = field(default_factory=dict)
    first_error: Optional[str] = None
    update: dict = field(default_factory=dict)
    critic: dict = field(default_factory=dict)
    rollout: dict = field(default_factory=dict)
    """A rollout worker's own row entries (a pooled rollout's group counts), sent with its figures."""

    def add(self, **numbers: float) -> None:
        for k, v in numbers.items():
            self.sums[k] = self.sums.get(k, 0) + v

    def peak(self, **numbers: float) -> None:
        for k, v in numbers.items():
            self.maxes[k] = max(self.maxes.get(k, v), v)


@dataclass
class NewRows:
    """What a generation round allocated to this rollout DP rank (its rows are the batch's rows)."""

    groups: list[int]
    """Indices (within the round) of the groups this rollout DP rank generates."""


class StageBatch:
    """One stage's rows on this worker and the columns it declared (``batch[column]``); ``engine``
    is the engine its share names (the rollout engine for new rows)."""

    def __init__(self, stage: Stage, state: StepState, rows: Sequence[int] = (), columns: Optional[dict] = None, *,
                 strict: bool = False, engine: Union[TrainEngine, RolloutEngine, None] = None,
                 new: Optional[NewRows] = None, mini_batches: Optional[list[SeqBatch]] = None,
                 counts: Optional[list] = None, io: Optional["DockIO"] = None, images_of=None):
        self.stage, self.state, self.rows = stage, state, list(rows)
        self._columns = dict(columns or {})
        self.strict, self.engine, self.new = strict, engine, new
        self.mini_batches, self.counts, self._io = mini_batches, counts, io
        self._images_of = images_of  # prompt_index -> the prompts' images (a VL dataset)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, column: str):
        if column not in self.stage.reads:
            raise StageContractError(f"stage {self.stage.name!r} reads column {column!r}, which it does not declare "
                                     f"(reads: {', '.join(self.stage.reads) or 'none'}); add it to the stage's reads "
                                     "in rlrecipes/algos/spec.py")
        return self._columns[column]

    def seq_batch(self) -> SeqBatch:
        """The rows as an engine-neutral batch of the declared columns."""
        return seq_batch({"rows": self.rows, **self._columns}, per_token=[c for c in PER_TOKEN if c in self._columns],
                         images_of=self._images_of)

    def drop_rows(self, rows: Sequence[int]) -> None:
        """Take rows out of the step (DAPO's filter): later stages never see them."""
        self._io.drop_rows(list(rows))


def check_writes(stage: Stage, batch: StageBatch, writes: dict) -> None:
    extra = sorted(set(writes) - set(stage.writes))
    missing = sorted(set(stage.writes) - set(writes)) if batch.rows else []
    if extra or missing:
        what = (f"writes {extra}, which it does not declare" if extra else "") + \
            (" and " if extra and missing else "") + (f"does not write {missing}, which it declares" if missing else "")
        raise StageContractError(f"stage {stage.name!r} {what} (writes: {', '.join(stage.writes) or 'none'}); "
                                 "fix the stage or its declaration in rlrecipes/algos/spec.py")


class DockIO:
    """Every read a dock claim, every write a dock put (forward outputs: the TensorCache)."""

    def __init__(self, ctx: Context, state: StepState, strict: bool):
        self.ctx, self.state, self.strict = ctx, state, strict
        self.timeout = ctx.recipe.trainer.dock_timeout_s
        self.dropped: set[int] = set()
        """Rows a stage took out of the step (every rank drops the same ones)."""

    # ------------------------------------------------------------------ reads
    #: share -> reader (algos/spec.SHARES); a new share is a reader here (and its write in ``write``)
    READERS = {"new": "_read_new", "round": "_read_round", "workers": "_read_workers", "groups": "_read_groups",
               "all": "_read_all", "actor": "_read_engine", "ref": "_read_engine", "critic": "_read_engine",
               "actor_mini_batches": "_read_actor_mini_batches", "none": "_read_none", "pool": "_read_pool"}

    def read(self, stage: Stage) -> StageBatch:
        if stage.share not in self.READERS:
            raise StageContractError(f"stage {stage.name!r}: no reader for share {stage.share!r} in "
                                     f"{type(self).__name__}; add one to rlrecipes/workflow/stage_io.py")
        return getattr(self, self.READERS[stage.share])(stage)

    def _batch(self, stage: Stage, rows, columns, **kw) -> StageBatch:
        return StageBatch(stage, self.state, rows, columns, strict=self.strict, io=self,
                          images_of=self.ctx.data.images, **kw)

    def _read_none(self, stage: Stage) -> StageBatch:
        return self._batch(stage, [], {})

    def _read_new(self, stage: Stage) -> StageBatch:
        ctx, st, n = self.ctx, self.state, self.ctx.recipe.trainer.n_samples_per_prompt
        rows = self._allocate(st.target, n) if ctx.rank == 0 else None
        rows = broadcast_object(rows, device=ctx.device)
        eng = ctx.rollout
        mine = list(range(eng.dp_rank, st.target, eng.dp_size))
        return self._batch(stage, [rows[g * n + j] for g in mine for j in range(n)], {}, new=NewRows(mine),
                           engine=eng)

    def _allocate(self, groups: int, n: int) -> list[int]:
        return self.ctx.dock.add_groups(groups, n)

    def _read_pool(self, stage: Stage) -> StageBatch:
        """A pooled rollout (``workflow/pool.py``): the groups carried over in the pool's dock; the
        stage draws the new ones, and its rows are allocated when it commits them."""
        return self._batch(stage, [], {}, new=PoolBatch(load_carried(self.ctx, self.timeout)), engine=self.ctx.rollout)

    def _claim(self, stage: Stage, *, whole_groups: bool = False) -> StageBatch:
        """A balanced share per worker; cached reads follow by one all-to-all."""
        ctx = self.ctx
        cached = [c for c in stage.reads if c in CACHED]
        b = ctx.dock.get(stage.name, list(stage.reads), None, dp_rank=ctx.rank, dp_size=ctx.world,
                         whole_groups=whole_groups, timeout=self.timeout)
        cols = {c: b[c] for c in stage.reads if c not in cached}
        if cached:
            cols.update(ctx.cache.exchange_mine(cached, list(b.rows)))
        return self._batch(stage, list(b.rows), cols)

    def _read_round(self, stage: Stage) -> StageBatch:
        return self._claim(stage)

    def _read_workers(self, stage: Stage) -> StageBatch:
        return self._claim(stage)

    def _read_groups(self, stage: Stage) -> StageBatch:
        return self._claim(stage, whole_groups=True)

    def _read_all(self, stage: Stage) -> StageBatch:
        """Every row of the step on every worker: rank 0 claims them, one broadcast shares them."""
        ctx, got = self.ctx, None
        if ctx.rank == 0:
            b = ctx.dock.get(stage.name, list(stage.reads), None, whole_groups=True, timeout=self.timeout)
            got = (list(b.rows), {c: b[c] for c in stage.reads})
        rows, cols = broadcast_object(got, device=ctx.device)
        return self._batch(stage, rows, cols)

    def _engine(self, stage: Stage) -> TrainEngine:
        return {"actor": self.ctx.actor, "ref": self.ctx.ref, "critic": self.ctx.critic,
                "actor_mini_batches": self.ctx.actor}[stage.share]

    def _read_engine(self, stage: Stage) -> StageBatch:
        """The engine's DP share: claimed by each DP rank's data leader, shared with its MP peers."""
        engine = self._engine(stage)
        data = self._train_rows(stage, engine)
        rows = data.pop("rows")
        return self._batch(stage, rows, data, engine=engine)

    def _train_rows(self, stage: Stage, engine: TrainEngine) -> dict:
        cached = [c for c in stage.reads if c in CACHED]
        return train_rows(self.ctx, engine, stage.name, [c for c in stage.reads if c not in cached], cached)

    def _read_actor_mini_batches(self, stage: Stage) -> StageBatch:
        engine = self.ctx.actor
        batches = self._mini_batches(self._train_rows(stage, engine))
        return self._batch(stage, [], {}, engine=engine, mini_batches=batches, counts=global_counts(engine, batches))

    def _mini_batches(self, data: dict) -> list[SeqBatch]:
        n, k = len(data["rows"]), self.ctx.n_mini
        per_token = [c for c in PER_TOKEN if c in data]
        return [seq_batch(subset(data, list(range(n))[m::k]), per_token=per_token, images_of=self.ctx.data.images)
                for m in range(k)]

    # ------------------------------------------------------------------ writes
    def write(self, stage: Stage, batch: StageBatch, writes: dict) -> None:
        if stage.share == "pool":  # rows exist only now: the complete groups get them as they commit
            if self.strict and batch.new.committed:
                check_writes(stage, StageBatch(stage, self.state, [0]), writes)
            self.state.rollout.update(commit(self.ctx, batch.new, writes, self.state.step, batch.engine.is_data_leader))
            return
        if self.strict:
            check_writes(stage, batch, writes)
        if writes and batch.rows:
            self._store(stage, batch, writes)

    def _store(self, stage: Stage, batch: StageBatch, writes: dict) -> None:
        """Where a stage's (non-empty) writes go."""
        if stage.share in ("actor", "ref", "critic"):
            if batch.engine.is_data_leader:
                self._cache(stage, batch.rows, writes)
            return
        if stage.share == "new" and not batch.engine.is_data_leader:
            return  # a rollout TP peer: its leader writes the rows
        self._put(batch.rows, writes)

    def _cache(self, stage: Stage, rows: list[int], writes: dict) -> None:
        for c, v in writes.items():
            self.ctx.cache.put(c, rows, v)
        self.ctx.dock.mark_cached(list(writes), rows, self.ctx.rank)

    def _put(self, rows: list[int], writes: dict) -> None:
        self.ctx.dock.put(writes, rows)

    def drop_rows(self, rows: list[int]) -> None:
        self.dropped.update(rows)
        if rows and self.ctx.rank == 0:
            self.ctx.dock.drop_rows(rows)

    def end_stage(self, stage: Stage) -> None:
        if stage.share == "all":
            dist.barrier()  # rank 0's drops are in before any rank claims again

    def live(self) -> Optional[set[int]]:
        """This worker's rows still in the step when a stage dropped some (None: all)."""
        return None


class OwnRowsIO(DockIO):
    """A colocated worker's step: stages run on the rows it generated while they can (see the module
    docstring); the first stage that needs re-balanced rows publishes them and reads from the dock."""

    def __init__(self, ctx: Context, state: StepState, strict: bool):
        super().__init__(ctx, state, strict)
        self.own = OwnRows()
        self.local: set[str] = set()
        """Columns computed on this worker's own rows (TensorCache); an update needs them all."""
        self.on_own: set[str] = set()
        """Stages that ran on the own rows this step."""

    def _allocate(self, groups: int, n: int) -> list[int]:
        if self.state.round == 0:  # the step's first round starts its dock in the same call
            return self.ctx.dock.reset(self.state.step, groups=(groups, n))
        return super()._allocate(groups, n)

    def live(self) -> Optional[set[int]]:
        return {x for x in self.own.rows if x not in self.dropped} if self.dropped else None

    def _publish(self) -> None:
        self.own.publish(self.ctx.dock, self.ctx.cache, self.ctx.rank, self.live())

    def _on_own_rows(self, engine) -> bool:
        """``engine`` has one DP rank per worker, as the rollout does: the worker's rows are its share."""
        return engine.dp_size == self.ctx.rollout.dp_size == self.ctx.world

    def _local(self, stage: Stage) -> bool:
        return all(c in GENERATED or c in self.local for c in stage.reads)

    def _select(self, stage: Stage, columns: Sequence[str]) -> tuple[list[int], dict]:
        data = self.own.select([c for c in columns if c not in self.local], self.live())
        rows = data.pop("rows")
        for c in columns:
            if c in self.local:
                data[c] = self.ctx.cache.get(c, rows)
        return rows, data

    def _read_round(self, stage: Stage) -> StageBatch:
        b = self.own.unscored(list(stage.reads))
        return self._batch(stage, list(b.rows), {c: b[c] for c in stage.reads})

    def _own_path(self, stage: Stage) -> None:
        """``stage`` runs on this worker's own rows: its outputs stay here (TensorCache). Decided from
        the config and earlier decisions only, so identically on every rank, rows or none."""
        self.on_own.add(stage.name)
        self.local.update(stage.writes)

    def _read_groups(self, stage: Stage) -> StageBatch:
        self._own_path(stage)
        rows, data = self._select(stage, stage.reads)  # whole groups, generated here
        return self._batch(stage, rows, data)

    def _read_all(self, stage: Stage) -> StageBatch:
        """The round scored last, every worker's, on every worker (one small all-gather), in row order
        as a dock claim would give it; nothing of it is in the dock yet."""
        rows, cols = self.own.last_round(stage.reads)
        tensors = {c for c, v in cols.items() if isinstance(v, torch.Tensor)}  # per-row numbers: sent as lists
        mine = (rows, {c: v.tolist() if c in tensors else list(v) for c, v in cols.items()}, tensors)
        every = all_gather_objects(mine, device=self.ctx.device)
        tensors = set().union(*(t for _, _, t in every))  # a rank without rows (a TP peer) holds none
        order = sorted((x, k, i) for k, (rs, _, _) in enumerate(every) for i, x in enumerate(rs))
        merged = {c: [every[k][1][c][i] for _, k, i in order] for c in stage.reads}
        return self._batch(stage, [x for x, _, _ in order],
                           {c: torch.tensor(v) if c in tensors else v for c, v in merged.items()})

    def _read_workers(self, stage: Stage) -> StageBatch:
        self._publish()
        return super()._read_workers(stage)

    def _read_engine(self, stage: Stage) -> StageBatch:
        engine = self._engine(stage)
        if not (self._on_own_rows(engine) and self._local(stage)):
            self._publish()
            return super()._read_engine(stage)
        self._own_path(stage)
        rows, data = self._select(stage, stage.reads)
        return self._batch(stage, rows, data, engine=engine)

    def _read_actor_mini_batches(self, stage: Stage) -> StageBatch:
        """Each actor DP rank trains on the rows its workers generated (its model-parallel peers'
        merged by one all-gather), with no claim, while that keeps the DP ranks' loads (prompt +
        response tokens) within ``trainer.rebalance_tolerance`` of their mean; one all-gather of the
        loads decides, identically on every rank. Otherwise the dock re-balances them."""
        ctx, actor = self.ctx, self.ctx.actor
        if self.own.published or ctx.rollout.dp_size != ctx.world or not self._local(stage):
            self._publish()
            return super()._read_actor_mini_batches(stage)
        rows, data = self._select(stage, stage.reads)
        batches = self._mini_batches(gather_in_model_parallel_group(actor, {"rows": rows, **data}, ctx.device))
        counts = local_counts(actor, batches)  # zeros on a peer that is not its DP rank's leader
        mine = torch.cat([torch.tensor([float(actor.is_data_leader), float(counts[:, [0, 2]].sum())],
                                       dtype=torch.float64), counts.reshape(-1).double()])  # [leader, load, counts]
        every = torch.stack(all_gather(mine))
        loads = every[every[:, 0] > 0, 1]  # one per DP rank
        if float(loads.max()) > (1 + ctx.recipe.trainer.rebalance_tolerance) * float(loads.mean()):
            self._publish()
            return super()._read_actor_mini_batches(stage)
        total = every[:, 2:].sum(0).reshape(-1, 3)
        return self._batch(stage, [], {}, engine=actor, mini_batches=batches,
                           counts=[tuple(map(float, c)) for c in total.tolist()])

    def _store(self, stage: Stage, batch: StageBatch, writes: dict) -> None:
        if stage.share == "new":
            if batch.engine.is_data_leader:
                self.own.add(batch.rows, writes)  # the dock gets them if a stage claims them (publish)
        elif stage.share == "round":
            self.own.add_scores(**writes)
        elif stage.name not in self.on_own:
            super()._store(stage, batch, writes)
        elif stage.share == "groups":  # computed on own rows: kept here (and in the dock once published)
            for c, v in writes.items():
                self.ctx.cache.put(c, batch.rows, v)
            if self.own.published:
                self.ctx.dock.put(writes, batch.rows)
        elif batch.engine.is_data_leader:  # a forward pass on own rows: cached, marked once published
            if self.own.published:
                self._cache(stage, batch.rows, writes)
            else:
                for c, v in writes.items():
                    self.ctx.cache.put(c, batch.rows, v)

    def drop_rows(self, rows: list[int]) -> None:
        # every rank reached the same verdict itself; rank 0's drops ride on its next dock call, and a
        # claim (the only reader: none of these rows is in the dock yet) waits for them
        self.dropped.update(rows)
        if rows and self.ctx.rank == 0:
            self.ctx.dock.drop_rows(rows, defer=True)

    def end_stage(self, stage: Stage) -> None:
        return None


def step_io(ctx: Context, state: StepState) -> DockIO:
    """This step's I/O object: the placement decides, once."""
    strict = ctx.recipe.model.smoke is not None
    return (OwnRowsIO if ctx.role == Role.BOTH else DockIO)(ctx, state, strict)
