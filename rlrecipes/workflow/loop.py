"""One worker's controller loop over the algorithm's stage DAG, and the step's metrics row.

Stages of one repeat group (DAPO's generation rounds) run again while dynamic sampling asks for
more groups. After the stages, one all-gather of small per-rank facts lets rank 0 assemble the
step's metrics row (docs/workflow.md lists the keys) and send it to the driver.
"""
from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from .. import device as dev
from ..core.collectives import all_gather_objects
from ..metrics import COMPUTE_STAGES, StageTimer, dispatch_skew, tps_per_card
from .context import Context
from .stages import RUNNERS, StepState, publish_or_receive, rollout


def run_stages(ctx: Context, st: StepState) -> None:
    stages = ctx.stages
    i = 0
    while i < len(stages):
        group = stages[i].repeat_group
        j = i + 1
        while group and j < len(stages) and stages[j].repeat_group == group:
            j += 1
        while True:
            for stage in stages[i:j]:
                ctx.report(stage.name)
                with ctx.timer.stage(stage.name, ctx.dock):
                    RUNNERS[stage.runner](ctx, st)
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
    if ctx.role == "both":
        ctx.version = step  # colocated: the rollout always holds the current weights; rank 0's
        # rollout stage resets the dock and allocates the step's groups in one call
    else:  # the rollout workers fill this step's dock; the prompt order advances in step with theirs
        ctx.sampler.next_indices(r.trainer.global_batch)
    ctx.cache.clear(step)
    # no barrier: the previous step ended in a collective (the facts' all-gather below), and a
    # worker's first dock write this step follows rank 0's reset (the rows come from its broadcast)
    ctx.actor.onload()
    st = StepState(step=step, target=r.trainer.global_batch)
    run_stages(ctx, st)
    ctx.dock.flush()  # this worker's last writes are committed (or their failure raised) within the step
    step_s = time.time() - t_step
    mem = dev.memory_stats(ctx.device)
    t = ctx.timer
    facts = {"starts": t.starts, "seconds": t.seconds, "compute": t.compute, "peak": mem.peak_bytes,
             "dock_trips": ctx.dock.round_trips - trips0, "dock_wait": ctx.dock.wait_s - wait0,
             "dock_stage": t.dock_wait, "stale_sum": st.staleness_sum, "stale_max": st.staleness_max,
             "reward_sum": st.reward_sum, "reward_n": st.reward_n, "errors": st.errors, "first_error": st.first_error}
    gathered = all_gather_objects(facts, device=ctx.device)
    if ctx.role == "both" and ctx.rank == 0 and step + 1 < ctx.end_step:
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
        publish_or_receive(ctx)
        ctx.version += 1
    t_weights = time.time() - t0
    ctx.use_dock(step)
    if ctx.rank == 0:
        ctx.dock.reset(step)  # its previous step (step - k - 1) was trained before that version came
    dist.barrier()
    st = StepState(step=step, target=r.trainer.global_batch)
    ctx.stage = "rollout"
    with ctx.timer.stage("rollout", ctx.dock):
        rollout(ctx, st)
        ctx.dock.flush()
    if ctx.rank == 0 and ctx.progress is not None:
        t = ctx.timer
        ctx.progress.rollout.remote(step, {
            "timing_s/rollout": round(t.seconds["rollout"], 4), "compute_s/rollout": round(t.compute["rollout"], 4),
            "async/weights_wait_s": round(t_weights, 4), "async/policy_version": ctx.version})


def metrics_row(ctx: Context, st: StepState, gathered: list[dict], step_s: float) -> dict[str, Any]:
    r = ctx.recipe
    upd, crit = st.update, st.critic
    cards = ctx.world / r.resources.dies_per_card
    tokens = int(upd.get("tokens", 0))
    rsum, rn = sum(g["reward_sum"] for g in gathered), sum(g["reward_n"] for g in gathered)
    stages = {k: max(g["seconds"].get(k, 0.0) for g in gathered) for k in ctx.timer.seconds}
    compute = sum(max(g["compute"].get(k, 0.0) for g in gathered) for k in COMPUTE_STAGES)
    row = {
        "step": st.step,
        "perf/tokens": tokens,
        "perf/tps_per_card": tps_per_card(tokens, step_s, cards),
        **{f"timing_s/{k}": round(v, 4) for k, v in stages.items()},
        **{f"compute_s/{k}": round(max(g["compute"].get(k, 0.0) for g in gathered), 4)
           for k in COMPUTE_STAGES if any(k in g["compute"] for g in gathered)},
        "timing_s/step": round(step_s, 4),
        "perf/dispatch_skew_s": round(dispatch_skew(g["starts"] for g in gathered), 4),
        "perf/overhead_share": round(max(0.0, 1.0 - compute / step_s), 4) if step_s > 0 else 0.0,
        # TransferDock: blocking calls and seconds waited per step (the busiest worker), per stage
        "dock/round_trips": max(g["dock_trips"] for g in gathered),
        "dock/wait_s": round(max(g["dock_wait"] for g in gathered), 4),
        **{f"dock_s/{k}": round(max(g["dock_stage"].get(k, 0.0) for g in gathered), 4)
           for k in ctx.timer.dock_wait},
        "reward/mean": rsum / rn if rn else float("nan"),
        # policy versions between the weights that generated a sample and the weights trained on it
        "async/staleness_mean": sum(g["stale_sum"] for g in gathered) / rn if rn else 0.0,
        "async/staleness_max": max(g["stale_max"] for g in gathered),
        "reward/errors": sum(g["errors"] for g in gathered),
        "reward/samples": rn,
        "actor/loss": upd.get("actor/loss"),
        "actor/pg_loss": upd.get("actor/pg_loss"),
        "actor/kl": upd.get("actor/kl", 0.0),
        "actor/clipfrac": upd.get("actor/clipfrac"),
        "actor/grad_norm": upd.get("actor/grad_norm"),
        "actor/skipped_step": upd.get("actor/skipped_step", 0.0),
        "response_length/mean": upd.get("response_tokens", 0) / max(upd.get("samples", 0), 1),
        "samples": int(upd.get("samples", 0)),
        **{k: v for k, v in crit.items() if k.startswith("critic/")},
        **{k: v for k, v in upd.items() if k.startswith("rollout/")},
        "mem/peak_gb": round(max(g["peak"] for g in gathered) / 2 ** 30, 4),
        "reshard/min_bytes": ctx.reshard_plan.min_bytes(0),
    }
    if r.algorithm.dynamic_sampling.enabled:
        row.update({"dapo/gen_rounds": st.round, "dapo/kept_groups": st.ds_kept,
                    "dapo/dropped_groups": st.ds_dropped, "dapo/generated_groups": st.gen_groups})
    first = next((g["first_error"] for g in gathered if g["first_error"]), None)
    if first:
        row["reward/first_error"] = first
    return row
