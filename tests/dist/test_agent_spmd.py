"""A multi-turn rollout on a rollout instance of 2 ranks (native engine, TP2): the leader runs the
agent loop and the tools, its peer replays every turn call; both end with the same trajectories,
and a failure of the leader's loop reaches the peer as an error instead of a hang."""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks


def _setup(tmp):
    from transformers import AutoTokenizer

    from rlrecipes.agent import SmokeFormat, ToolExecutor, ToolRegistry
    from rlrecipes.agent.loop import AgentLimits, AgentLoop
    from rlrecipes.data import smoke_task_dataset
    from rlrecipes.data.smoke import build_smoke_tokenizer
    from rlrecipes.engines.base import SamplingParams
    from rlrecipes.engines.native.rollout import NativeRolloutEngine
    from rlrecipes.models import SMOKE

    import torch.distributed as dist
    tok = AutoTokenizer.from_pretrained(str(build_smoke_tokenizer(f"{tmp}/tok{dist.get_rank()}")))
    eng = NativeRolloutEngine(SMOKE["qwen2"], layout=(2, 1), device="cpu", dtype="fp32", seed=0)
    rows = smoke_task_dataset(12, 4, task="add")
    prompts = [torch.tensor(tok(r["prompt"])["input_ids"]) for r in rows]
    fmt = SmokeFormat({ch: ("calculator", "expression") for ch in "abcxy"})
    loop = AgentLoop(fmt, ToolExecutor(ToolRegistry(["calculator"])), tok,
                     AgentLimits(max_turns=3, max_tool_calls=2, max_response_tokens=24, max_new_tokens=8),
                     eos_ids=[tok.eos_token_id])
    params = SamplingParams(max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            stop_token_ids=loop.stop_token_ids())
    return eng, loop, prompts, [r["tool_kwargs"] for r in rows], params


def _replay(rank, tmp):
    import torch.distributed as dist

    from rlrecipes.agent.spmd import LeaderSession, follow

    eng, loop, prompts, kwargs, params = _setup(tmp)
    group, leader = eng.model_parallel_group()
    session = eng.open_session(prompts, params, seed=3)
    if rank == leader:
        lead = LeaderSession(session, group, leader)
        traj = loop.run(lead, len(prompts), kwargs)
        mine = [(t.response_ids, t.response_mask, t.log_probs) for t in traj]
        lead.finish(mine)
        assert sum(t.tool_calls for t in traj) >= 3
    else:
        mine = follow(session, group, leader)
    session.close()
    every = [None, None]
    dist.all_gather_object(every, [[x.tolist() for x in t] for t in mine])
    assert every[0] == every[1]


def _leader_fails(rank, tmp):
    from rlrecipes.agent.spmd import LeaderSession, follow

    eng, loop, prompts, kwargs, params = _setup(tmp)
    group, leader = eng.model_parallel_group()
    session = eng.open_session(prompts, params, seed=3)

    def broken(*a, **k):
        raise ValueError("the template broke")

    loop.fmt.render_observation = broken
    if rank == leader:
        lead = LeaderSession(session, group, leader)
        with pytest.raises(ValueError, match="the template broke"):
            try:
                loop.run(lead, len(prompts), kwargs)
            except Exception as e:
                lead.fail(e)
                raise
    else:
        with pytest.raises(RuntimeError, match="leader failed in the agent loop: ValueError: the template broke"):
            follow(session, group, leader)


def test_peers_replay_the_leaders_turn_calls():
    run_ranks(_replay, 2)


def test_a_failing_leader_fails_its_peers():
    run_ranks(_leader_fails, 2)
