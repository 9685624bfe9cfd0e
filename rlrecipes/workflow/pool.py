"""A pooled rollout: generation that outlives a step (partial rollout, over-sampling, DAPO's filter
on the rollout side). Disaggregated placement only (``algos.spec.pooled_rollout``).

Reasoning RL has long-tailed response lengths: a synchronous step waits for its slowest sample. A
pooled rollout worker keeps a pool of prompt groups instead of one batch:

- **Over-sampling** (``rollout.oversample: f``): the pool holds ``ceil(f x batch)`` groups. Every
  unfinished sample generates ``rollout.chunk_tokens`` tokens at a time; after each chunk the
  rollout workers agree (one small all-gather) whether enough groups are complete. The step then
  commits the batch's worth of complete groups, oldest first, to its dock; the rest stay in the
  **carry-over dock** (``Context.carry_dock``) and continue in the next step. No group is dropped:
  a group leaves the pool only by being trained on (or by DAPO's filter, counted); a sample past
  the token-staleness bound is regenerated (below).
- **Partial rollout** (``rollout.partial``): between chunks the rollout also looks whether the
  trainers announced a new policy version (``stages.version_waiting``); if so it receives it, and
  the unfinished samples continue from their prefix under it (their KV cache rebuilt by a new
  session). Each response token records the version and the behaviour log-prob that produced it
  (``token_versions``, ``rollout_log_probs``); the trainer's decoupled loss corrects per token.
- **Dynamic sampling** (DAPO): a group is scored when it completes; a constant group is dropped
  there, and the rollout keeps generating (more rounds of new prompts when the pool runs dry, up to
  ``max_gen_batches``) until the batch has enough informative groups -- while the trainers train
  the previous batch.

**Staleness bounds.** A row's ``policy_version`` is the newest version among its group's tokens
(the version the group was finished under), and ``step - algorithm.max_staleness <= version`` holds
for every committed row. Every response token is bounded as well: ``step -
algorithm.max_token_staleness <= its version`` (the bound ``B`` defaults to ``max_staleness``; the
step's largest lag is ``async/token_staleness_max``, and the trainers' ``pool_reward`` stage refuses a
token past ``B``). ``rollout.on_stale`` says how the pool keeps it:

- ``regenerate`` (default): a carried sample whose oldest token is past ``B`` when a step starts is
  regenerated from its prompt under the current policy (:func:`restart_stale`;
  ``rollout/pool_restarted_samples``, ``_tokens``). Its later tokens were sampled after the stale
  ones, so none is kept. The group is not dropped: what goes stale is the long answer, and dropping
  would take the long tail out of training for good, while a restart keeps the prompt in the pool
  and costs the tokens thrown away.
- ``finish``: a group that would be past ``B`` at the next step is finished in this one (the step
  does not commit before it is complete, :func:`overdue`): nothing is thrown away, and the step
  waits for it.

A complete group that the next step could not take (a row or a token past its bound by then, or a
group at ``rollout.max_wait_steps``) is committed now rather than carried, so a step may train on
more than its batch (:func:`choose`; ``samples`` in the row).

A sample must thus be generated within about ``B`` steps. With ``B = 1`` no step can be much
shorter than the longest answer's generation if that answer is to be trained on: ``regenerate``
keeps steps short and restarts the long answers until the pool holds little else and a step has to
wait for them; ``finish`` waits at once (synchronous steps that train every complete group). Each
step reports how far its trained batch leans short: ``rollout/length_bias`` (the trained responses'
mean length against every response of the step's pool, the unfinished ones at their length so far,
less 1) with ``rollout/length_trained_mean``, ``_p90`` and ``rollout/length_pool_mean``, ``_p90``.
``rollout.max_wait_steps`` caps how many steps a group may wait after the step that drew it (the
step it reaches the cap does not commit before it is complete), which bounds the lean.
"""
from __future__ import annotations

import math
import time

import torch

from ..algos import dynamic_sampling_filter
from ..algos.spec import dynamic_sampling_column
from ..core.collectives import all_gather_objects
from ..engines.base import SamplingParams
from .context import Context
from .pool_rows import Group, Sample, row_columns
from .stage_io import StageBatch
from .stages import receive_weights, score_rows, seed_of, stage, version_waiting


