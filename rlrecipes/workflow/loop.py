"""One worker's controller loop over the algorithm's stage DAG.

For each stage the step's I/O object (``stage_io.py``, set once per step by the placement) and
the stage's share (``shares.py``) hand the stage its declared reads, the stage function of the
same name (``stages.py``) returns its declared writes, and the share writes them. Stages of one repeat group (DAPO's generation rounds)
run again while dynamic sampling asks for more groups. After the stages, one all-gather of small
per-worker facts lets rank 0 assemble the step's metrics row (``step_metrics.py``).
"""
from __future__ import annotations

import time

import torch.distributed as dist

from ..core.collectives import all_gather_objects
from ..metrics import StageTimer
from .context import Context, Role
from .stage_io import StageIO, StepState, step_io
from . import pool  # noqa: F401  (registers the pooled rollout's stage function)
from .stages import STAGE_FUNCTIONS, receive_weights
from .step_metrics import metrics_row, reward_failed, step_facts, sync_metrics


def run_stages(ctx: Context, io: StageIO) -> None:
    stages, st = ctx.stages, io.state
    i = 0
    while i < len(stages):
        group = stages[i].repeat_group
        j = i + 1
        while group and j < len(stages) and stages[j].repeat_group == group:
            j += 1
        while True:
            for stage in stages[i:j]:
                ctx.report(stage.name)
                with ctx.timer.stage(stage.reports_as, ctx.dock):
                    batch = io.read(stage)
                    io.write(stage, batch, STAGE_FUNCTIONS[stage.name](ctx, batch))
            if not (group and st.more):
                break
        i = j


def train_step(ctx: Context, step: int) -> dict:
    """One step on this worker; returns the metrics row on rank 0 (empty elsewhere)."""
    r = ctx.recipe
    ctx.timer = StageTimer()
    t_step = time.time()
    ctx.use_dock(step)
    trips0, wait0 = ctx.dock.round_trips, ctx.dock.wait_s
    if ctx.role == Role.BOTH:
        ctx.version = step  # colocated: the rollout always holds the current weights; rank 0's
        # rollout stage resets the dock and allocates the step's groups in one call
    else:  # the rollout workers fill this step's dock; the prompt order advances in step with theirs
        ctx.sampler.next_indices(r.trainer.global_batch)
    ctx.cache.clear(step)
    # no barrier: the previous step ended in a collective (the facts' all-gather below), and a
    # worker's first dock write this step follows rank 0's reset (the rows come from its broadcast)
    ctx.actor.onload()
    st = StepState(step=step, target=r.trainer.global_batch)
    run_stages(ctx, step_io(ctx, st))
    ctx.dock.flush()  # this worker's last writes are committed (or their failure raised) within the step
    step_s = time.time() - t_step
    gathered = all_gather_objects(step_facts(ctx, st, trips0, wait0), device=ctx.device)
    ctx.stop_after_step = reward_failed(ctx, gathered)
    if ctx.role == Role.BOTH and ctx.rank == 0 and step + 1 < ctx.end_step and not ctx.stop_after_step:
        # every worker has flushed this step's writes (the gather above follows each one's flush):
        # the next step's reset goes out now and is answered while this one's row is assembled
        ctx.docks[(step + 1) % len(ctx.docks)].reset_ahead(step + 1, groups=(r.trainer.global_batch,
                                                                               r.trainer.n_samples_per_prompt))
    if not ctx.leader:
        return {}
    row = metrics_row(ctx, st, gathered, step_s)
    if ctx.progress is not None:
        ctx.progress.metrics.remote(row)
    return row


def rollout_step(ctx: Context, step: int) -> None:
    """A rollout worker's step (disaggregated placement): take the policy version this step may use
    (at most ``max_staleness`` behind), then generate the step's groups into its dock."""
    r = ctx.recipe
    k = r.algorithm.max_staleness
    ctx.timer = StageTimer()
    t0 = time.time()
    while ctx.version < step - k:  # the trainers publish version v after their step v - 1
        ctx.stage = "weights"
        receive_weights(ctx)
        ctx.version += 1
    t_weights = time.time() - t0
    ctx.use_dock(step)
    if ctx.rank == 0:
        ctx.dock.reset(step)  # its previous step (step - k - 1) was trained before that version came
    dist.barrier()
    ctx.stage = "rollout"
    st = StepState(step=step, target=r.trainer.global_batch)
    run_stages(ctx, step_io(ctx, st))
    ctx.dock.flush()
    synced, ctx.synced_bytes = ctx.synced_bytes, 0
    agent = {}
    if ctx.agent is not None:  # the agent loop's numbers, summed over the rollout workers
        from ..agent.loop import agent_metrics

        sums = [g for g in all_gather_objects(st.sums, device=ctx.device)]
        agent = agent_metrics({k: sum(g.get(k, 0) for g in sums) for k in set().union(*sums)})
    if ctx.rank == 0 and ctx.progress is not None:
        t = ctx.timer
        ctx.progress.rollout.remote(step, {
            "timing_s/rollout": round(t.seconds["rollout"], 4), "compute_s/rollout": round(t.compute["rollout"], 4),
            "async/weights_wait_s": round(t_weights, 4), "async/policy_version": ctx.version, **agent,
            **st.rollout, **sync_metrics(ctx, synced)})
