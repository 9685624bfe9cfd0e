"""The stage implementations one worker runs, looked up by a stage's ``runner`` name.

Which stages run, in which order, is declared by the algorithm (``algos/spec.py``); the worker's
controller loop (``workflow/loop.py``) calls ``RUNNERS[stage.runner](ctx, state)``. A stage pulls
its inputs from the TransferDock (sample data goes worker -> warehouse -> worker, never through the
driver) or from the TensorCache, and pushes its outputs back -- except on a colocated worker, whose
stages work on the rows it generated (``own_rows.py``) and write to the dock only once a stage must
claim re-balanced rows. Engines are used only through ``engines/base.py``.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..algos import overlong_reward_penalty
from ..algos.spec import (actor_loss_fn, critic_loss_fn, dynamic_sampling_column, gae_advantages,
                          outcome_advantages)
from ..engines.base import SamplingParams, SeqBatch
from ..core.collectives import all_gather_objects, broadcast_object
from .batching import (all_gather, gather_in_model_parallel_group, global_counts, local_counts,
                       seq_batch, subset, train_rows)
from .context import Context
from .own_rows import OwnRows


def seed_of(*parts: Any) -> int:
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:7], "little")


@dataclass
class StepState:
    """What the stages of one step share on one worker."""

    step: int
    target: int
    round: int = 0
    more: bool = False
    kept_rows: list = field(default_factory=list)
    gen_groups: int = 0
    ds_kept: int = 0
    ds_dropped: int = 0
    reward_sum: float = 0.0
    reward_n: int = 0
    errors: int = 0
    first_error: str | None = None
    staleness_sum: int = 0
    staleness_max: int = 0
    update: dict = field(default_factory=dict)
    critic: dict = field(default_factory=dict)
    own: OwnRows | None = None  # colocated: the rows this worker generated (workflow/own_rows.py)


# ------------------------------------------------------------------------------ generation
def rollout(ctx: Context, st: StepState) -> None:
    """Generate n responses for each of ``st.target`` new prompt groups (rows added by rank 0; a
    colocated step's first round starts the step's dock in the same call)."""
    r, n = ctx.recipe, ctx.recipe.trainer.n_samples_per_prompt
    eng = ctx.rollout
    if ctx.role == "both" and st.own is None:  # a rollout TP peer's stays empty
        st.own = OwnRows()
    rows = None
    if ctx.rank == 0:
        first = ctx.role == "both" and st.round == 0
        rows = ctx.dock.reset(st.step, groups=(st.target, n)) if first else ctx.dock.add_groups(st.target, n)
    rows = broadcast_object(rows, device=ctx.device)  # as is on one rank
    prompt_idx = ctx.sampler.next_indices(st.target)  # identical on every rank
    mine = list(range(eng.dp_rank, st.target, eng.dp_size))
    group_prompts = [torch.tensor(ctx.dataset[prompt_idx[g]]["prompt_ids"], dtype=torch.long) for g in mine]
    prompts = [p for p in group_prompts for _ in range(n)]  # a group's samples share one (read-only) tensor
    my_rows = [rows[g * n + j] for g in mine for j in range(n)]
    t0 = time.perf_counter()
    eng.wake()
    # every rank calls generate, with no prompts too: vLLM's DP-attention ranks step together
    s = r.rollout.sampling
    params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                            top_k=s.top_k, eos_token_id=ctx.eos_id, pad_token_id=ctx.pad_id)
    out = eng.generate(prompts, params, seed=seed_of(r.trainer.seed, st.step, st.round))
    if prompts:
        if eng.is_data_leader:
            cols = {"prompt_ids": prompts, "response_ids": out.responses,
                    "prompt_index": torch.tensor([prompt_idx[g] for g in mine for _ in range(n)]),
                    "rollout_log_probs": out.log_probs,
                    "policy_version": torch.full((len(prompts),), ctx.version, dtype=torch.long)}
            if out.routed_experts is not None:  # MoE routing replay: the experts every token used
                cols["routed_experts"] = out.routed_experts
            if st.own is not None:
                st.own.add(my_rows, cols)  # the dock gets them if a stage claims them (OwnRows.publish)
            else:
                ctx.dock.put(cols, my_rows)
    eng.sleep()
    ctx.timer.add_compute("rollout", time.perf_counter() - t0)
    st.gen_groups += st.target


_REWARD_COLS = ["response_ids", "prompt_index", "policy_version"]


def reward(ctx: Context, st: StepState) -> None:
    """Score this round's rows. A colocated worker scores the rows it generated itself (whole
    groups, equal counts per DP rank: no dock read, and its outcome advantage needs none either);
    otherwise the rows come from the dock, balanced over the workers."""
    from ..rewards import format_reward, score_batch

    r = ctx.recipe
    if st.own is not None:
        b = st.own.unscored(_REWARD_COLS)
    else:
        b = ctx.dock.get("reward", _REWARD_COLS, None, dp_rank=ctx.rank, dp_size=ctx.world,
                         timeout=r.trainer.dock_timeout_s)
    st.round += 1
    if not len(b):  # a rollout TP peer that holds no rows, or a DP rank with no share this round
        return
    lag = st.step - b["policy_version"]  # policy versions behind the weights being trained
    k = r.algorithm.max_staleness
    if int(lag.max()) > k or int(lag.min()) < 0:
        raise RuntimeError(f"step {st.step} was handed samples of policy versions "
                           f"{sorted(set(b['policy_version'].tolist()))}, outside [step - {k}, step] "
                           f"(algorithm.max_staleness={k})")
    st.staleness_sum += int(lag.sum())
    st.staleness_max = max(st.staleness_max, int(lag.max()))
    texts = ctx.tokenizer.batch_decode([x.tolist() for x in b["response_ids"]], skip_special_tokens=True)
    answers = [ctx.dataset[int(i)]["answer"] for i in b["prompt_index"]]
    scores, n_err, first = score_batch(ctx.reward_fn, texts, answers)
    scores = torch.tensor(scores, dtype=torch.float32)  # [rows]
    if r.reward.format_weight:
        scores += r.reward.format_weight * torch.tensor([format_reward(t) for t in texts])
    raw = scores.clone()
    ov = r.algorithm.overlong
    if ov.enabled:
        scores = scores + overlong_reward_penalty(b.lengths("response_ids"),
                                                  max_response_len=r.rollout.sampling.max_new_tokens,
                                                  buffer_len=ov.buffer_len, penalty_factor=ov.penalty_factor)
    if st.own is not None:
        st.own.add_scores(scores, acc=raw)
    else:
        ctx.dock.put({"scores": scores, "acc": raw}, b.rows)
    st.reward_sum += float(raw.sum())
    st.reward_n += len(b)
    st.errors += n_err
    st.first_error = st.first_error or first


def dynamic_sampling(ctx: Context, st: StepState) -> None:
    """DAPO: groups whose metric is constant are dropped; more rounds until the batch is full."""
    r = ctx.recipe
    ds = r.algorithm.dynamic_sampling
    col, n = dynamic_sampling_column(r.algorithm), r.trainer.n_samples_per_prompt
    decision = None
    if st.own is not None:  # colocated: every worker's own scores by one small all-gather, and each
        # rank reaches the same verdict (nothing of these rows is in the dock yet: OwnRows.publish)
        mine = st.own.last_scored(col)
        every = all_gather_objects((mine[0], mine[1].tolist()), device=ctx.device)
        pairs = sorted((x, float(v)) for rs, vs in every for x, v in zip(rs, vs))  # row order, as the dock's
        rows, metric = [x for x, _ in pairs], torch.tensor([v for _, v in pairs])
        decision = _filter_groups(ctx, st, rows, metric, n)
    elif ctx.rank == 0:
        b = ctx.dock.get("dynamic_sampling", [col], None, whole_groups=True, timeout=r.trainer.dock_timeout_s)
        decision = _filter_groups(ctx, st, list(b.rows), b[col].float(), n)
    d = decision if st.own is not None else broadcast_object(decision, device=ctx.device)
    st.kept_rows, st.ds_kept, st.ds_dropped = d["kept_rows"], st.ds_kept + d["kept"], st.ds_dropped + d["dropped"]
    st.more = len(st.kept_rows) < st.target and st.round < ds.max_gen_batches
    if not st.more:
        if ctx.rank == 0 and len(st.kept_rows) > st.target:  # trim the surplus groups
            ctx.dock.drop_rows([x for g in st.kept_rows[st.target:] for x in g], defer=st.own is not None)
        if st.own is None:
            dist.barrier()  # every rank sees the final batch before the next stage claims rows
        # colocated: every rank reached the same verdict itself, and rank 0's drops ride on its next
        # dock call; a claim (the only reader: none of these rows is in the dock yet) waits for them


# ------------------------------------------------------------------------------ forward passes
def _filter_groups(ctx: Context, st: StepState, rows: list[int], metric: torch.Tensor, n: int) -> dict:
    """The groups of ``rows`` (consecutive runs of ``n``) whose metric varies are kept; rank 0 drops the
    others from the dock (later claims must not see them)."""
    from ..algos import dynamic_sampling_filter

    groups = [rows[i:i + n] for i in range(0, len(rows), n)]
    res = dynamic_sampling_filter(metric.float(), torch.arange(len(rows)) // n)
    kept_g = set(int(g) for g in res.kept_group_ids)
    drop = [x for g, rs in enumerate(groups) if g not in kept_g for x in rs]
    if drop and ctx.rank == 0:
        ctx.dock.drop_rows(drop, defer=st.own is not None)  # colocated: see dynamic_sampling
    return {"kept_rows": st.kept_rows + [rs for g, rs in enumerate(groups) if g in kept_g],
            "kept": len(kept_g), "dropped": len(groups) - len(kept_g)}


def _routed(ctx: Context) -> list[str]:
    """The routing-replay column the actor's forwards read (when ``algorithm.routing_replay``)."""
    return ["routed_experts"] if ctx.recipe.algorithm.routing_replay else []


