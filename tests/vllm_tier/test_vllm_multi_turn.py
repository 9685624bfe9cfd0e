"""Multi-turn agent rollouts on the real vLLM CPU engine: the agent loop over ``open_session``.

The session re-sends every conversation whole each turn (``ReprefillSession``; vLLM's prefix cache
serves the repeated prefix). What must hold for the trainer:

- the log-prob of every model token is the one the trainer's model gives on prompt + the whole
  response (model segments and observations), even for tokens sampled after an observation;
- a segment ends at the tool format's call token (``SamplingParams.stop_token_ids`` reaches vLLM);
- ``response_mask`` is 0 exactly on the observation tokens, which decode to the format's rendering
  of the calculator's result (``:<result>:``).

Smoke tool format, bare mode: any of the letters a b c x y is a call of the calculator with the
sample's own expression (the add task's ``tool_kwargs``); the result is rendered between
separators (``:919:``; the tests take the rendering from ``SmokeFormat.render_observation``).
"""
import dataclasses
from concurrent.futures import wait

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from rlrecipes.agent import SmokeFormat, ToolExecutor  # noqa: E402
from rlrecipes.agent.errors import ToolResult  # noqa: E402
from rlrecipes.agent.loop import AgentLimits, AgentLoop, segments  # noqa: E402
from rlrecipes.agent.tools import ToolRegistry  # noqa: E402
from rlrecipes.data import smoke_task_dataset  # noqa: E402
from rlrecipes.data.smoke import build_smoke_tokenizer  # noqa: E402
from test_vllm_engine import hf_logprobs, run_smoke  # noqa: E402  (same folder)
from rlrecipes.engines.base import EngineSpec, ReprefillSession, SamplingParams  # noqa: E402
from rlrecipes.engines.registry import build_rollout_engine  # noqa: E402
from rlrecipes.models import SMOKE, hf_config  # noqa: E402

N_SAMPLES = 16
SESSION_SEED = 11
LIMITS = AgentLimits(max_turns=3, max_tool_calls=2, max_response_tokens=24, max_new_tokens=8)
CALL_LETTERS = "abcxy"


class SyncToolExecutor(ToolExecutor):
    """The real pool and calculator; ``submit`` returns once the calls are done, so every sample
    with a call is ready for the next engine call and the batches (hence the seeds) do not depend
    on thread timing: the rollout is deterministic."""

    def submit(self, calls, timeout_s=None):
        futures = super().submit(calls, timeout_s)
        wait(futures)
        return futures


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_smoke_tokenizer(tmp_path_factory.mktemp("smoke_tok"))))


@pytest.fixture(scope="module")
def setup(tok):
    """A vLLM engine serving known weights (an HF model of the smoke qwen2 config, fp32)."""
    from transformers import AutoModelForCausalLM

    assert tok.vocab_size == SMOKE["qwen2"].vocab_size
    eng = build_rollout_engine("vllm", EngineSpec(model=SMOKE["qwen2"], role="rollout", dtype="fp32", seed=0,
                                                  max_model_len=64))
    torch.manual_seed(4)
    hf = AutoModelForCausalLM.from_config(hf_config(SMOKE["qwen2"])).float().eval()
    eng.update_weights([list(hf.state_dict().items())])
    return eng, hf


def _loop(tok):
    pool = SyncToolExecutor(ToolRegistry(["calculator"]), max_workers=4)
    # every letter calls the calculator, so the random model makes calls often
    return AgentLoop(SmokeFormat({ch: ("calculator", "expression") for ch in "abcxy"}), pool, tok, LIMITS,
                     eos_ids=[tok.eos_token_id])


def _params(tok, loop, **kw):
    return SamplingParams(max_new_tokens=LIMITS.max_new_tokens, temperature=1.0, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id, stop_token_ids=loop.stop_token_ids(), **kw)


def _rows(tok):
    rows = smoke_task_dataset(N_SAMPLES, seed=0, task="add")
    prompts = [torch.tensor(tok(r["prompt"])["input_ids"], dtype=torch.long) for r in rows]
    return rows, prompts


@pytest.fixture(scope="module")
def rollout(setup, tok):
    eng, _ = setup
    rows, prompts = _rows(tok)
    loop = _loop(tok)
    session = eng.open_session(prompts, _params(tok, loop), seed=SESSION_SEED)
    assert isinstance(session, ReprefillSession)
    trajs = loop.run(session, len(prompts), [r["tool_kwargs"] for r in rows])
    session.close()
    return rows, prompts, trajs, loop


