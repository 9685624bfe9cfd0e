"""The agent loop: multi-turn generation with tool calls, over a rollout engine's turn session.

Per sample: generate a segment until EOS, a stop token of the tool format or the turn's token
limit; parse it; run its calls in the :class:`ToolExecutor` (concurrently with everything else);
append the rendered results as *observation* tokens; continue on the same sample, until it ends
its turn without a call, or reaches ``max_turns``, ``max_tool_calls`` or ``max_response_tokens``.

Scheduling. The loop never waits for a tool while some sample can generate: each engine call
takes every sample that is ready (its tool results are in, or it has made no call yet), and the
samples whose tools are still running join a later call. When no sample is ready, the loop waits
for the first tool result. A slow tool holds its own sample only (for at most its timeout), never
the batch; the price is that which samples share an engine call depends on tool timing, so a
multi-turn rollout is reproducible only as far as its tools' timing is (single-turn rollouts are
not affected).

What the trainer gets, per sample: ``response_ids`` (the model's segments and the observations, in
order), ``response_mask`` (1 on the model's tokens, 0 on observation tokens) and ``log_probs`` (the
rollout's, 0 on observation tokens). Observation tokens are the format's rendering of the results
(Qwen: the chat template's own tool turn), tokenized without special-token additions, so the
trainer sees the token sequence the rollout saw.

The session (``engines/base.py`` ``TurnSession``) is duck-typed here: ``generate(rows, appended,
max_new_tokens)`` returning an object with ``responses`` and ``log_probs``. This module imports
nothing from the rest of rlrecipes.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .parsing import ToolCall, ToolFormat
from .executor import ToolExecutor
from .tools import ToolResult


@dataclass(frozen=True)
class AgentLimits:
    """``rollout.multi_turn``'s limits."""

    max_turns: int = 4
    max_tool_calls: int = 4
    max_response_tokens: int = 256
    max_new_tokens: int = 64
    """Per turn (``rollout.sampling.max_new_tokens``)."""
    max_observation_tokens: int = 256


@dataclass
class Trajectory:
    """One sample's multi-turn response."""

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    turns: int
    tool_calls: int
    tool_errors: int
    tool_latency_s: list[float]
    """Each call's own run time."""
    truncated: bool
    """Ended by a limit (tokens, turns, calls), not by the model's own end of turn."""
    observation_tokens: int


@dataclass
class _Row:
    ids: list[torch.Tensor] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    lps: list[torch.Tensor] = field(default_factory=list)
    length: int = 0
    turns: int = 0
    calls: int = 0
    errors: int = 0
    latency: list[float] = field(default_factory=list)
    truncated: bool = False
    done: bool = False
    obs_tokens: int = 0
    pending: Optional[tuple[list[Future], list[ToolCall], float]] = None
    appended: Optional[torch.Tensor] = None
    turn: list = field(default_factory=list)
    """The segments of the turn in progress (a turn may pause at a stop token that completes no call)."""
    turn_len: int = 0


