"""The pooled rollout's generation (workflow/pool.py) on a real native rollout engine: a generation
interrupted by a weight update records, per token, the version and the behaviour log-prob that
produced it; a sample past the token-staleness bound is regenerated; which complete groups a step
commits; the length-bias numbers; and the plan / recipe rules of a pooled rollout."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlrecipes.engines.base import SamplingParams
from rlrecipes.engines.native.rollout import NativeRolloutEngine
from rlrecipes.models import SMOKE
from rlrecipes.plan import build_plan
from rlrecipes.plan.long_tail import WAIT_RULE
from rlrecipes.recipe import load_recipe
from rlrecipes.workflow.pool import Group, Sample, _Generation, choose, length_numbers, overdue, restart_stale

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


def _logprobs(model, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    seq = torch.cat([prompt, torch.tensor(tokens)])[None]  # [1, P + R]
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float()  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)  # [R]


@pytest.mark.parametrize("decode", ["fast", "hf"])  # a KV-keeping turn session, and the re-prefilling one
def test_an_interrupted_generation_records_the_version_and_logprob_of_every_token(decode):
    eng = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", seed=1, decode=decode)
    v0 = {k: t.detach().clone() for k, t in eng.model.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    v1 = {k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in v0.items()}  # the next policy version
    prompts = [torch.randint(4, 32, (n,), generator=g) for n in (3, 6, 4)]
    groups = [Group(i, 0, p, [Sample(), Sample()]) for i, p in enumerate(prompts)]
    ctx = SimpleNamespace(rollout=eng, version=0)
    params = SamplingParams(max_new_tokens=14, temperature=1.0, eos_token_id=None, pad_token_id=0)
    gen = _Generation(ctx, params, seed=3)
    gen.chunk(groups, 5)                      # version 0: 5 tokens each
    gen.close()                               # the interrupt: the session (its KV cache) goes ...
    eng.update_weights([list(v1.items())])    # ... the new weights load in place ...
    ctx.version = 1
    gen.chunk(groups, 5)                      # ... and the samples continue from their prefix
    gen.chunk(groups, 5)                      # (the last chunk stops at max_new_tokens)
    gen.close()
    for grp in groups:
        for s in grp.samples:
            assert s.versions == [0] * 5 + [1] * 9 and s.done and len(s.tokens) == len(s.logps) == 14
    # recompute each token's log-prob under each version: the recorded one is its producer's
    model = eng.model
    for weights, version in ((v0, 0), (v1, 1)):
        model.load_state_dict(weights)
        for grp in groups:
            for s in grp.samples:
                got = torch.tensor(s.logps)
                want = _logprobs(model, grp.prompt, s.tokens)
                mine = torch.tensor(s.versions) == version
                torch.testing.assert_close(got[mine], want[mine], atol=1e-4, rtol=1e-4)
                assert (got[~mine] - want[~mine]).abs().max() > 1e-3  # the other version's would not match


def test_a_finished_sample_stops_while_its_group_continues():
    eng = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", seed=2)
    ctx = SimpleNamespace(rollout=eng, version=4)
    prompt = torch.tensor([5, 6, 7])
    grp = Group(0, 0, prompt, [Sample(tokens=[9], logps=[-1.0], versions=[3], done=True), Sample()])
    gen = _Generation(ctx, SamplingParams(max_new_tokens=6, temperature=1.0, eos_token_id=None, pad_token_id=0), 1)
    assert gen.chunk([grp], 4) == 4  # only the unfinished sample generates
    assert grp.samples[0].tokens == [9] and grp.samples[1].versions == [4] * 4 and not grp.done
    assert gen.chunk([grp], 4) == 2 and grp.done and grp.version == 4
    gen.close()


def _sample(versions: list[int], done: bool = True) -> Sample:
    return Sample(tokens=[5] * len(versions), logps=[-1.0] * len(versions), versions=list(versions), done=done)


def test_a_sample_past_the_token_bound_is_regenerated_from_its_prompt_under_the_current_policy():
    # step 5, bound 1: a token of version 3 is 2 versions old -- its sample restarts, whole (its
    # version-4 tokens were sampled after it); a sample whose oldest token is version 4 stays
    grp = Group(0, 2, torch.tensor([5, 6, 7]), [_sample([3, 3, 4]), _sample([4, 5], done=False), _sample([4])],
                scores=torch.ones(3), acc=torch.ones(3))
    fresh = Group(1, 4, torch.tensor([5, 6]), [_sample([4, 4]), _sample([])])
    assert grp.oldest == 3 and grp.version == 5 and fresh.oldest == 4
    assert restart_stale([grp, fresh], step=5, bound=1) == (1, 3)
    a, b, c = grp.samples
    assert (a.tokens, a.logps, a.versions, a.done) == ([], [], [], False)
    assert b.versions == [4, 5] and c.versions == [4] and c.done and grp.scores is None and not grp.done
    assert restart_stale([grp, fresh], step=5, bound=2) == (0, 0)  # nothing else is past the bound
    # the restarted sample generates from its prompt under the version the rollout holds now
    eng = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", seed=3)
    gen = _Generation(SimpleNamespace(rollout=eng, version=5),
                      SamplingParams(max_new_tokens=4, temperature=1.0, eos_token_id=None, pad_token_id=0), 1)
    gen.chunk([grp], 4)
    gen.close()
    assert a.versions == [5] * 4 and a.done and len(a.logps) == 4 and b.versions == [4, 5, 5, 5]
    assert grp.oldest == 4  # within the bound at step 5, and at step 5 + 1 - 1 it would be past it


def test_a_step_commits_its_batch_and_every_complete_group_the_next_step_could_not_take():
    prompt = torch.tensor([5])
    groups = [Group(i, born, prompt, [_sample(v)]) for i, (born, v) in
              enumerate([(3, [3, 4]), (4, [5]), (4, [4, 5]), (5, [5]), (2, [2, 5]), (5, [5])])]
    newest = [g.version for g in groups]
    oldest = [g.oldest for g in groups]
    ready = sorted(range(6), key=lambda i: (groups[i].born, i))  # [4, 0, 1, 2, 3, 5]
    # step 5, batch 2: the two oldest; the rest are fine at step 6 under bounds (1, 4) and no wait cap
    assert choose(ready, groups, newest, oldest, 5, 2, 1, 4, None) == {4, 0}
    # a token bound of 1: at step 6 a version-4 token would be 2 behind -- group 2 goes now
    assert choose(ready, groups, newest, oldest, 5, 2, 1, 1, None) == {4, 0, 2}
    # a row bound (newest token) of 0 at step 6 takes every group finished before version 6
    assert choose(ready, groups, newest, oldest, 5, 2, 0, 4, None) == set(range(6))
    # a wait cap of 1: groups drawn at step 4 or earlier have waited their step
    assert choose(ready, groups, newest, oldest, 5, 2, 1, 4, 1) == {4, 0, 1, 2}
    done = [True, True, False, True, True, True]
    every = list(range(6))
    assert overdue(groups, every, done, oldest, 5, 1, None)  # group 2 (drawn at 4) is unfinished: wait
    assert not overdue(groups, every, done, oldest, 5, 2, None) and not overdue(groups, every, done, oldest, 5, None, None)
    assert not overdue(groups, [0, 1, 3], done, oldest, 5, 1, None)  # (filtered groups are not waited for)
    # on_stale=finish: group 2's version-4 token would be 2 behind step 6 -- finished now under bound 1
    assert overdue(groups, every, done, oldest, 5, None, 1) and not overdue(groups, every, done, oldest, 5, None, 2)


def test_the_length_bias_compares_the_trained_responses_with_the_pool():
    got = length_numbers([2, 4, 3, 3], [2, 4, 3, 3, 20, 30, 8, 10])
    assert got["rollout/length_trained_mean"] == 3.0 and got["rollout/length_pool_mean"] == 10.0
    assert got["rollout/length_trained_p90"] == 4.0 and got["rollout/length_pool_p90"] == 30.0
    assert got["rollout/length_bias"] == pytest.approx(-0.7)
    assert length_numbers([4, 6], [4, 6])["rollout/length_bias"] == 0.0  # nothing left in the pool
    assert length_numbers([], [])["rollout/length_bias"] == 0.0


SMOKE_DISAGG = ["resources.placement=disaggregated", "resources.rollout_devices=1", "algorithm.max_staleness=1"]


@pytest.mark.parametrize("overrides, match", [
    (["rollout.partial=true"], "rollout.partial=true continues samples across policy versions"),
    (["rollout.oversample=2", "resources.placement=disaggregated", "resources.rollout_devices=1"],
     "algorithm.max_staleness=1"),
    (["rollout.oversample=2", *SMOKE_DISAGG, "rollout.multi_turn.enabled=true", "data.synthetic=add"],
     "multi-turn"),
    (["rollout.oversample=2", *SMOKE_DISAGG, "algorithm.max_staleness=2", "algorithm.max_token_staleness=1"],
     r"algorithm.max_token_staleness=1 is below algorithm.max_staleness=2.*set algorithm.max_token_staleness=2"),
])
def test_pooled_rollouts_are_refused_where_they_cannot_run(overrides, match):
    with pytest.raises(Exception, match=match):
        load_recipe("qwen25_7b", smoke=True, overrides=overrides)


def test_plan_refuses_routing_replay_and_grows_a_disaggregated_smoke():
    r = load_recipe("qwen3_moe_30b", smoke=True, overrides=SMOKE_DISAGG)
    p = build_plan(r)
    assert p.ok, p.violations
    assert p.world == 3  # the smoke's train group (actor TP2) stays whole; the rollout device is added
    bad = build_plan(load_recipe("qwen3_moe_30b", smoke=True, overrides=SMOKE_DISAGG + ["algorithm.routing_replay=true"]))
    assert any("routing_replay" in v.detail for v in bad.violations), bad.violations
    assert build_plan(load_recipe("qwen25_7b", smoke=True, overrides=SMOKE_DISAGG)).world == 2  # fits as it is


def test_plan_refuses_a_wait_cap_without_a_pool():
    bad = build_plan(load_recipe("qwen25_7b", smoke=True, overrides=SMOKE_DISAGG + ["rollout.max_wait_steps=2"]))
    assert [v.rule for v in bad.violations] == [WAIT_RULE]
    assert "set rollout.max_wait_steps=null" in bad.violations[0].detail
    r = load_recipe("qwen25_7b", smoke=True, overrides=SMOKE_DISAGG + ["rollout.oversample=2", "rollout.max_wait_steps=2",
                                                                        "algorithm.max_token_staleness=3"])
    assert build_plan(r).ok and r.algorithm.token_staleness == 3
    assert load_recipe("qwen25_7b", smoke=True, overrides=SMOKE_DISAGG).algorithm.token_staleness == 1  # = max_staleness