def _letter_ids(tok):
    return {int(tok(ch, add_special_tokens=False)["input_ids"][0]) for ch in CALL_LETTERS}


def test_multi_turn_log_probs_match_the_trainers_model(setup, rollout, tok):
    _, hf = setup
    rows, prompts, trajs, _ = rollout
    worst, after_obs_tokens = 0.0, 0
    for p, t in zip(prompts, trajs):
        assert len(t.response_ids) == len(t.response_mask) == len(t.log_probs) <= LIMITS.max_response_tokens
        m = t.response_mask.bool()
        assert torch.all(t.log_probs[~m] == 0)  # observations carry no log-prob
        ref = hf_logprobs(hf, p, t.response_ids)
        diff = (t.log_probs[m] - ref[m]).abs()
        assert diff.numel() and diff.max().item() < 1e-4, (t, ref)
        worst = max(worst, diff.max().item())
        if (~m).any():  # model tokens sampled after the first observation: the multi-turn part
            first_obs = int(torch.nonzero(~m)[0])
            after_obs_tokens += int(m[first_obs:].sum())
    with_calls = [t for t in trajs if t.tool_calls > 0 and t.observation_tokens > 0]
    print(f"multi-turn vLLM vs HF fp32: max |log-prob diff| on model tokens = {worst:.3e}; "
          f"{len(with_calls)}/{len(trajs)} samples with tool calls, {sum(t.tool_calls for t in trajs)} calls, "
          f"{after_obs_tokens} model tokens after an observation")
    assert len(with_calls) >= N_SAMPLES // 4
    assert sum(t.turns >= 2 for t in trajs) >= 3  # some samples went on after a tool result
    assert after_obs_tokens >= 10


def test_rollout_is_deterministic(setup, rollout, tok):
    """The same session seed gives the same trajectories (a second run is served partly from vLLM's
    prefix cache, and gives the same tokens and log-probs)."""
    eng, _ = setup
    rows, prompts, first, _ = rollout
    loop = _loop(tok)
    session = eng.open_session(prompts, _params(tok, loop), seed=SESSION_SEED)
    again = loop.run(session, len(prompts), [r["tool_kwargs"] for r in rows])
    for a, b in zip(first, again):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
        assert torch.allclose(a.log_probs, b.log_probs, atol=1e-5)


def test_segments_end_at_the_call_token(rollout, tok):
    """Every model segment ends at its first call letter or EOS (vLLM stopped there) or at the turn's
    token limit; a segment followed by an observation ends with a call letter."""
    _, _, trajs, loop = rollout
    letters = _letter_ids(tok)
    assert set(loop.stop_token_ids()) == letters
    ended_at_letter = 0
    for t in trajs:
        segs = segments(t.response_ids, t.response_mask)
        for k, (is_model, ids) in enumerate(segs):
            if not is_model:
                continue
            stops = [j for j, x in enumerate(ids.tolist()) if x in letters or x == tok.eos_token_id]
            assert stops in ([], [len(ids) - 1]), (tok.decode(ids), ids)  # nothing after the first stop
            if not stops:
                assert len(ids) == LIMITS.max_new_tokens or t.response_ids.numel() == LIMITS.max_response_tokens
            if k + 1 < len(segs):  # an observation follows: the segment was a call
                assert int(ids[-1]) in letters
                ended_at_letter += 1
    assert ended_at_letter >= 4