class AgentLoop:
    """Runs the agent loop for one rollout call (see the module doc).

    Args:
        fmt: the tool format (how calls are written and results rendered).
        executor: runs the calls (its registry holds the tools).
        tokenizer: encodes observations and decodes segments.
        limits: the per-sample limits.
        eos_ids: the tokens that end an assistant turn.
        coalesce_s: when no sample is ready, after the first tool result the loop waits up to this
            long for more before the next engine call (an engine call steps the whole session, so
            one call for many samples beats several for a few).
    """

    def __init__(self, fmt: ToolFormat, executor: ToolExecutor, tokenizer: Any, limits: AgentLimits, eos_ids: Sequence[int],
                 coalesce_s: float = 0.005):
        self.fmt, self.executor, self.tok, self.limits = fmt, executor, tokenizer, limits
        self.coalesce_s = coalesce_s
        self.eos = {int(e) for e in eos_ids}
        self.tools = executor.registry.schemas()
        self._stops: Optional[tuple[int, ...]] = None

    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids of the format's stop strings (each must be one token of the tokenizer); computed
        once."""
        if self._stops is None:
            self._stops = self._stop_token_ids()
        return self._stops

    def _stop_token_ids(self) -> tuple[int, ...]:
        out = []
        for text in self.fmt.stop_text():
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(f"tool format {self.fmt.name!r}: stop string {text!r} is {len(ids)} tokens of this "
                                 "tokenizer; it must be one")
            out.append(int(ids[0]))
        return tuple(out)

    # ------------------------------------------------------------------------------ the loop
    def run(self, session: Any, n: int, tool_kwargs: Optional[Sequence[Optional[dict]]] = None) -> list[Trajectory]:
        """Run ``n`` conversations of ``session`` to their end; one :class:`Trajectory` each."""
        L = self.limits
        stops = set(self.stop_token_ids())
        rows = [_Row() for _ in range(n)]
        kwargs = list(tool_kwargs) if tool_kwargs is not None else [None] * n
        while True:
            self._harvest(rows)
            ready = [i for i, r in enumerate(rows) if not r.done and r.pending is None]
            if not ready:
                if not any(r.pending is not None for r in rows):
                    break
                waiting = [f for r in rows if r.pending is not None for f in r.pending[0] if not f.done()]
                if waiting:  # (all done already: harvest them on the next pass)
                    wait(waiting, return_when=FIRST_COMPLETED)
                    # calls started together end together: gather the ones a moment behind the first,
                    # so they share the next engine call instead of waiting for a one-sample call
                    wait(waiting, timeout=self.coalesce_s)
                continue
            budgets = [min(L.max_new_tokens - rows[i].turn_len, L.max_response_tokens - rows[i].length) for i in ready]
            out = session.generate(ready, [rows[i].appended for i in ready], budgets)
            for i, seg, lp in zip(ready, out.responses, out.log_probs):
                self._after_segment(rows[i], seg.reshape(-1).long(), lp.reshape(-1).float(), kwargs[i], stops)
        return [self._trajectory(r) for r in rows]

    def _after_segment(self, r: _Row, seg: torch.Tensor, lp: torch.Tensor, kwargs: Optional[dict],
                       stops: set) -> None:
        """A turn's next segment: end the sample, run its calls, or go on with the same turn."""
        L = self.limits
        r.appended = None
        if r.turn_len == 0:
            r.turns += 1
        self._add(r, seg, lp, model=True)
        r.turn_len += int(seg.numel())
        r.turn.append(seg)
        last = int(seg[-1]) if seg.numel() else None
        ended_turn = last is not None and last in self.eos
        text = self._text(torch.cat(r.turn))
        stopped = last is not None and not ended_turn and last in stops
        out_of_room = r.turn_len >= L.max_new_tokens or r.length >= L.max_response_tokens
        if stopped and not self.fmt.call_complete(text) and not out_of_room:
            return  # a stop token that completes no call (e.g. a ')' of plain arithmetic): the turn goes on
        calls = self.fmt.parse(text).calls if (ended_turn or stopped) else []
        r.turn, r.turn_len = [], 0
        if not calls:
            r.done = True
            r.truncated = not ended_turn  # the turn's or the response's token limit
            return
        room = L.max_tool_calls - r.calls
        if room <= 0 or r.turns >= L.max_turns or r.length >= L.max_response_tokens:
            r.done, r.truncated = True, True
            return
        calls = calls[:room]
        if kwargs:  # the sample's own tool arguments, under what the model wrote
            calls = [ToolCall(c.name, {**kwargs.get(c.name, {}), **c.arguments}, c.raw, c.error) for c in calls]
        r.calls += len(calls)
        r.pending = (self.executor.submit(calls), calls, time.perf_counter())

    def _harvest(self, rows: list[_Row]) -> None:
        """Turn every finished set of tool results into its sample's observation tokens."""
        L = self.limits
        for r in rows:
            if r.pending is None or not all(f.done() for f in r.pending[0]):
                continue
            futures, calls, _ = r.pending
            r.pending = None
            results: list[ToolResult] = ToolExecutor.results(futures)
            r.latency.extend(x.latency_s for x in results)  # the tools' own time, not the loop's
            r.errors += sum(1 for x in results if not x.ok)
            room = min(L.max_observation_tokens, L.max_response_tokens - r.length - 1)  # 1: the model answers
            obs = self._observation(results, calls, room)
            if obs is None:  # even the shortened results do not fit: the sample ends on its call
                r.done, r.truncated = True, True
                continue
            self._add(r, obs, torch.zeros(obs.numel()), model=False)
            r.obs_tokens += int(obs.numel())
            r.appended = obs

    def _observation(self, results: list[ToolResult], calls: list[ToolCall], room: int) -> Optional[torch.Tensor]:
        """The rendered results as tokens, within ``room``: a result too long is cut (its text, then
        rendered again, so the format's own frame, e.g. the chat template's tool turn, stays whole);
        None when nothing fits."""
        if room <= 0:
            return None
        cut = max(len(x.content) for x in results) if results else 0
        for _ in range(12):
            shown = [x if len(x.content) <= cut else dataclasses.replace(x, content=x.content[:cut] + " ...[cut]")
                     for x in results]
            text = self.fmt.render_observation(shown, calls, tokenizer=self.tok, tools=self.tools)
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= room:
                return torch.tensor(ids, dtype=torch.long)
            if cut == 0:
                return None
            cut //= 2
        return None

    def _add(self, r: _Row, ids: torch.Tensor, lp: torch.Tensor, *, model: bool) -> None:
        r.ids.append(ids)
        r.lps.append(lp)
        r.masks.append(torch.full((ids.numel(),), 1 if model else 0, dtype=torch.long))
        r.length += int(ids.numel())

    def _text(self, ids: torch.Tensor) -> str:
        """A segment's text for the format's parser: special tokens (EOS, padding) are not text."""
        return self.tok.decode(ids.tolist(), skip_special_tokens=True)

    @staticmethod
    def _trajectory(r: _Row) -> Trajectory:
        cat = (lambda xs, dt: torch.cat(xs).to(dt) if xs else torch.zeros(0, dtype=dt))
        return Trajectory(cat(r.ids, torch.long), cat(r.masks, torch.long), cat(r.lps, torch.float32), r.turns, r.calls,
                          r.errors, r.latency, r.truncated, r.obs_tokens)