def _forward_stage(ctx: Context, st: StepState, engine, consumer: str, out_col: str,
                   extra: Sequence[str] = ()) -> None:
    cols = ["prompt_ids", "response_ids", *extra]
    if _on_own_rows(ctx, st, engine):  # the rows this worker generated, no dock claim
        data = st.own.select(cols, _live(ctx, st))
    else:
        _publish(ctx, st)
        data = train_rows(ctx, engine, consumer, cols)
    if not data["rows"] and engine.dp_size == 1:
        return
    t0 = time.perf_counter()
    out, _ = engine.forward(seq_batch(data))
    ctx.timer.add_compute(consumer, time.perf_counter() - t0)
    if engine.is_data_leader and data["rows"]:
        ctx.cache.put(out_col, data["rows"], out)
        if st.own is None or st.own.published:
            ctx.dock.mark_cached([out_col], data["rows"], ctx.rank)


def _publish(ctx: Context, st: StepState) -> None:
    """Before a claim of re-balanced rows (every worker reaches it: the config or a collective
    decision leads there), what a colocated step kept local goes to the dock."""
    if st.own is not None:
        st.own.publish(ctx.dock, ctx.cache, ctx.rank, _live(ctx, st))


def _on_own_rows(ctx: Context, st: StepState, engine) -> bool:
    """Colocated, and ``engine`` has one DP rank per worker as the rollout does: DP rank = the worker,
    so the rows this worker generated are a share the engine can run on in place."""
    return st.own is not None and engine.dp_size == ctx.rollout.dp_size == ctx.world