# ---------------------------------------------------------------------------------------------- generation
class _Generation:
    """This rank's unfinished samples over one turn session of the rollout engine; reopened (the
    prefixes re-prefilled) after new weights load or new groups join."""

    def __init__(self, ctx: Context, params: SamplingParams, seed: int):
        self.ctx, self.params, self.seed = ctx, params, seed
        self.session, self.rows, self.opened = None, [], 0
        self.stops = set(params.ending_ids())

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        self.session, self.rows = None, []

    def chunk(self, groups: list[Group], chunk: int) -> int:
        """``chunk`` more tokens (at most) for every unfinished sample of ``groups``; returns the
        tokens generated."""
        todo = [(g, s) for g in groups for s in g.samples if not s.done]
        if not todo:
            return 0
        if self.session is not None and len(todo) * 2 < len(self.rows):
            self.close()  # most of the session's rows are finished, yet each decode step computes them all:
            # a new session over the unfinished ones (one prefill of their prefixes) is cheaper
        if self.session is None:
            self.rows = todo
            contexts = [torch.cat([g.prompt.reshape(-1).long(), torch.tensor(s.tokens, dtype=torch.long)])
                        for g, s in todo]
            self.session = self.ctx.rollout.open_session(contexts, self.params,
                                                         seed=seed_of(self.seed, self.opened))
            self.opened += 1
        where = {id(s): i for i, (_, s) in enumerate(self.rows)}
        cap = self.params.max_new_tokens
        limits = [min(chunk, cap - len(s.tokens)) for _, s in todo]
        out = self.session.generate([where[id(s)] for _, s in todo], [None] * len(todo), limits)
        made = 0
        for (_, s), want, resp, lp in zip(todo, limits, out.responses, out.log_probs):
            toks = resp.tolist()
            s.tokens += toks
            s.logps += lp.tolist()
            s.versions += [self.ctx.version] * len(toks)
            s.done = len(toks) < want or (bool(toks) and toks[-1] in self.stops) or len(s.tokens) >= cap
            made += len(toks)
        return made


def restart_stale(groups: list[Group], step: int, bound: int) -> tuple[int, int]:
    """Regenerate from the prompt every sample of ``groups`` whose oldest token is more than
    ``bound`` policy versions behind ``step``: it could never be trained at this step or a later one,
    and its later tokens were sampled after it, so none of its tokens is kept. The rest of its group
    stays; the group is unfinished again (its scores go). Returns (samples, tokens) restarted."""
    samples = tokens = 0
    for g in groups:
        stale = [s for s in g.samples if s.versions and s.versions[0] < step - bound]
        for s in stale:
            tokens += len(s.tokens)
            s.tokens, s.logps, s.versions, s.done = [], [], [], False
        if stale:
            samples += len(stale)
            g.scores = g.acc = None
    return samples, tokens


def choose(ready: list[int], groups: list[Group], newest: list[int], oldest: list, step: int, target: int,
           staleness: int, token_staleness: int, max_wait: int | None) -> set[int]:
    """The complete groups the step commits (``ready``: their indices, oldest first): the batch's
    worth, and any that the next step could not take -- a row version (``newest``) or a token
    version (``oldest``) that would be past its bound, or a group at ``rollout.max_wait_steps``."""
    take = set(ready[:target])
    for i in ready[target:]:
        if (newest[i] < step + 1 - staleness or (oldest[i] is not None and oldest[i] < step + 1 - token_staleness)
                or (max_wait is not None and step - groups[i].born >= max_wait)):
            take.add(i)
    return take


def overdue(groups: list[Group], live: list[int], done: list[bool], oldest: list, step: int, max_wait: int | None,
            finish_within: int | None) -> bool:
    """Whether the step may not commit yet: an unfinished group has waited ``rollout.max_wait_steps``,
    or (``finish_within``: the token bound, ``rollout.on_stale=finish``) holds a token that would be
    past the bound at the next step."""
    for i in live:
        if done[i]:
            continue
        if max_wait is not None and step - groups[i].born >= max_wait:
            return True
        if finish_within is not None and oldest[i] is not None and oldest[i] < step + 1 - finish_within:
            return True
    return False