def agent_sums(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Sums over samples of what the ``agent/*`` metrics average (the workflow sums them over
    workers, then divides)."""
    return {"agent_n": len(trajectories),
            "agent_turns": sum(t.turns for t in trajectories),
            "agent_calls": sum(t.tool_calls for t in trajectories),
            "agent_errors": sum(t.tool_errors for t in trajectories),
            "agent_latency_sum": sum(sum(t.tool_latency_s) for t in trajectories),
            "agent_latency_n": sum(len(t.tool_latency_s) for t in trajectories),
            "agent_truncated": sum(int(t.truncated) for t in trajectories),
            "agent_obs_tokens": sum(t.observation_tokens for t in trajectories),
            "agent_tokens": sum(int(t.response_ids.numel()) for t in trajectories)}


def agent_metrics(sums: dict) -> dict[str, float]:
    """The ``agent/*`` row entries from summed :func:`agent_sums`."""
    n = sums.get("agent_n", 0)
    if not n:
        return {}
    calls = sums.get("agent_calls", 0)
    return {"agent/turns_mean": sums["agent_turns"] / n,
            "agent/tool_calls_mean": calls / n,
            "agent/tool_error_frac": sums["agent_errors"] / calls if calls else 0.0,
            "agent/tool_latency_s": (sums["agent_latency_sum"] / sums["agent_latency_n"]
                                     if sums.get("agent_latency_n") else 0.0),
            "agent/truncated_frac": sums["agent_truncated"] / n,
            "agent/observation_token_frac": (sums["agent_obs_tokens"] / sums["agent_tokens"]
                                             if sums.get("agent_tokens") else 0.0)}


def segments(response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[tuple[bool, torch.Tensor]]:
    """``(is_model, ids)`` runs of one response: the model's segments and the observations between."""
    out: list[tuple[bool, torch.Tensor]] = []
    m = response_mask.reshape(-1).bool()
    if not m.numel():
        return out
    cuts = (torch.nonzero(m[1:] != m[:-1]).reshape(-1) + 1).tolist()
    for a, b in zip([0] + cuts, cuts + [m.numel()]):
        out.append((bool(m[a]), response_ids[a:b]))
    return out


__all__ = ["AgentLimits", "AgentLoop", "Trajectory", "agent_metrics", "agent_sums", "segments"]
