"""How a stage's declared columns reach it and how its writes leave it: one I/O object per step.

A stage declares what it reads and writes and how its rows are shared out (``algos/spec.py``:
``Stage.reads``, ``writes``, ``share``). The share is an object (``shares.py``) that pairs how the
stage's rows are read with where its writes go. The worker's loop asks this step's
:class:`StageIO` for the stage's batch, runs the stage function ``(ctx, batch) -> writes`` and hands
the writes back; the I/O object passes both to the stage's share and holds what every share uses:
the dock claims, the TensorCache, and where the rows live.

Where the rows live is one policy, set once per step by the placement:

- disaggregated train workers and rollout workers: every read is a TransferDock claim (sample data
  goes warehouse -> worker, never through the driver); columns a forward pass produced stay in the
  TensorCache of the worker that computed them and follow a claim by one all-to-all;
- colocated workers: a worker keeps the rows it generated (``own_rows.OwnRows``). A stage whose
  share is local and can run where its rows are (``Share.stays_local``: reward, outcome advantage,
  dynamic sampling, a forward pass whose engine has one DP rank per worker, an update whose loads
  are in balance) reads them with no dock claim and keeps its outputs here. The first stage that
  cannot publishes every worker's rows to the dock (one put) and reads as a disaggregated worker
  does; outputs of the stages that still run on own rows are then written to the dock as they come.

A :class:`StageBatch` holds only the declared reads, and reading any other column raises
:class:`StageContractError` naming the stage and the column. In tests and ``--smoke`` runs (every
smoke recipe) the writes are checked too: an undeclared write, or a declared one left out on a
worker that has rows, raises the same error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from ..algos.columns import CACHED, GENERATED, PER_TOKEN, REWARD
from ..algos.spec import ENGINES, Stage
from ..engines.base import RolloutEngine, SeqBatch, TrainEngine
from .batching import seq_batch, train_rows
from .context import Context, Role
from .own_rows import OwnRows
from .shares import NewRows, share_of


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


class StageBatch:
    """One stage's rows on this worker and the columns it declared (``batch[column]``); ``engine``
    is the stage's engine (``Stage.engine``) where its share hands out that engine's rows; ``local``:
    the rows are the ones this (colocated) worker generated, and its writes stay here."""

    def __init__(self, stage: Stage, state: StepState, rows: Sequence[int] = (), columns: Optional[dict] = None, *,
                 strict: bool = False, engine: Union[TrainEngine, RolloutEngine, None] = None,
                 new: Optional[NewRows] = None, mini_batches: Optional[list[SeqBatch]] = None,
                 counts: Optional[list] = None, io: Optional["StageIO"] = None, local: bool = False,
                 images_of=None):
        self.stage, self.state, self.rows, self.local = stage, state, list(rows), local
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


class StageIO:
    """This step's reads and writes on a worker: each stage's share (``shares.py``) reads and writes
    through it. ``own``: a colocated worker's own rows (None: every read a dock claim)."""

    def __init__(self, ctx: Context, state: StepState, strict: bool, own: Optional[OwnRows] = None):
        self.ctx, self.state, self.strict, self.own = ctx, state, strict, own
        self.timeout = ctx.recipe.trainer.dock_timeout_s
        self.dropped: set[int] = set()
        """Rows a stage took out of the step (every rank drops the same ones)."""
        self.computed: set[str] = set()
        """Columns computed on this worker's own rows (TensorCache)."""

    # ------------------------------------------------------------------ the stage's read and write
    def read(self, stage: Stage) -> StageBatch:
        """The stage's batch: on this worker's own rows when its share can stay local, else (after
        publishing the own rows, once) through the dock."""
        share = share_of(stage)
        if self.own is not None and share.local and share.stays_local(self, stage):
            return share.read_own(self, stage)
        self.publish()
        return share.read(self, stage)

    def write(self, stage: Stage, batch: StageBatch, writes: dict) -> None:
        share_of(stage).write(self, stage, batch, writes)

    # ------------------------------------------------------------------ what the shares use
    def batch(self, stage: Stage, rows, columns, **kw) -> StageBatch:
        return StageBatch(stage, self.state, rows, columns, strict=self.strict, io=self,
                          images_of=self.ctx.data.images, **kw)

    def check_writes(self, stage: Stage, batch: StageBatch, writes: dict) -> None:
        check_writes(stage, batch, writes)

    def engine(self, stage: Stage) -> Union[TrainEngine, RolloutEngine]:
        """The engine the stage names (``Stage.engine``)."""
        assert stage.engine in ENGINES, stage
        return getattr(self.ctx, stage.engine)

    def allocate(self, groups: int, n: int) -> list[int]:
        """Rank 0: new rows for ``groups`` prompt groups of ``n``. A colocated step's first round
        starts its dock in the same call (the reset the previous step sent ahead)."""
        if self.own is not None and self.state.round == 0:
            return self.ctx.dock.reset(self.state.step, groups=(groups, n))
        return self.ctx.dock.add_groups(groups, n)

    def claim(self, stage: Stage, *, whole_groups: bool = False) -> tuple[list[int], dict]:
        """A balanced share of the ready rows per worker; cached reads follow by one all-to-all."""
        ctx = self.ctx
        cached = [c for c in stage.reads if c in CACHED]
        b = ctx.dock.get(stage.name, list(stage.reads), None, dp_rank=ctx.rank, dp_size=ctx.world,
                         whole_groups=whole_groups, timeout=self.timeout)
        cols = {c: b[c] for c in stage.reads if c not in cached}
        if cached:
            cols.update(ctx.cache.exchange_mine(cached, list(b.rows)))
        return list(b.rows), cols

    def train_rows(self, stage: Stage, engine: TrainEngine) -> dict:
        """``engine``'s DP share: claimed by each DP rank's data leader, shared with its MP peers."""
        cached = [c for c in stage.reads if c in CACHED]
        return train_rows(self.ctx, engine, stage.name, [c for c in stage.reads if c not in cached], cached)

    def put(self, rows: list[int], writes: dict) -> None:
        self.ctx.dock.put(writes, rows)

    def cache(self, rows: list[int], writes: dict, *, mark: bool) -> None:
        """Into this worker's TensorCache; ``mark``: the dock notes them "held on rank r" for claims."""
        for c, v in writes.items():
            self.ctx.cache.put(c, rows, v)
        if mark:
            self.ctx.dock.mark_cached(list(writes), rows, self.ctx.rank)

    # ------------------------------------------------------------------ own rows (colocated)
    def holds(self, stage: Stage) -> bool:
        """Every column ``stage`` reads is on this worker for its own rows: generated, scored or
        computed here."""
        return all(c in GENERATED or c in REWARD or c in self.computed for c in stage.reads)

    def own_rows(self, stage: Stage) -> tuple[list[int], dict]:
        """``stage`` runs on this worker's live own rows: their declared reads (computed ones from the
        TensorCache), and its outputs will be computed here."""
        self.computed.update(stage.writes)
        data = self.own.select([c for c in stage.reads if c not in self.computed], self.live())
        rows = data.pop("rows")
        for c in stage.reads:
            if c in self.computed:
                data[c] = self.ctx.cache.get(c, rows)
        return rows, data

    def publish(self) -> None:
        """A colocated worker's own rows to the dock, once: the first stage that needs re-balanced rows."""
        if self.own is not None:
            self.own.publish(self.ctx.dock, self.ctx.cache, self.ctx.rank, self.live())

    def live(self) -> Optional[set[int]]:
        """This worker's own rows still in the step when a stage dropped some (None: all)."""
        if self.own is None or not self.dropped:
            return None
        return {x for x in self.own.rows if x not in self.dropped}

    def drop_rows(self, rows: list[int]) -> None:
        """Every rank reached the same verdict itself; rank 0 drops the rows in the dock. Colocated,
        none of them is in the dock yet: the drop rides on rank 0's next dock call, and a claim (the
        only reader) waits for it."""
        self.dropped.update(rows)
        if rows and self.ctx.rank == 0:
            if self.own is not None:
                self.ctx.dock.drop_rows(rows, defer=True)
            else:
                self.ctx.dock.drop_rows(rows)


def step_io(ctx: Context, state: StepState) -> StageIO:
    """This step's I/O object: a colocated worker keeps its own rows, the others read the dock."""
    strict = ctx.recipe.model.smoke is not None
    return StageIO(ctx, state, strict, OwnRows() if ctx.role == Role.BOTH else None)