def _quantile(xs: list, q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs`` (0 when empty)."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return float(xs[max(0, math.ceil(q * len(xs)) - 1)])


def _draw(ctx: Context, count: int, step: int) -> list[Group]:
    """``count`` new prompt groups, in the sampler's order (identical on every rollout rank)."""
    n = ctx.recipe.trainer.n_samples_per_prompt
    out = []
    for i in ctx.sampler.next_indices(count) if count else []:
        prompt = torch.tensor(ctx.dataset[i]["prompt_ids"], dtype=torch.long)
        out.append(Group(int(i), step, prompt, [Sample() for _ in range(n)]))
    return out


def length_numbers(trained: list, pool: list) -> dict:
    """How far the trained batch's response lengths lean from the pool's (``rollout/length_bias``: the
    trained mean over the pool's, less 1; negative: shorter). The pool is every sample the step
    worked on -- trained, carried, filtered -- the unfinished ones at their length so far, a lower
    bound of their final one, so the lean shown is at most the real one."""
    tm = sum(trained) / len(trained) if trained else 0.0
    pm = sum(pool) / len(pool) if pool else 0.0
    return {"rollout/length_trained_mean": tm, "rollout/length_trained_p90": _quantile(trained, 0.9),
            "rollout/length_pool_mean": pm, "rollout/length_pool_p90": _quantile(pool, 0.9),
            "rollout/length_bias": tm / pm - 1 if pm else 0.0}


@stage("pool_rollout")
def pool_rollout(ctx: Context, b: StageBatch) -> dict:
    """Continue the carried groups and new ones until the batch has enough complete (informative)
    groups; choose the committed ones, oldest first; the rest stay in the pool (module doc).

    Every rollout rank holds the same list of groups (the carried ones, then the draws, in the
    sampler's order); group ``i`` is generated by rollout DP rank ``i % dp``. After each chunk one
    all-gather of small per-group facts (complete? dropped? newest version?) and rank 0's look at the
    weights gives every rank the same view, so all of them take the same decisions."""
    r, st, pb, eng = ctx.recipe, b.state, b.new, b.engine
    ro, alg, n = r.rollout, r.algorithm, r.trainer.n_samples_per_prompt
    ds = alg.dynamic_sampling
    step, target = st.step, st.target
    chunk = ro.chunk_tokens if ro.pooled else ro.sampling.max_new_tokens  # DAPO alone: whole responses
    s = ro.sampling
    params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                            top_k=s.top_k, eos_token_id=ctx.eos_id, pad_token_id=ctx.pad_id)
    groups = list(pb.carried)
    carried_in = len(groups)
    bound, wait = alg.token_staleness, ro.max_wait_steps
    finish = bound if ro.on_stale == "finish" else None
    restarted, restarted_tokens = restart_stale(groups, step, bound)  # every rank holds the same carried groups
    groups += _draw(ctx, max(0, math.ceil(ro.oversample * target) - len(groups)), step)
    drawn = len(groups) - carried_in
    done = [g.done for g in groups]       # the common view, per group
    version = [g.version for g in groups]
    oldest = [g.oldest for g in groups]
    dropped: set[int] = set()
    sums = {"errors": 0, "gen_tokens": 0, "filtered_tokens": 0, "reward_sum": 0.0, "reward_n": 0}
    first_error = None
    interrupts, rounds, chunks = 0, 1, 0
    gen = _Generation(ctx, params, seed_of(r.trainer.seed, step, "pool"))
    t0, t_weights = time.perf_counter(), 0.0
    leader = eng.is_data_leader
    metric_col = dynamic_sampling_column(alg)
    eng.wake()
    try:
        while True:
            mine = [i for i in range(len(groups)) if i % eng.dp_size == eng.dp_rank and i not in dropped]
            sums["gen_tokens"] += gen.chunk([groups[i] for i in mine], chunk)
            chunks += 1
            facts = []
            for i in mine:
                g = groups[i]
                if g.done and g.scores is None:  # completed in this chunk: scored now
                    g.scores, g.acc, err, first = score_rows(
                        ctx, [torch.tensor(x.tokens, dtype=torch.long) for x in g.samples], [g.index] * n)
                    sums["errors"] += err
                    first_error = first_error or first
                    metric = g.acc if metric_col == "acc" else g.scores
                    if ds.enabled and not len(dynamic_sampling_filter(
                            metric.float(), torch.zeros(n, dtype=torch.long)).kept_group_ids):
                        dropped.add(i)  # DAPO: a constant group gives no gradient
                        sums["filtered_tokens"] += g.tokens
                facts.append((i, g.done, g.version, g.oldest, i in dropped))
            waiting = (ro.partial and ctx.rank == 0 and ctx.signals is not None
                       and version_waiting(ctx.signals, ctx.version + 1))
            every = all_gather_objects((facts if leader else [], waiting), device=ctx.device)
            for part, _ in every:
                for i, d, v, o, x in part:
                    done[i], version[i], oldest[i] = d, v, o
                    if x:
                        dropped.add(i)
            live = [i for i in range(len(groups)) if i not in dropped]
            if sum(done[i] for i in live) >= target and not overdue(groups, live, done, oldest, step, wait, finish):
                break
            if every[0][1]:  # partial rollout: the new version loads now; the unfinished continue under it
                gen.close()
                tw = time.perf_counter()
                receive_weights(ctx)
                ctx.version += 1
                t_weights += time.perf_counter() - tw
                interrupts += 1
                continue
            if not all(done[i] for i in live):
                continue
            if not ds.enabled or rounds >= ds.max_gen_batches:
                break  # every group is complete or dropped: train on what there is
            gen.close()  # DAPO: another round, of as many new prompts as informative groups are missing
            more = _draw(ctx, target - sum(done[i] for i in live), step)
            groups += more
            done += [False] * len(more)
            version += [-1] * len(more)
            oldest += [None] * len(more)
            drawn += len(more)
            rounds += 1
    finally:
        gen.close()
        eng.sleep()
    ctx.timer.add_compute(b.stage.reports_as, time.perf_counter() - t0 - t_weights)
    # committed: the batch's worth of complete groups, oldest first, and any complete group the next
    # step could not take; the rest stay in the pool
    ready = sorted((i for i in range(len(groups)) if done[i] and i not in dropped), key=lambda i: (groups[i].born, i))
    take = choose(ready, groups, version, oldest, step, target, alg.max_staleness, bound, wait)
    committed = [i for i in range(len(groups)) if i in take]
    carry = [i for i in range(len(groups)) if i not in take and i not in dropped]
    at_c, at_k = {i: p for p, i in enumerate(committed)}, {i: p for p, i in enumerate(carry)}
    mine = {i for i in range(len(groups)) if i % eng.dp_size == eng.dp_rank}
    pb.committed = [groups[i] for i in committed if i in mine]
    pb.committed_at = [at_c[i] for i in committed if i in mine]
    pb.n_committed = len(committed)
    pb.carry = [groups[i] for i in carry if i in mine]
    pb.carry_at = [at_k[i] for i in carry if i in mine]
    pb.n_carry = len(carry)
    # the group counts are common knowledge; tokens and errors are summed over the DP leaders
    sums["carry_tokens"] = sum(g.tokens for g in pb.carry)
    gone = pb.committed + [groups[i] for i in dropped if i in mine]  # the groups that left the pool
    sums["reward_sum"], sums["reward_n"] = sum(float(g.acc.sum()) for g in gone), n * len(gone)
    # response lengths: the trained rows, and every sample of the step's pool (unfinished: so far)
    lens = ([len(x.tokens) for g in pb.committed for x in g.samples],
            [len(x.tokens) for g in gone + pb.carry for x in g.samples])
    every = all_gather_objects((sums, lens) if leader else ({}, ([], [])), device=ctx.device)
    total = {key: sum(e[0].get(key, 0) for e in every) for key in sums}
    trained_lens = [x for e in every for x in e[1][0]]
    pool_lens = [x for e in every for x in e[1][1]]
    ages = [step - groups[i].born for i in carry]
    pb.numbers.update({
        "rollout/pool_carried_in": carried_in, "rollout/pool_new_groups": drawn,
        "rollout/pool_committed_groups": len(committed), "rollout/pool_carried_groups": len(carry),
        "rollout/pool_filtered_groups": len(dropped),
        "rollout/pool_carried_age_max": max(ages, default=0),
        "rollout/pool_carried_age_mean": sum(ages) / len(ages) if ages else 0.0,
        "rollout/pool_committed_age_max": max((step - groups[i].born for i in committed), default=0),
        "rollout/generated_tokens": total["gen_tokens"], "rollout/filtered_tokens": total["filtered_tokens"],
        "rollout/pool_dock_tokens": total["carry_tokens"],
        "rollout/pool_restarted_samples": restarted, "rollout/pool_restarted_tokens": restarted_tokens,
        "rollout/interrupts": interrupts, "async/weights_wait_mid_s": round(t_weights, 4),
        # the step's chunks of generation, and the engine sessions opened for them (each a prefill of
        # the unfinished samples' prefixes)
        "rollout/pool_chunks": chunks, "rollout/pool_sessions": gen.opened,
        # the reward of the groups that left the pool: trained on, or dropped by DAPO's filter (as a
        # colocated DAPO step counts every group it scored)
        "reward/mean": total["reward_sum"] / total["reward_n"] if total["reward_n"] else float("nan"),
        "reward/samples": total["reward_n"], "reward/errors": total["errors"],
        "reward/failure_rate": total["errors"] / total["reward_n"] if total["reward_n"] else 0.0})
    pb.numbers.update(length_numbers(trained_lens, pool_lens))
    if first_error:
        pb.numbers["reward/first_error"] = first_error
    if ds.enabled:
        pb.numbers.update({"dapo/gen_rounds": rounds, "dapo/kept_groups": len(committed),
                           "dapo/dropped_groups": len(dropped), "dapo/generated_groups": drawn})
    if not pb.committed:
        return {}
    cols = row_columns(pb.committed, n)
    cols["policy_version"] = torch.tensor([g.version for g in pb.committed for _ in range(n)], dtype=torch.long)
    return cols