def test_session_generate_stops_at_the_stop_token(setup, tok):
    """One session turn, with and without the call letters as stop tokens (EOS ends both), same
    seed: the stopped segment is the unstopped one cut right after its first call letter, which it keeps."""
    eng, _ = setup
    letters = _letter_ids(tok)
    _, prompts = _rows(tok)
    loop = _loop(tok)
    n = 16
    base = SamplingParams(max_new_tokens=n, temperature=1.0, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    free = eng.open_session(prompts, base, seed=5).generate(range(len(prompts)), [None] * len(prompts),
                                                            [n] * len(prompts))
    with_stops = dataclasses.replace(base, stop_token_ids=loop.stop_token_ids())
    stopped = eng.open_session(prompts, with_stops, seed=5).generate(range(len(prompts)), [None] * len(prompts),
                                                                     [n] * len(prompts))
    cut = 0
    for f, s, fl, sl in zip(free.responses, stopped.responses, free.log_probs, stopped.log_probs):
        first = next((j for j, x in enumerate(f.tolist()) if x in letters), None)
        want = f if first is None else f[:first + 1]
        assert s.tolist() == want.tolist(), (tok.decode(f), tok.decode(s))
        assert torch.allclose(sl, fl[:len(s)], atol=1e-5)
        cut += first is not None and first + 1 < n
    assert cut >= 4  # the stop tokens really shortened segments


def test_observations_are_masked_and_decode_to_the_result(rollout, tok):
    """Walking each response independently of the mask: after a model segment that ends with a call
    letter come the tokens of the rendered result ``:<a+b>:``, once per call the segment made (cut
    only by the response limit); the mask is 0 exactly there and 1 everywhere else."""
    rows, _, trajs, _ = rollout
    letters = _letter_ids(tok)
    full_obs = 0
    for row, t in zip(rows, trajs):
        a, b = (int(x) for x in row["tool_kwargs"]["calculator"]["expression"].split("+"))
        obs_text = SmokeFormat().render_observation([ToolResult("calculator", str(a + b))])
        assert obs_text.startswith(f":{a + b}") and len(obs_text) == len(str(a + b)) + 2  # ":919="
        obs_ids = tok(obs_text, add_special_tokens=False)["input_ids"]
        ids = t.response_ids.tolist()
        want = [1] * len(ids)
        i, calls = 0, 0
        while i < len(ids):
            if ids[i] in letters and calls < LIMITS.max_tool_calls and i + 1 < len(ids):
                # a call letter that ends the response was not run (a limit); any other was. A segment
                # makes one call per call the format reads in it: one rendering each, back to back
                j, copies = i + 1, 0
                while j < len(ids) and (copies == 0 or calls + copies < LIMITS.max_tool_calls):
                    obs = ids[j:j + len(obs_ids)]
                    if obs != obs_ids[:len(obs)]:
                        break
                    assert tok.decode(obs) == obs_text[:len(obs)]
                    want[j:j + len(obs)] = [0] * len(obs)
                    full_obs += len(obs) == len(obs_ids)
                    copies, j = copies + 1, j + len(obs)
                assert copies >= 1, (tok.decode(ids), obs_text)  # a call letter mid-response: an observation follows
                calls, i = calls + copies, j
                continue
            i += 1
        assert t.response_mask.tolist() == want, (tok.decode(ids), t.response_mask.tolist())
        assert t.observation_tokens == want.count(0)
        assert t.tool_calls == calls
        assert t.tool_errors == 0
        for is_model, seg in segments(t.response_ids, t.response_mask):
            if not is_model:  # observations only: renderings of the result
                text = tok.decode(seg.tolist())
                assert text and (obs_text * LIMITS.max_tool_calls).startswith(text), text
    assert full_obs >= 4


def test_no_two_requests_of_a_session_share_a_seed(setup, tok):
    """Every vLLM request a multi-turn session sends has its own sampling seed (requests that share
    one draw the same noise: on a flat model one row's later segment repeats another's first)."""
    eng, _ = setup
    rows, prompts = _rows(tok)
    loop = _loop(tok)
    seeds: list[int] = []
    real = eng.llm.generate

    def spy(reqs, sps, **kw):
        seeds.extend(int(sp.seed) for sp in sps)
        return real(reqs, sps, **kw)

    eng.llm.generate = spy
    try:
        session = eng.open_session(prompts, _params(tok, loop), seed=SESSION_SEED)
        loop.run(session, len(prompts), [r["tool_kwargs"] for r in rows])
    finally:
        del eng.llm.generate
    assert len(seeds) > len(prompts)  # more than one turn
    assert len(set(seeds)) == len(seeds), sorted(seeds)


def test_smoke_run_with_multi_turn_vllm_rollout(tmp_path):
    """The whole workflow with the agent loop over vLLM: agent metrics in every row, log-probs that
    agree with the trainer on the model's tokens."""
    rows = run_smoke(tmp_path / "run", 2, "data.synthetic=add", "rollout.multi_turn.enabled=true")
    for r in rows:
        assert r["agent/tool_calls_mean"] > 0 and 0 < r["agent/observation_token_frac"] < 1
        assert r["rollout/logprob_diff_max"] < 1e-3  # vLLM's fp32 CPU kernels vs the trainer's
