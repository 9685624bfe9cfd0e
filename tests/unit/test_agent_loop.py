"""The multi-turn agent loop on the real native engine: masks, log-prob agreement, scheduling, limits.

Every test runs the real pieces: the smoke tokenizer, a smoke model in the native rollout engine
(its KV-cache turn session), the tool registry and pool, the trainer's own forward and loss.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from rlrecipes.agent import SmokeFormat, ToolExecutor, ToolRegistry
from rlrecipes.agent.loop import AgentLimits, AgentLoop, agent_metrics, agent_sums, segments
from rlrecipes.data import smoke_task_dataset
from rlrecipes.engines.base import ReprefillSession, SamplingParams, SeqBatch
from rlrecipes.engines.native.rollout import NativeRolloutEngine
from rlrecipes.engines.native.session import KVSession
from rlrecipes.models import SMOKE

pytestmark = pytest.mark.usefixtures("one_rank_group")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from rlrecipes.data.smoke import build_smoke_tokenizer

    return AutoTokenizer.from_pretrained(str(build_smoke_tokenizer(tmp_path_factory.mktemp("tok"))))


def _task(tok, n, seed=0):
    rows = smoke_task_dataset(n, seed, task="add")
    return [torch.tensor(tok(r["prompt"])["input_ids"]) for r in rows], [r["tool_kwargs"] for r in rows], rows


# every letter of the smoke tokenizer calls the calculator: a random model then calls often
EVERY_LETTER = {ch: ("calculator", "expression") for ch in "abcxy"}


def _loop(tok, tools=("calculator",), fmt=None, workers=8, timeout_s=5.0, **limits):
    lim = dict(max_turns=3, max_tool_calls=2, max_response_tokens=24, max_new_tokens=8, max_observation_tokens=8)
    lim.update(limits)
    return AgentLoop(fmt or SmokeFormat(EVERY_LETTER), ToolExecutor(ToolRegistry(list(tools)), max_workers=workers, timeout_s=timeout_s),
                     tok, AgentLimits(**lim), eos_ids=[tok.eos_token_id])


def _params(tok, loop, **kw):
    kw = {"temperature": 1.0, **kw}
    return SamplingParams(max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          stop_token_ids=loop.stop_token_ids(), **kw)


# ------------------------------------------------------------------------------------- masks
def test_trajectories_mask_exactly_the_observations(tok):
    eng = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", dtype="fp32", seed=0)
    loop = _loop(tok)
    prompts, kwargs, rows = _task(tok, 24)
    traj = loop.run(eng.open_session(prompts, _params(tok, loop), seed=1), len(prompts), kwargs)
    called = [t for t in traj if t.tool_calls]
    assert len(called) >= 5, "the random smoke model calls the tool often (any of a b c x y)"
    for t, row in zip(traj, rows):
        assert t.response_ids.shape == t.response_mask.shape == t.log_probs.shape
        assert t.response_ids.numel() <= 24
        assert bool((t.log_probs[t.response_mask == 0] == 0).all())
        parts = segments(t.response_ids, t.response_mask)
        obs = [tok.decode(ids.tolist()) for model, ids in parts if not model]
        assert len(obs) == t.tool_calls or t.truncated  # one observation per call (the last may be cut)
        for text in obs[:-1] if t.truncated else obs:
            assert text == f":{row['answer']}=", text  # the calculator got the sample's expression
        for model, ids in parts:  # every model segment but the last ends at its call letter
            if model and ids is not parts[-1][1]:
                assert tok.decode(ids[-1:].tolist()) in "abcxy"
    m = agent_metrics(agent_sums(traj))
    assert m["agent/tool_calls_mean"] == sum(t.tool_calls for t in traj) / len(traj) > 0
    assert 0 < m["agent/observation_token_frac"] < 1 and m["agent/tool_error_frac"] == 0.0


def test_observation_tokens_get_no_gradient_and_count_nowhere():
    """The actor's loss closure (policy loss + KL + entropy) on a micro-batch with observations:
    the gradient w.r.t. every observation position's logits is exactly zero, the loss does not move
    when those logits change, and the token counts leave them out."""
    from rlrecipes.algos.spec import actor_loss_fn
    from rlrecipes.engines.native.batching import padded_micro_batch
    from rlrecipes.recipe import load_recipe
    from rlrecipes.workflow.batching import local_counts

    cfg = load_recipe("qwen25_7b", smoke=True, overrides=["algorithm.entropy_coef=0.01"]).algorithm
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(4, 32, (n,), generator=g) for n in (9, 5, 12)]
    masks = [torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1]), torch.ones(5, dtype=torch.long),
             torch.tensor([1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1])]
    batch = SeqBatch([torch.randint(4, 32, (4,), generator=g) for _ in range(3)], responses,
                     per_token={"response_mask": masks, "ref_log_probs": [-torch.rand(n.numel(), generator=g) for n in masks],
                                "rollout_log_probs": [-torch.rand(n.numel(), generator=g) for n in masks]},
                     per_sample={"advantages": torch.tensor([1.0, -0.5, 2.0])})
    model_tokens = sum(int(m.sum()) for m in masks)
    assert batch.response_tokens() == model_tokens == 18  # 9 + 5 + 12 = 26 tokens, 8 of them observations
    assert local_counts(type("E", (), {"is_data_leader": True})(), [batch]).tolist() == [[18, 3, 12]]
    mb = padded_micro_batch(batch, pad_id=0)
    obs = torch.zeros_like(mb["response_mask"], dtype=torch.bool)
    for i, m in enumerate(masks):
        obs[i, :m.numel()] = m == 0
    assert bool((mb["response_mask"][obs] == 0).all()) and int(mb["response_mask"].sum()) == 18
    targets = torch.zeros(mb["response_mask"].shape, dtype=torch.long)
    for i, r in enumerate(responses):
        targets[i, :r.numel()] = r
    agg = dict(global_tokens=18.0, global_seqs=3.0, norm_len=24, dp_size=1)
    loss_fn = actor_loss_fn(cfg, agg=agg, kl_coef=0.1, use_ref=True, dp_size=1)

    def loss_of(logits):
        lp_all = torch.log_softmax(logits, -1)
        logp = lp_all.gather(-1, targets[..., None]).squeeze(-1)
        entropy = -(lp_all.exp() * lp_all).sum(-1)
        return loss_fn(logp, entropy, mb)[0]

    logits = torch.randn((*targets.shape, 32), generator=g, requires_grad=True)
    loss = loss_of(logits)
    loss.backward()
    grad = logits.grad.abs().sum(-1)  # [b, R]
    assert torch.equal(grad[obs], torch.zeros_like(grad[obs]))  # exactly zero, not merely small
    assert bool((grad[mb["response_mask"].bool()] > 0).all())
    moved = logits.detach().clone()
    moved[obs] += 5 * torch.randn((int(obs.sum()), 32), generator=g)
    assert float(loss_of(moved).detach()) == float(loss.detach())


# ------------------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("family", list(SMOKE))
def test_multi_turn_log_probs_match_the_trainer(tok, family):
    """The rollout's log-probs of every model token (KV cache kept across turns, observations in
    between) agree with the train engine's forward over prompt + response, in fp32."""
    from rlrecipes.engines.native.train import NativeTrainEngine

    eng = NativeRolloutEngine(SMOKE[family], device="cpu", dtype="fp32", seed=0)
    trainer = NativeTrainEngine(SMOKE[family], role="ref", layout=(1, 1), device="cpu", dtype="fp32", seed=0)
    eng.load_shards(trainer.local_shards().items())  # the rollout serves the trainer's weights
    loop = _loop(tok)
    prompts, kwargs, _ = _task(tok, 16, seed=3)
    session = eng.open_session(prompts, _params(tok, loop), seed=5)
    # a VL model's turns are prefilled again whole (engines/native/vision.py), a text model's keep their KV cache
    assert isinstance(session, ReprefillSession if SMOKE[family].has_vision else KVSession)
    traj = loop.run(session, len(prompts), kwargs)
    session.close()
    assert sum(t.tool_calls for t in traj) >= 4 and sum(t.observation_tokens for t in traj) > 0
    got, _ = trainer.forward(SeqBatch(prompts, [t.response_ids for t in traj]))
    worst = 0.0
    for t, lp in zip(traj, got):
        keep = t.response_mask.bool()
        worst = max(worst, float((lp[keep] - t.log_probs[keep]).abs().max()))
    assert worst < 1e-4, worst