def ref(ctx: Context, st: StepState) -> None:
    _forward_stage(ctx, st, ctx.ref, "ref", "ref_log_probs")


def old(ctx: Context, st: StepState) -> None:
    _forward_stage(ctx, st, ctx.actor, "old", "old_log_probs", _routed(ctx))


def values(ctx: Context, st: StepState) -> None:
    _forward_stage(ctx, st, ctx.critic, "values", "values")


# ------------------------------------------------------------------------------ advantages
def outcome_advantage(ctx: Context, st: StepState) -> None:
    """GRPO / DAPO: group-normalised outcome advantage, one number per sample."""
    r = ctx.recipe
    n = r.trainer.n_samples_per_prompt
    if st.own is not None:  # colocated: the whole groups this worker generated and scored
        d = st.own.select(["scores"], _live(ctx, st))
        rows, scores = d["rows"], d["scores"]
    else:
        b = ctx.dock.get("advantage", ["scores"], None, dp_rank=ctx.rank, dp_size=ctx.world,
                         whole_groups=True, timeout=r.trainer.dock_timeout_s)
        rows, scores = list(b.rows), b["scores"]
    if not rows:
        return
    adv = outcome_advantages(r.algorithm, scores.float(), torch.arange(len(rows)) // n)  # [rows]
    if st.own is not None:
        ctx.cache.put("advantages", rows, adv)  # the update reads them here, or publish() sends them
    if st.own is None or st.own.published:
        ctx.dock.put({"advantages": adv.contiguous()}, rows)


def _live(ctx: Context, st: StepState) -> set[int] | None:
    """The rows still in the batch when dynamic sampling dropped some (None: all of them)."""
    if not ctx.recipe.algorithm.dynamic_sampling.enabled:
        return None
    return {x for g in st.kept_rows[:st.target] for x in g}  # groups past the target were trimmed


def gae(ctx: Context, st: StepState) -> None:
    """PPO: token rewards (score on the last token, optional KL-in-reward), critic values, GAE."""
    r = ctx.recipe
    cached = ["values"] + (["ref_log_probs"] if ctx.use_ref else [])
    _publish(ctx, st)
    b = ctx.dock.get("advantage", ["scores", "response_ids", "rollout_log_probs"] + cached, None,
                     dp_rank=ctx.rank, dp_size=ctx.world, timeout=r.trainer.dock_timeout_s)
    got = ctx.cache.exchange_mine(cached, list(b.rows))
    if not len(b):
        return
    adv, ret = gae_advantages(r.algorithm, scores=b["scores"].float(), responses=list(b["response_ids"]),
                              values=got["values"], rollout_log_probs=list(b["rollout_log_probs"]),
                              ref_log_probs=got.get("ref_log_probs") if ctx.use_ref else None,
                              kl_coef=getattr(ctx.kl_ctl, "value", r.algorithm.kl_coef))
    ctx.dock.put({"advantages": adv, "returns": ret}, b.rows)


# ------------------------------------------------------------------------------ updates
def update(ctx: Context, st: StepState) -> None:
    """Actor: LR warm-up, then one optimizer step per mini-batch, ppo_epochs passes over the batch."""
    r, alg, actor = ctx.recipe, ctx.recipe.algorithm, ctx.actor
    kl_coef = getattr(ctx.kl_ctl, "value", alg.kl_coef)
    if r.trainer.warmup_steps:
        actor.set_lr(r.trainer.lr * min(1.0, (ctx.step + 1) / r.trainer.warmup_steps))
    batches, counts = _update_batches(ctx, st)
    t0 = time.perf_counter()
    out: dict = {}
    mismatch: dict[str, list[float]] = {}  # rollout-vs-train sums/maxes over the mini-batches of epoch 0
    for epoch in range(alg.ppo_epochs):
        for batch, (g_tokens, g_seqs, _) in zip(batches, counts):
            if not g_seqs:
                continue
            agg = dict(global_tokens=g_tokens, global_seqs=g_seqs, norm_len=r.rollout.sampling.max_new_tokens,
                       dp_size=actor.dp_size)
            loss_fn = actor_loss_fn(alg, agg=agg, kl_coef=kl_coef, use_ref=ctx.use_ref, dp_size=actor.dp_size)
            out = actor.train_step(batch, loss_fn, with_entropy=bool(alg.entropy_coef))
            if epoch == 0:
                for k in [k for k in out if k.startswith("rollout/")]:
                    mismatch.setdefault(k, []).append(out.pop(k))
            out = {k: v for k, v in out.items() if not k.startswith("rollout/")}
    ctx.timer.add_compute("update", time.perf_counter() - t0)
    totals = [sum(c[i] for c in counts) for i in range(3)]
    st.update = _update_metrics(ctx, out, totals, mismatch)


def _update_batches(ctx: Context, st: StepState) -> tuple[list[SeqBatch], list[tuple[float, float, float]]]:
    """This DP rank's mini-batches, and each one's global (response tokens, samples, prompt tokens).

    When every worker generated its own rows (the rollout has one DP rank per worker) and computed
    their advantages (and ref / old log-probs, if any) itself, each actor DP rank trains on the rows
    its workers generated -- the worker's own at TP = PP = 1, its model-parallel peers' merged by one
    all-gather in that group otherwise -- with no dock claim and no TensorCache all-to-all, as long as
    that keeps the DP ranks' loads (prompt + response tokens) within ``trainer.rebalance_tolerance``
    of their mean. One all-gather of the loads and the mini-batch counts decides, identically on
    every rank. Otherwise the dock re-balances the rows by tokens in one claim and the cached
    columns follow by one all-to-all.
    """
    r, actor = ctx.recipe, ctx.actor
    cached = (["ref_log_probs"] if ctx.use_ref else []) + ([] if ctx.skip_old else ["old_log_probs"])
    columns = ["prompt_ids", "response_ids", "advantages", "rollout_log_probs", *_routed(ctx)]
    per_token = cached + ["rollout_log_probs"]

    def mini_batches(data: dict) -> list[SeqBatch]:
        n = len(data["rows"])
        return [seq_batch(subset(data, list(range(n))[m::ctx.n_mini]), per_token=per_token)
                for m in range(ctx.n_mini)]

    # the same on every rank (the config decides): each worker generated its own rows (rollout DP =
    # worker), their advantages are its own, and so are the cached columns (ref / old on own rows)
    own = (st.own is not None and ctx.rollout.dp_size == ctx.world and r.algorithm.adv_estimator != "gae"
           and (not ctx.use_ref or _on_own_rows(ctx, st, ctx.ref))
           and (ctx.skip_old or _on_own_rows(ctx, st, actor)))
    if own:
        data = st.own.select([c for c in columns if c != "advantages"], _live(ctx, st))
        for c in ["advantages", *cached]:
            data[c] = ctx.cache.get(c, data["rows"])
        # a DP rank's rows: its model-parallel peers' own rows (just this worker's at TP = PP = 1)
        batches = mini_batches(gather_in_model_parallel_group(actor, data, ctx.device))
        counts = local_counts(actor, batches)  # zeros on a peer that is not its DP rank's leader
        lead = float(actor.is_data_leader)
        mine = torch.cat([torch.tensor([lead, float(counts[:, [0, 2]].sum())], dtype=torch.float64),
                          counts.reshape(-1).double()])  # [leader, load, counts]
        every = torch.stack(all_gather(mine))
        loads = every[every[:, 0] > 0, 1]  # one per DP rank
        if float(loads.max()) <= (1 + r.trainer.rebalance_tolerance) * float(loads.mean()):
            total = every[:, 2:].sum(0).reshape(-1, 3)
            return batches, [tuple(map(float, c)) for c in total.tolist()]
    _publish(ctx, st)
    batches = mini_batches(train_rows(ctx, actor, "update", columns, cached))
    return batches, global_counts(actor, batches)


_MISMATCH = ["rollout/logprob_diff_sum", "rollout/tokens_sum", "rollout/is_weight_sum", "rollout/is_capped_sum"]
# per-rank sums of per-micro-batch terms, summed over the ranks; the losses carry the DP-size factor
# that offsets the gradient averaging over DP (algos/losses.py), the closure's kl does not
_CLOSURE = {"actor/loss": True, "actor/kl": False, "actor/pg_loss": True}


def _update_metrics(ctx: Context, out: dict, totals: list[float], parts: dict[str, list[float]]) -> dict:
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
    if ctx.use_ref and "actor/kl" in out and hasattr(ctx.kl_ctl, "update"):
        ctx.kl_ctl.update(out["actor/kl"], int(g_seqs))
    return out


def critic_update(ctx: Context, st: StepState) -> None:
    r, critic = ctx.recipe, ctx.critic
    _publish(ctx, st)
    data = train_rows(ctx, critic, "critic_update", ["prompt_ids", "response_ids", "returns"], ["values"])
    batch = seq_batch(data, per_token=["values", "returns"])
    [(g_tokens, g_seqs, _)] = global_counts(critic, [batch])
    if not g_seqs:
        return
    agg = dict(global_tokens=g_tokens, global_seqs=g_seqs, norm_len=r.rollout.sampling.max_new_tokens,
               dp_size=critic.dp_size)
    t0 = time.perf_counter()
    st.critic = critic.train_step(batch, critic_loss_fn(r.algorithm, agg=agg))
    ctx.timer.add_compute("critic_update", time.perf_counter() - t0)


def reshard(ctx: Context, st: StepState | None = None) -> None:
    """Train layout -> rollout layout, bucket by bucket, straight into the rollout engine."""
    ctx.actor.onload()
    ctx.rollout.update_weights(ctx.resharder.reshard(ctx.actor.local_shards()))
    if ctx.recipe.resharding.swap_optimizer or ctx.recipe.resharding.swap_grads:
        ctx.actor.offload()  # no-op on CPU; on accelerators frees the device for the KV cache


def publish_or_receive(ctx: Context) -> None:
    """Disaggregated placement: the train ranks send the actor's current weights across the bridge
    (each its own pieces, no gather); the rollout ranks receive them bucket by bucket into the engine."""
    if ctx.role == "train":
        ctx.actor.onload()
        for _ in ctx.resharder.reshard(ctx.actor.local_shards()):
            pass  # a train rank only sends
    else:
        ctx.rollout.update_weights(ctx.resharder.reshard({}))


def publish(ctx: Context, st: StepState) -> None:
    """Send the version this step produced, if a later rollout step will use it (max_staleness)."""
    if st.step + 1 + ctx.recipe.algorithm.max_staleness < ctx.end_step:
        publish_or_receive(ctx)


RUNNERS: dict[str, Callable[[Context, StepState], None]] = {
    f.__name__: f for f in (rollout, reward, dynamic_sampling, ref, old, values, outcome_advantage, gae, update,
                            critic_update, reshard, publish)
}
