"""The stage functions: each is an algorithm's step, ``(ctx, batch) -> writes``.

Which stages run, in which order, what each reads and writes and how its rows are shared out is
declared by the algorithm (``algos/spec.py``). A stage gets exactly its declared reads in
``batch`` and returns exactly its declared writes; how they travel (own rows, dock claims, the
TensorCache) is the stage's share and the step's I/O object (``shares.py``, ``stage_io.py``), so
nothing here branches on the placement. Each function is registered with :func:`stage` under the
name of the stage it runs, and has that name.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..algos import overlong_reward_penalty
from ..algos.spec import actor_loss_fn, critic_loss_fn, gae_advantages, outcome_advantages
from ..engines.base import SamplingParams
from .batching import global_counts
from .context import Context
from .stage_io import StageBatch

StageFn = Callable[[Context, StageBatch], dict]
#: stage name -> the function that runs it
STAGE_FUNCTIONS: dict[str, StageFn] = {}


def stage(*names: str) -> Callable[[StageFn], StageFn]:
    """Register a stage function under the names of the stages it runs (``Stage.name``)."""
    def register(fn: StageFn) -> StageFn:
        for name in names:
            if name in STAGE_FUNCTIONS:
                raise ValueError(f"stage function {name!r} is registered twice")
            STAGE_FUNCTIONS[name] = fn
        return fn
    return register


def seed_of(*parts: Any) -> int:
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:7], "little")


# ------------------------------------------------------------------------------ generation
@stage("rollout")
def rollout(ctx: Context, b: StageBatch) -> dict:
    """Generate n responses for each of this DP rank's new prompt groups."""
    r, st, n, eng = ctx.recipe, b.state, ctx.recipe.trainer.n_samples_per_prompt, b.engine
    prompt_idx = ctx.sampler.next_indices(st.target)  # identical on every rank
    prompts = [p for g in b.new.groups for p in [torch.tensor(ctx.dataset[prompt_idx[g]]["prompt_ids"],
                                                              dtype=torch.long)] * n]  # a group shares one tensor
    index = [prompt_idx[g] for g in b.new.groups for _ in range(n)]
    t0 = time.perf_counter()
    eng.wake()
    s = r.rollout.sampling
    params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                            top_k=s.top_k, eos_token_id=ctx.eos_id, pad_token_id=ctx.pad_id)
    seed = seed_of(r.trainer.seed, st.step, st.round)
    writes: dict = {}
    if ctx.agent is not None:  # multi-turn: the agent loop over a turn session of the engine
        writes = _agent_rollout(ctx, b, prompts, index, params, seed)
    else:
        # every rank calls generate, with no prompts too: vLLM's DP-attention ranks step together
        images = ctx.data.images(index)  # a VL dataset: the prompts' pixels, by reference
        out = eng.generate(prompts, params, seed=seed, **({"images": images} if images is not None else {}))
        writes = {"response_ids": out.responses, "rollout_log_probs": out.log_probs}
        if "routed_experts" in b.stage.writes:  # MoE routing replay: the experts every token used
            writes["routed_experts"] = out.routed_experts
    eng.sleep()
    ctx.timer.add_compute(b.stage.reports_as, time.perf_counter() - t0)
    st.add(gen_groups=st.target)
    if not prompts:
        return {}
    return {"prompt_ids": prompts, "prompt_index": torch.tensor(index),
            "policy_version": torch.full((len(prompts),), ctx.version, dtype=torch.long), **writes}


def _agent_rollout(ctx: Context, b: StageBatch, prompts: list, index: list, params: SamplingParams,
                   seed: int) -> dict:
    """The agent loop (rlrecipes/agent/loop.py) over the rollout engine's turn session."""
    import dataclasses

    from ..agent.loop import agent_sums

    if not prompts:
        return {}
    from ..agent.spmd import LeaderSession, follow

    params = dataclasses.replace(params, stop_token_ids=ctx.agent.stop_token_ids())
    images = ctx.data.images(index)  # a VL dataset: the first turn's images, kept for every later turn
    session = b.engine.open_session(prompts, params, seed=seed, **({"images": images} if images is not None else {}))
    group, leader = b.engine.model_parallel_group()  # an instance over several ranks: its leader runs the loop
    try:
        if group is None or dist.get_rank() == leader:
            lead = session if group is None else LeaderSession(session, group, leader)
            try:
                traj = ctx.agent.run(lead, len(prompts), [ctx.dataset[i].get("tool_kwargs") for i in index])
            except Exception as e:
                if group is not None:
                    lead.fail(e)
                raise
            if group is not None:
                lead.finish([(t.response_ids, t.response_mask, t.log_probs) for t in traj])
            b.state.add(**agent_sums(traj))  # once per instance
            traj = [(t.response_ids, t.response_mask, t.log_probs) for t in traj]
        else:
            traj = follow(session, group, leader)
    finally:
        session.close()
    return {"response_ids": [t[0] for t in traj], "response_mask": [t[1] for t in traj],
            "rollout_log_probs": [t[2] for t in traj]}