def test_kv_session_equals_reprefilling_session(tok):
    """Greedy, the KV-cache session and the session that re-sends every conversation whole give the
    same trajectories (so the native engine's cache bookkeeping changes nothing)."""
    eng = NativeRolloutEngine(SMOKE["qwen3_moe"], device="cpu", dtype="fp32", seed=0)
    loop = _loop(tok)
    prompts, kwargs, _ = _task(tok, 12, seed=7)
    params = _params(tok, loop, temperature=0.0)
    a = loop.run(eng.open_session(prompts, params, seed=0), len(prompts), kwargs)
    b = loop.run(ReprefillSession(eng, prompts, params, seed=0), len(prompts), kwargs)
    for x, y in zip(a, b):
        assert torch.equal(x.response_ids, y.response_ids) and torch.equal(x.response_mask, y.response_mask)
        torch.testing.assert_close(x.log_probs, y.log_probs, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------- scheduling
def test_a_slow_tool_holds_its_own_sample_only(tok):
    """One sample's tool sleeps; the others go on generating their next turns meanwhile."""
    release = threading.Event()
    slow_row = {"expression": "999+999"}

    def calculator(expression: str) -> str:
        """Add numbers.

        Args:
            expression: what to compute.
        """
        if expression == slow_row["expression"]:
            release.wait(10)
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 -- digits and '+' only

    eng = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", dtype="fp32", seed=0)
    loop = _loop(tok, tools=(calculator,))
    prompts, kwargs, _ = _task(tok, 16, seed=3)
    first = loop.run(eng.open_session(prompts, _params(tok, loop, temperature=0.0), seed=0), len(prompts), kwargs)
    caller = next(i for i, t in enumerate(first) if t.tool_calls)  # greedy: the same choices again
    kwargs[caller] = {"calculator": slow_row}
    calls: list[tuple[list[int], bool]] = []
    session = eng.open_session(prompts, _params(tok, loop, temperature=0.0), seed=0)
    inner = session.generate

    def spy(rows, appended, budgets):
        calls.append((list(rows), release.is_set()))
        out = inner(rows, appended, budgets)
        if caller not in rows and len(calls) > 1 and not release.is_set():
            threading.Timer(0.2, release.set).start()  # the others moved on: let the slow one finish
        return out

    session.generate = spy
    t0 = time.perf_counter()
    traj = loop.run(session, len(prompts), kwargs)
    assert time.perf_counter() - t0 < 10
    others_went_on = [rows for rows, released in calls[1:] if not released and caller not in rows]
    assert others_went_on, calls  # an engine call for other samples ran while the slow tool was out
    assert any(caller in rows for rows, released in calls[1:] if released)  # and the slow one came back later
    assert traj[caller].tool_calls >= 1 and traj[caller].tool_errors == 0


# ------------------------------------------------------------------------------------- limits
def test_limits_errors_and_truncation(tok):
    def broken(expression: str) -> str:
        """Always fails.

        Args:
            expression: ignored.
        """
        raise RuntimeError("the tool is down")

    eng = NativeRolloutEngine(SMOKE["qwen2"], device="cpu", dtype="fp32", seed=0)
    prompts, _, _ = _task(tok, 24, seed=1)
    fmt = SmokeFormat({ch: ("broken", "expression") for ch in "abcxy"})
    loop = _loop(tok, tools=(broken,), fmt=fmt, max_turns=2, max_tool_calls=1, max_response_tokens=12)
    traj = loop.run(eng.open_session(prompts, _params(tok, loop), seed=2), len(prompts), [None] * len(prompts))
    called = [t for t in traj if t.tool_calls]
    assert called and all(t.tool_calls == t.tool_errors == 1 for t in called)  # an error observation, no crash
    for t in traj:
        assert t.turns <= 2 and t.tool_calls <= 1 and t.response_ids.numel() <= 12
        obs = [tok.decode(ids.tolist()) for model, ids in segments(t.response_ids, t.response_mask) if not model]
        assert all(o == ":?=" for o in obs)  # whole observations only (never cut mid-frame)
        ended = int(t.response_ids[-1]) == tok.eos_token_id
        assert t.truncated == (not ended)  # a call past max_tool_calls, a turn or token limit: truncated
    m = agent_metrics(agent_sums(traj))
    assert m["agent/tool_error_frac"] == 1.0 and 0 <= m["agent/truncated_frac"] <= 1


# ------------------------------------------------------------------------------------- rewards
def test_reward_functions_get_the_trajectory_when_they_ask():
    from rlrecipes.rewards import score_batch

    seen = []

    def new_style(completion, answer, *, messages, tool_results):
        seen.append((messages, tool_results))
        return float(completion == answer)

    def old_style(completion, answer):
        return float(completion == answer)

    traj = [{"messages": [{"role": "assistant", "content": "c"}, {"role": "tool", "content": ":9="},
                          {"role": "assistant", "content": "9"}], "tool_results": [":9="]}]
    assert score_batch(new_style, ["9"], ["9"], traj)[0] == [1.0]
    assert seen == [(traj[0]["messages"], [":9="])]
    assert score_batch(old_style, ["9"], ["9"], traj)[0] == [1.0]


def test_special_token_names_are_not_calls(tok):
    """``<pad>`` holds an ``a`` and ``<bos>`` a ``b``: the loop parses text without special tokens."""
    loop = _loop(tok)
    ids = torch.tensor(tok.convert_tokens_to_ids(["<pad>", "<bos>", "7", "a"]))
    assert loop._text(ids) == "7a" and len(loop.fmt.parse(loop._text(ids)).calls) == 1


def test_smoke_reward_takes_the_accepted_tool_result():
    from rlrecipes.rewards import score_batch, smoke_reward

    assert smoke_reward("", "919", tool_results=[":919="]) == 1.0  # ended its turn on the result
    assert smoke_reward("91", "919", tool_results=[":919="]) == smoke_reward("91", "919")  # its own copy counts
    assert smoke_reward("", "919", tool_results=[":?="]) == 0.0 and smoke_reward("", "919") == 0.0
    traj = [{"messages": [], "tool_results": [":919="]}, {"messages": [], "tool_results": []}]
    assert score_batch("smoke", ["", "919"], ["919", "919"], traj)[0] == [1.0, 1.0]


def test_kv_session_compacts_and_grows_without_changing_a_log_prob():
    """Calls that name one row at a time leave holes in the other rows' columns; the session drops
    them (compaction) or grows, and every model token's log-prob still equals a plain forward pass."""
    eng = NativeRolloutEngine(SMOKE["deepseek_v3"], device="cpu", dtype="fp32", seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 32, (n,), generator=g) for n in (3, 6, 4, 5)]
    params = SamplingParams(max_new_tokens=4, eos_token_id=None, pad_token_id=0)
    session = eng.open_session(prompts, params, seed=1)
    seqs = [p.clone() for p in prompts]
    scored: list[list[tuple[int, float]]] = [[] for _ in prompts]  # (position in seqs, rollout log-prob)
    out = session.generate(range(4), [None] * 4, [4] * 4)
    for r in range(4):
        scored[r] += [(len(seqs[r]) + k, float(x)) for k, x in enumerate(out.log_probs[r])]
        seqs[r] = torch.cat([seqs[r], out.responses[r]])
    for call in range(12):  # one row per call, each with a 2-token observation first
        r = call % 4
        obs = torch.randint(4, 32, (2,), generator=g)
        seqs[r] = torch.cat([seqs[r], obs])
        out = session.generate([r], [obs], [3])
        scored[r] += [(len(seqs[r]) + k, float(x)) for k, x in enumerate(out.log_probs[0])]
        seqs[r] = torch.cat([seqs[r], out.responses[0]])
    assert session.compactions >= 1
    for r in range(4):
        with torch.no_grad():
            lp = torch.log_softmax(eng.model(input_ids=seqs[r][None]).logits[0].float(), -1)
        for pos, got in scored[r]:
            assert abs(float(lp[pos - 1, seqs[r][pos]]) - got) < 1e-4
    session.close()
