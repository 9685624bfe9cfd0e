"""A step's numbers: the update's reduction over data-parallel ranks, every worker's facts, and the
metrics row rank 0 sends to the driver (docs/workflow.md lists the keys)."""
from __future__ import annotations

from typing import Any

import torch

from .. import device as dev
from ..algos.spec import pooled_rollout
from ..metrics import COMPUTE_STAGES, dispatch_skew, tps_per_card
from .batching import all_gather
from .context import Context
from .stage_io import StepState


def sync_metrics(ctx: Context, synced: int) -> dict:
    """``reshard/bytes``: the weight bytes a rollout engine loaded this step (colocated: the most any
    did; disaggregated: rollout rank 0's); with LoRA also ``reshard/full_bytes``, what a full-weight
    sync would hand the largest rollout shard."""
    return {"reshard/bytes": int(synced), **({"reshard/full_bytes": ctx.full_sync_bytes} if ctx.full_sync_bytes else {})}


def step_facts(ctx: Context, st: StepState, trips0: int, wait0: float) -> dict:
    """This worker's small facts of the step, all-gathered for the row."""
    t, mem = ctx.timer, dev.memory_stats(ctx.device)
    synced, ctx.synced_bytes = ctx.synced_bytes, 0
    return {"synced": synced, "starts": t.starts, "seconds": t.seconds, "compute": t.compute, "peak": mem.peak_bytes,
            "dock_trips": ctx.dock.round_trips - trips0, "dock_wait": ctx.dock.wait_s - wait0,
            "dock_stage": t.dock_wait, "sums": st.sums, "maxes": st.maxes, "first_error": st.first_error}


_MISMATCH = ["rollout/logprob_diff_sum", "rollout/tokens_sum", "rollout/is_weight_sum", "rollout/is_capped_sum"]
# per-rank sums of per-micro-batch terms, summed over the ranks; the losses carry the DP-size factor
# that offsets the gradient averaging over DP (algos/losses.py), the closure's kl does not
_CLOSURE = {"actor/loss": True, "actor/kl": False, "actor/pg_loss": True}


def update_metrics(ctx: Context, out: dict, totals: list[float], parts: dict[str, list[float]],
                   use_ref: bool) -> dict:
    """The update's row entries, reduced over DP ranks (data leaders only) from one all-gather: the
    loss and the closure's kl / pg_loss (per-rank means of per-micro-batch contributions, so summed),
    ``rollout/logprob_diff_mean`` / ``_max`` (|pi_train - pi_rollout| over response tokens) and the
    importance-weight statistics over the mini-batches of epoch 0."""
    lead = ctx.actor.is_data_leader
    n_micro = out.pop("actor/micro_batches", 1) if out else 1
    mine = torch.tensor([sum(parts.get(k, [0.0])) if lead else 0.0 for k in _MISMATCH]
                        + [out.get(k, 0.0) * n_micro if lead else 0.0 for k in _CLOSURE]
                        + [max(parts.get("rollout/logprob_diff_max", [0.0]))], dtype=torch.float64)
    every = torch.stack(all_gather(mine))  # one collective for the sums and the max
    diff, tokens, wsum, capped, *closure = every[:, :-1].sum(0).tolist()
    mx = float(every[:, -1].max())
    if not out:
        return {"actor/skipped_step": 1.0, "tokens": 0}
    dp = max(ctx.actor.dp_size, 1)
    out.update({k: v / dp if scaled else v for (k, scaled), v in zip(_CLOSURE.items(), closure) if k in out})
    g_tokens, g_seqs, g_prompt_tokens = totals
    out.update({"tokens": g_tokens + g_prompt_tokens, "response_tokens": g_tokens, "samples": g_seqs})
    if tokens:
        out.update({"rollout/logprob_diff_mean": diff / tokens, "rollout/logprob_diff_max": float(mx)})
        if ctx.recipe.algorithm.rollout_correction != "none":
            out.update({"rollout/is_weight_mean": wsum / tokens, "rollout/is_capped_frac": capped / tokens})
    if use_ref and "actor/kl" in out:
        ctx.kl_ctl.update(out["actor/kl"], int(g_seqs))
    return out



def reward_failed(ctx: Context, gathered: list[dict]) -> bool:
    """Whether the step's reward calls failed above ``reward.max_failure_rate``: read from the
    all-gathered facts, so every train worker decides the same and they stop together after this
    step (the driver says why from rank 0's row, :func:`rlrecipes.metrics.reward_failure`). A
    pooled rollout's rollout workers score, so their trainers never stop for it."""
    if pooled_rollout(ctx.recipe):
        return False
    errors = sum(g["sums"].get("errors", 0) for g in gathered)
    calls = sum(g["sums"].get("reward_n", 0) for g in gathered)
    return bool(calls) and errors / calls > ctx.recipe.reward.max_failure_rate


def metrics_row(ctx: Context, st: StepState, gathered: list[dict], step_s: float) -> dict[str, Any]:
    """Rank 0's row of the step from every worker's facts (:func:`step_facts`)."""
    r = ctx.recipe
    upd, crit = st.update, st.critic
    cards = ctx.world / r.resources.dies_per_card
    tokens = int(upd.get("tokens", 0))
    total = {k: sum(g["sums"].get(k, 0) for g in gathered) for k in set().union(*(g["sums"] for g in gathered))}
    rsum, rn = total.get("reward_sum", 0.0), total.get("reward_n", 0)
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
        "async/staleness_mean": total.get("stale_sum", 0) / rn if rn else 0.0,
        "async/staleness_max": max(g["maxes"].get("stale_max", 0) for g in gathered),
        "reward/errors": total.get("errors", 0),
        "reward/samples": rn,
        "reward/failure_rate": total.get("errors", 0) / rn if rn else 0.0,  # raised or not finite
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
    if ctx.engines.rollout is not None:  # (disaggregated: the rollout workers report theirs)
        row.update(sync_metrics(ctx, max(g["synced"] for g in gathered)))
    if r.rollout.multi_turn.enabled:  # the agent loop's numbers, over every sample generated this step
        from ..agent.loop import agent_metrics

        row.update(agent_metrics(total))
    if total.get("token_n"):  # a pooled rollout: policy versions per response token
        row.update({"async/token_staleness_mean": total["token_stale_sum"] / total["token_n"],
                    "async/token_staleness_max": max(g["maxes"].get("token_stale_max", 0) for g in gathered)})
    if pooled_rollout(r):  # the rollout workers scored (and filtered) every group: their figures are the row's
        row["reward/trained_mean"] = row.pop("reward/mean")  # over the rows trained on
        for key in ("reward/errors", "reward/first_error", "reward/samples", "reward/failure_rate"):
            row.pop(key, None)
        return row
    if r.algorithm.dynamic_sampling.enabled:
        row.update({"dapo/gen_rounds": st.round, "dapo/kept_groups": st.sums.get("ds_kept", 0),
                    "dapo/dropped_groups": st.sums.get("ds_dropped", 0),
                    "dapo/generated_groups": st.sums.get("gen_groups", 0)})
    first = next((g["first_error"] for g in gathered if g["first_error"]), None)
    if first:
        row["reward/first_error"] = first
    return row