@stage("reward")
def reward(ctx: Context, b: StageBatch) -> dict:
    """Score this round's rows; check each was generated within ``max_staleness`` versions."""
    st = b.state
    st.round += 1
    if not len(b):  # a rollout TP peer that holds no rows, or a worker with no share this round
        return {}
    check_versions(ctx, st, b["policy_version"])
    masks = list(b["response_mask"]) if "response_mask" in b.stage.reads else None
    scores, raw, n_err, first = score_rows(ctx, list(b["response_ids"]), b["prompt_index"].tolist(), masks)
    st.add(reward_sum=float(raw.sum()), reward_n=len(b), errors=n_err)
    st.first_error = st.first_error or first
    return {"scores": scores, "acc": raw}


@stage("pool_reward")
def pool_reward(ctx: Context, b: StageBatch) -> dict:
    """A pooled rollout scored its groups (``workflow/pool.py``): check the rows' policy versions and
    every token's (within ``algorithm.max_token_staleness``), and count the scores into the step's
    reward."""
    st = b.state
    st.round += 1
    if not len(b):
        return {}
    check_versions(ctx, st, b["policy_version"])
    lags = torch.cat([st.step - v.reshape(-1).long() for v in b["token_versions"]])  # [tokens]
    if lags.numel():
        bound = ctx.recipe.algorithm.token_staleness
        if int(lags.max()) > bound:  # the pool regenerates such samples: a broken pool, never trained on
            raise RuntimeError(f"step {st.step} was handed response tokens {int(lags.max())} policy versions old, "
                               f"past algorithm.max_token_staleness={bound}")
        st.add(token_stale_sum=int(lags.sum()), token_n=int(lags.numel()))
        st.peak(token_stale_max=int(lags.max()))
    st.add(reward_sum=float(b["acc"].sum()), reward_n=len(b))
    return {}


def check_versions(ctx: Context, st, versions: torch.Tensor) -> None:
    """Every row's policy version within ``[step - max_staleness, step]`` (else the dock ring is
    broken: an error, never trained on); the lag goes into ``async/staleness_*``."""
    lag = st.step - versions  # policy versions behind the weights being trained
    k = ctx.recipe.algorithm.max_staleness
    if int(lag.max()) > k or int(lag.min()) < 0:
        raise RuntimeError(f"step {st.step} was handed samples of policy versions "
                           f"{sorted(set(versions.tolist()))}, outside [step - {k}, step] "
                           f"(algorithm.max_staleness={k})")
    st.add(stale_sum=int(lag.sum()))
    st.peak(stale_max=int(lag.max()))


def score_rows(ctx: Context, responses: list, index: list, masks: list | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, int, str | None]:
    """The reward of each response (``rewards.score_batch``, the format bonus, the overlong shaping):
    ``(scores [rows], raw [rows], errors, first error)``; ``raw`` is the reward before shaping."""
    from ..rewards import format_reward, score_batch

    r = ctx.recipe
    answers = [ctx.dataset[int(i)]["answer"] for i in index]
    if masks is not None:  # multi-turn: the final answer, and the whole trajectory
        from ..agent import get_format
        from ..agent.setup import tool_format_name

        fmt = get_format(tool_format_name(r))
        trajectories = [_messages(ctx.tokenizer, fmt, x, m) for x, m in zip(responses, masks)]
        texts = [t["final"] for t in trajectories]
    else:
        trajectories = None
        texts = ctx.tokenizer.batch_decode([x.tolist() for x in responses], skip_special_tokens=True)
    scores, n_err, first = score_batch(ctx.reward_fn, texts, answers, trajectories)
    scores = torch.tensor(scores, dtype=torch.float32)  # [rows]
    if r.reward.format_weight:
        scores += r.reward.format_weight * torch.tensor([format_reward(t) for t in texts])
    raw = scores.clone()
    ov = r.algorithm.overlong
    if ov.enabled:
        scores = scores + overlong_reward_penalty(torch.tensor([x.numel() for x in responses]),
                                                  max_response_len=r.rollout.max_response_len,
                                                  buffer_len=ov.buffer_len, penalty_factor=ov.penalty_factor)
    return scores, raw, n_err, first


