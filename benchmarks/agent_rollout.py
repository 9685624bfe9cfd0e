"""What do slow tools cost a multi-turn rollout? The agent loop with 100 ms tools vs instant ones.

``--samples`` (64) conversations, each making exactly ``--calls`` (2) tool calls, through the real
:class:`rlrecipes.agent.loop.AgentLoop`, a :class:`rlrecipes.agent.ToolExecutor` of ``--workers``
(64) threads and the native rollout engine's KV-cache turn session on a smoke model (random
weights, fp32), two ways:

- ``sleepy``: the tool sleeps ``--tool-s`` (0.1 s, ``time.sleep``) and returns ``"0"``;
- ``instant``: the same tool without the sleep (the tool-free baseline: the same tool format,
  limits, observations and number of turns, so the same generation work; the difference of the
  two walls is what the tools cost the rollout).

The ideal overhead is ``calls * tool_s`` (0.2 s): each sample waits for its own calls one after
the other, every sample's calls overlap all other work. ``serial_tool_s`` is what the calls would
cost run one after another (``samples * calls * tool_s`` = 12.8 s), and ``generate_1turn`` is one
plain single-turn ``engine.generate`` of the same prompts with the same per-turn sampling
parameters, for scale.

Making a random model call exactly ``--calls`` times: the benchmark's own tool format
(:class:`DigitFormat`) has the 10 digits of the smoke tokenizer as stop strings (a random smoke
model emits one about every third token) and ``parse`` returns one call of the benchmark's tool
for a segment that ended at a digit; ``AgentLimits(max_tool_calls=calls, max_turns=calls + 1)``
ends a sample at the turn after its last call. EOS is not a stop token of the engine here (the
model would end about one turn in eleven at EOS before any digit and make fewer calls); per-turn
``--max-new`` (24) makes a turn that never reaches a digit (p ~ 1e-4) rare. ``calls_mean`` reports
what was achieved.

Per run the loop's engine calls are counted (a proxy around the session): ``engine_calls``, the
rows, decode steps and seconds of each (``rows_per_call``, ``steps_per_call``, ``s_per_call``, in
order), ``gen_s`` (seconds inside the engine) and
``idle_s = wall - gen_s`` (the loop waiting for tools with nothing to generate, plus its own
bookkeeping). Sleepy and instant runs alternate, ``--repeats`` of each after ``--warmup``, same
seed every run; min and median walls are reported. Which samples share an engine call depends on
tool timing, so the sampled tokens (and ``tokens``) differ a little between modes and runs.

Output: one JSON line per measured run, then one summary line per mode (min / median) and a
final ``summary`` line with ``overhead_s = median wall(sleepy) - median wall(instant)``
(``overhead_min_s`` from the minima) and ``within_target`` (``overhead_s <= --target-s``, 0.6).
Measurements only, no assertions on timings.

Usage: ``python benchmarks/agent_rollout.py [--samples 64] [--calls 2] [--tool-s 0.1] [--workers 64]
[--max-new 24] [--warmup 2] [--repeats 5] [--device cpu] [--threads 0]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rlrecipes.agent import ParsedTurn, ToolCall, ToolFormat, ToolExecutor, ToolRegistry  # noqa: E402
from rlrecipes.agent.loop import AgentLimits, AgentLoop, agent_metrics, agent_sums  # noqa: E402
from benchmarks.rollout_vs_generate import ensure_process_group  # noqa: E402

DIGITS = "0123456789"
TOOL = "probe"


class DigitFormat(ToolFormat):
    """A tool format for a random smoke model: a segment that ends at a digit is one call of
    ``probe`` (no arguments); the observation is ``:<result>:``."""

    name = "bench-digits"

    def parse(self, text: str) -> ParsedTurn:
        if text and text[-1] in DIGITS:
            return ParsedTurn(text[:-1], [ToolCall(TOOL, {}, text[-1])])
        return ParsedTurn(text, [])

    def call_complete(self, text: str) -> bool:
        return bool(text) and text[-1] in DIGITS

    def stop_text(self) -> list[str]:
        return list(DIGITS)

    def render_observation(self, results, calls=(), *, tokenizer=None, tools=None) -> str:
        return "".join(f":{r.content.strip() if r.ok else '?'}:" for r in results)


def make_tool(seconds: float):
    """The benchmark's tool: sleeps ``seconds`` (none when 0) and returns ``"0"``."""

    def probe() -> str:
        """Wait a fixed time and return 0."""
        if seconds > 0:
            time.sleep(seconds)
        return "0"

    return probe


