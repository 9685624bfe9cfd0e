"""The pooled rollout's generation (workflow/pool.py) on a real native rollout engine: a generation
interrupted by a weight update records, per token, the version and the behaviour log-prob that
produced it; and the plan / recipe rules of a pooled rollout."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlrecipes.engines.base import SamplingParams
from rlrecipes.engines.native.rollout import NativeRolloutEngine
from rlrecipes.models import SMOKE
from rlrecipes.plan import build_plan
from rlrecipes.recipe import load_recipe
from rlrecipes.workflow.pool import Group, Sample, _Generation

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


SMOKE_DISAGG = ["resources.placement=disaggregated", "resources.rollout_devices=1", "algorithm.max_staleness=1"]


@pytest.mark.parametrize("overrides, match", [
    (["rollout.partial=true"], "rollout.partial=true continues samples across policy versions"),
    (["rollout.oversample=2", "resources.placement=disaggregated", "resources.rollout_devices=1"],
     "algorithm.max_staleness=1"),
    (["rollout.oversample=2", *SMOKE_DISAGG, "rollout.multi_turn.enabled=true", "data.synthetic=add"],
     "multi-turn"),
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