def _messages(tokenizer, fmt, response_ids: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """A multi-turn response as chat messages (the reward's ``messages`` / ``tool_results``: one
    ``tool`` message per result, its content as the tool gave it) and its final answer: the text of
    the model's last segment after its last tool turn ("" when the response ends on an observation)."""
    from ..agent.loop import segments

    msgs: list[dict] = []
    for model, ids in segments(response_ids, response_mask):
        if model:
            msgs.append({"role": "assistant", "content": tokenizer.decode(ids.tolist(), skip_special_tokens=True)})
        else:
            text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
            msgs += [{"role": "tool", "content": x} for x in fmt.results_of(text)]
    final = msgs[-1]["content"] if msgs and msgs[-1]["role"] == "assistant" else ""
    return {"messages": msgs, "tool_results": [m["content"] for m in msgs if m["role"] == "tool"], "final": final}


@stage("dynamic_sampling")
def dynamic_sampling(ctx: Context, b: StageBatch) -> dict:
    """DAPO: groups whose metric is constant are dropped; more rounds until the batch is full. Every
    worker holds the whole round and reaches the same verdict."""
    from ..algos import dynamic_sampling_filter

    r, st, n = ctx.recipe, b.state, ctx.recipe.trainer.n_samples_per_prompt
    [col] = b.stage.reads
    groups = [b.rows[i:i + n] for i in range(0, len(b.rows), n)]
    res = dynamic_sampling_filter(b[col].float(), torch.arange(len(b.rows)) // n)
    kept = set(int(g) for g in res.kept_group_ids)
    b.drop_rows([x for g, rs in enumerate(groups) if g not in kept for x in rs])
    st.kept_rows = st.kept_rows + [rs for g, rs in enumerate(groups) if g in kept]
    st.add(ds_kept=len(kept), ds_dropped=len(groups) - len(kept))
    st.more = len(st.kept_rows) < st.target and st.round < r.algorithm.dynamic_sampling.max_gen_batches
    if not st.more and len(st.kept_rows) > st.target:  # trim the surplus groups
        b.drop_rows([x for g in st.kept_rows[st.target:] for x in g])
    return {}


# ------------------------------------------------------------------------------ forward passes
@stage("ref", "old", "values")
def forward_pass(ctx: Context, b: StageBatch) -> dict:
    """The stage's engine over its rows: one per-token column (log-probs or values)."""
    engine = b.engine
    if not b.rows and engine.dp_size == 1:
        return {}
    t0 = time.perf_counter()
    out, _ = engine.forward(b.seq_batch())
    ctx.timer.add_compute(b.stage.reports_as, time.perf_counter() - t0)
    [col] = b.stage.writes
    return {col: out} if b.rows else {}


# ------------------------------------------------------------------------------ advantages
@stage("outcome_advantage")
def outcome_advantage(ctx: Context, b: StageBatch) -> dict:
    """GRPO / DAPO: group-normalised outcome advantage, one number per sample."""
    if not b.rows:
        return {}
    n = ctx.recipe.trainer.n_samples_per_prompt
    adv = outcome_advantages(ctx.recipe.algorithm, b["scores"].float(), torch.arange(len(b.rows)) // n)  # [rows]
    return {"advantages": adv.contiguous()}


@stage("gae")
def gae(ctx: Context, b: StageBatch) -> dict:
    """PPO: token rewards (score on the last token, optional KL-in-reward), critic values, GAE."""
    if not b.rows:
        return {}
    alg = ctx.recipe.algorithm
    use_ref = "ref_log_probs" in b.stage.reads
    adv, ret = gae_advantages(alg, scores=b["scores"].float(), responses=list(b["response_ids"]),
                              values=list(b["values"]), rollout_log_probs=list(b["rollout_log_probs"]),
                              ref_log_probs=list(b["ref_log_probs"]) if use_ref else None,
                              kl_coef=ctx.kl_ctl.value,
                              masks=list(b["response_mask"]) if "response_mask" in b.stage.reads else None)
    return {"advantages": adv, "returns": ret}


# ------------------------------------------------------------------------------ updates
@stage("update")
def update(ctx: Context, b: StageBatch) -> dict:
    """Actor: LR warm-up, then one optimizer step per mini-batch, ppo_epochs passes over the batch."""
    from .step_metrics import update_metrics

    r, alg, actor = ctx.recipe, ctx.recipe.algorithm, ctx.actor
    use_ref = "ref_log_probs" in b.stage.reads
    if r.trainer.warmup_steps:
        actor.set_lr(r.trainer.lr * min(1.0, (ctx.step + 1) / r.trainer.warmup_steps))
    t0 = time.perf_counter()
    out: dict = {}
    mismatch: dict[str, list[float]] = {}  # rollout-vs-train sums/maxes over the mini-batches of epoch 0
    for epoch in range(alg.ppo_epochs):
        for batch, (g_tokens, g_seqs, _) in zip(b.mini_batches, b.counts):
            if not g_seqs:
                continue
            agg = dict(global_tokens=g_tokens, global_seqs=g_seqs, norm_len=r.rollout.max_response_len,
                       dp_size=actor.dp_size)
            loss_fn = actor_loss_fn(alg, agg=agg, kl_coef=ctx.kl_ctl.value, use_ref=use_ref, dp_size=actor.dp_size)
            out = actor.train_step(batch, loss_fn, with_entropy=bool(alg.entropy_coef))
            if epoch == 0:
                for k in [k for k in out if k.startswith("rollout/")]:
                    mismatch.setdefault(k, []).append(out.pop(k))
            out = {k: v for k, v in out.items() if not k.startswith("rollout/")}
    ctx.timer.add_compute(b.stage.reports_as, time.perf_counter() - t0)
    totals = [sum(c[i] for c in b.counts) for i in range(3)]
    b.state.update = update_metrics(ctx, out, totals, mismatch, use_ref)
    return {}


@stage("critic_update")
def critic_update(ctx: Context, b: StageBatch) -> dict:
    r, critic = ctx.recipe, ctx.critic
    batch = b.seq_batch()
    [(g_tokens, g_seqs, _)] = global_counts(critic, [batch])
    if not g_seqs:
        return {}
    agg = dict(global_tokens=g_tokens, global_seqs=g_seqs, norm_len=r.rollout.max_response_len,
               dp_size=critic.dp_size)
    t0 = time.perf_counter()
    b.state.critic = critic.train_step(batch, critic_loss_fn(r.algorithm, agg=agg))
    ctx.timer.add_compute(b.stage.reports_as, time.perf_counter() - t0)
    return {}


# ------------------------------------------------------------------------------ weights
def _counted(ctx: Context, buckets):
    """The resharder's buckets on their way into the rollout engine, their elements added to
    ``ctx.synced_bytes`` at the engine's weight dtype (``reshard/bytes``: what the engine really
    loaded; colocated, the buckets may still be the trainer's fp32 master tensors)."""
    size = torch.empty((), dtype=ctx.rollout.weight_dtype).element_size()
    for bucket in buckets:
        ctx.synced_bytes += sum(t.numel() for _, t in bucket) * size
        yield bucket


def reshard_weights(ctx: Context) -> None:
    """Train layout -> rollout layout, bucket by bucket, straight into the rollout engine."""
    ctx.actor.onload()
    ctx.rollout.update_weights(_counted(ctx, ctx.resharder.reshard(ctx.actor.local_shards())))
    if ctx.recipe.resharding.swap_optimizer or ctx.recipe.resharding.swap_grads:
        ctx.actor.offload()  # no-op on CPU; on accelerators frees the device for the KV cache


def send_weights(ctx: Context) -> None:
    """Disaggregated placement, a train rank: the actor's current weights across the bridge (each
    rank its own pieces, no gather)."""
    ctx.actor.onload()
    for _ in ctx.resharder.reshard(ctx.actor.local_shards()):
        pass  # a train rank only sends


def announce_version(store, version: int) -> None:
    """``version`` is about to be sent. The key of the one before goes: its send completed, so the
    rollout has it (one key lives in the store however long the run)."""
    store.set(f"version/{version}", b"1")
    store.delete_key(f"version/{version - 1}")


def version_waiting(store, version: int) -> bool:
    """Whether the trainers announced ``version`` (and so wait in :func:`send_weights` to send it)."""
    return store.check([f"version/{version}"])


def receive_weights(ctx: Context) -> None:
    """Disaggregated placement, a rollout rank: a new policy version, bucket by bucket into the engine."""
    ctx.rollout.update_weights(_counted(ctx, ctx.resharder.reshard({})))


@stage("reshard")
def reshard(ctx: Context, b: StageBatch) -> dict:
    reshard_weights(ctx)
    return {}


@stage("publish")
def publish(ctx: Context, b: StageBatch) -> dict:
    """Send the version this step produced, if a later rollout step will use it (max_staleness)."""
    v = b.state.step + 1
    if v + ctx.recipe.algorithm.max_staleness < ctx.end_step:
        if ctx.rank == 0 and ctx.recipe.rollout.partial:
            announce_version(ctx.signals, v)  # a partial rollout stops between chunks to take it
        send_weights(ctx)
    return {}