class CountingSession:
    """The engine's turn session, with each ``generate`` call's rows and seconds recorded."""

    def __init__(self, session: Any):
        self.session = session
        self.rows: list[int] = []
        self.call_s: list[float] = []
        self.steps: list[int] = []

    def generate(self, rows, appended, max_new_tokens):
        t = time.perf_counter()
        out = self.session.generate(rows, appended, max_new_tokens)
        self.call_s.append(time.perf_counter() - t)
        self.rows.append(len(rows))
        self.steps.append(max((int(x.numel()) for x in out.responses), default=0))
        return out

    def close(self) -> None:
        self.session.close()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2, help="tool calls per sample")
    ap.add_argument("--tool-s", type=float, default=0.1, help="seconds the sleepy tool sleeps")
    ap.add_argument("--workers", type=int, default=64, help="ToolExecutor threads")
    ap.add_argument("--max-new", type=int, default=24, help="per-turn max_new_tokens")
    ap.add_argument("--family", default="qwen2")
    ap.add_argument("--device", default=None, help="engine device (default: the engine's choice)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target-s", type=float, default=0.6, help="the overhead target")
    a = ap.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)

    from transformers import AutoTokenizer

    from rlrecipes.data.smoke import build_smoke_tokenizer, smoke_task_dataset
    from rlrecipes.engines.base import SamplingParams
    from rlrecipes.engines.native.rollout import NativeRolloutEngine
    from rlrecipes.models import SMOKE

    created = ensure_process_group()
    try:
        with tempfile.TemporaryDirectory() as d:
            tok = AutoTokenizer.from_pretrained(str(build_smoke_tokenizer(d)))
        eng = NativeRolloutEngine(SMOKE[a.family], dtype="fp32", seed=a.seed, device=a.device)
        prompts = [torch.tensor(tok(r["prompt"])["input_ids"], dtype=torch.long)
                   for r in smoke_task_dataset(a.samples, seed=a.seed)]
        fmt = DigitFormat()
        limits = AgentLimits(max_turns=a.calls + 1, max_tool_calls=a.calls, max_response_tokens=(a.calls + 1) * 64,
                             max_new_tokens=a.max_new, max_observation_tokens=16)
        loops = {}
        for mode, seconds in (("sleepy", a.tool_s), ("instant", 0.0)):
            reg = ToolRegistry()
            reg.add(make_tool(seconds), name=TOOL)
            loops[mode] = AgentLoop(fmt, ToolExecutor(reg, max_workers=a.workers, timeout_s=max(10.0, 10 * a.tool_s)),
                                    tok, limits, eos_ids=[tok.eos_token_id])
        stops = loops["sleepy"].stop_token_ids()
        # EOS is left out of the engine's stops on purpose (see the module doc): every turn ends at a digit
        params = SamplingParams(max_new_tokens=a.max_new, temperature=1.0, eos_token_id=None,
                                pad_token_id=tok.pad_token_id, stop_token_ids=stops)
        base = {"samples": a.samples, "calls_per_sample": a.calls, "tool_s": a.tool_s, "workers": a.workers,
                "max_new_tokens": a.max_new, "family": a.family, "device": str(eng.device),
                "threads": torch.get_num_threads(), "decode": eng.decode_path}

        def agent_run(mode: str) -> dict:
            sync(eng.device)
            t0 = time.perf_counter()
            sess = CountingSession(eng.open_session(prompts, params, seed=a.seed))
            try:
                traj = loops[mode].run(sess, len(prompts))
            finally:
                sess.close()
            sync(eng.device)
            wall = time.perf_counter() - t0
            m = agent_metrics(agent_sums(traj))
            lat = [x for t in traj for x in t.tool_latency_s]
            gen = sum(sess.call_s)
            return {"wall_s": wall, "gen_s": gen, "idle_s": wall - gen,
                    "engine_calls": len(sess.rows), "rows_per_call": sess.rows, "steps_per_call": sess.steps,
                    "s_per_call": [round(x, 4) for x in sess.call_s],
                    "calls_mean": m["agent/tool_calls_mean"], "turns_mean": m["agent/turns_mean"],
                    "tool_latency_mean_s": statistics.fmean(lat) if lat else 0.0,
                    "tool_latency_max_s": max(lat) if lat else 0.0,
                    "tokens": int(sum(int(t.response_mask.sum()) for t in traj)),
                    "errors": int(sum(t.tool_errors for t in traj))}

        def generate_run() -> dict:
            sync(eng.device)
            t0 = time.perf_counter()
            out = eng.generate(prompts, params, seed=a.seed)
            sync(eng.device)
            wall = time.perf_counter() - t0
            return {"wall_s": wall, "tokens": int(sum(x.numel() for x in out.responses))}

        for _ in range(a.warmup):
            agent_run("instant"), agent_run("sleepy"), generate_run()
        results: dict[str, list[dict]] = {"sleepy": [], "instant": [], "generate_1turn": []}
        for i in range(a.repeats):  # interleaved: a noisy shared host slows every mode alike
            for mode in ("sleepy", "instant", "generate_1turn"):
                r = generate_run() if mode == "generate_1turn" else agent_run(mode)
                results[mode].append(r)
                print(json.dumps({"measurement": mode, "repeat": i, **r}), flush=True)

        walls = {k: [r["wall_s"] for r in v] for k, v in results.items()}
        for mode, rs in results.items():
            row = {"measurement": f"{mode}_stats", "wall_min_s": min(walls[mode]),
                   "wall_median_s": statistics.median(walls[mode]), "repeats": a.repeats,
                   "tokens_mean": statistics.fmean(r["tokens"] for r in rs)}
            if mode != "generate_1turn":
                row.update(calls_mean=statistics.fmean(r["calls_mean"] for r in rs),
                           engine_calls_median=statistics.median(r["engine_calls"] for r in rs),
                           gen_median_s=statistics.median(r["gen_s"] for r in rs),
                           idle_median_s=statistics.median(r["idle_s"] for r in rs))
            print(json.dumps({**row, **base}), flush=True)
        overhead = statistics.median(walls["sleepy"]) - statistics.median(walls["instant"])
        print(json.dumps({"measurement": "summary", "overhead_s": overhead,
                          "overhead_min_s": min(walls["sleepy"]) - min(walls["instant"]),
                          "ideal_overhead_s": a.calls * a.tool_s, "target_s": a.target_s,
                          "within_target": overhead <= a.target_s,
                          "serial_tool_s": a.samples * a.calls * a.tool_s,
                          "generate_1turn_median_s": statistics.median(walls["generate_1turn"]), **base}), flush=True)
        for loop in loops.values():
            loop.pool.close()
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
