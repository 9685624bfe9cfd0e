"""The tool-call executor: a bounded set of threads that runs tool calls concurrently, each call under
its own timeout.

The rollout's agent loop submits a sample's calls as soon as they are parsed and goes on
generating the other samples; one slow tool then holds one pool thread for at most its timeout,
never the batch. Results come back in call order, one per call, always a
:class:`~rlrecipes.agent.tools.ToolResult` (a call that could not be parsed, an unknown tool, an
exception, a timeout: an error observation).

How a timeout is enforced: the sandboxed ``python`` tool's process tree is killed at the limit;
any other tool runs in its own daemon thread that the pool stops waiting for at the limit (Python
cannot stop a thread, so a tool that never returns keeps that thread, not a pool slot).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from .parsing import ToolCall
from .tools import ToolRegistry, ToolResult


class ToolExecutor:
    """Run :class:`ToolCall` s of a registry in ``max_workers`` threads.

    Args:
        registry: the tools.
        max_workers: calls that run at the same time (more wait in a queue).
        timeout_s: the per-call timeout (default: the registry's ``default_timeout_s``); it
            counts from the moment the call starts, not from ``submit``.
    """

    def __init__(self, registry: ToolRegistry, max_workers: int = 8, timeout_s: float | None = None):
        if max_workers < 1:
            raise ValueError(f"ToolExecutor: max_workers must be >= 1; got {max_workers}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"ToolExecutor: timeout_s must be > 0; got {timeout_s}")
        self.registry = registry
        self.max_workers = max_workers
        self.timeout_s = registry.default_timeout_s if timeout_s is None else timeout_s
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rlrecipes-tool")

    def submit(self, calls: Sequence[ToolCall], timeout_s: float | None = None) -> list[Future]:
        """Start ``calls``; one future per call, in call order, each resolving to a ToolResult.

        Returns at once. A call that could not be parsed gets an already finished future with its
        parse error as the observation.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        futures = []
        for call in calls:
            if call.error is not None:
                f: Future = Future()
                f.set_result(ToolResult(call.name or "?", f"Error: {call.error}", False, "parse_error"))
            else:
                f = self._executor.submit(self.registry.run, call.name, call.arguments, timeout)
            futures.append(f)
        return futures

    @staticmethod
    def results(futures: Sequence[Future]) -> list[ToolResult]:
        """Wait for ``futures`` (from :meth:`submit`) and return their results in the same order."""
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 -- registry.run does not raise; keep the contract anyway
                out.append(ToolResult("?", f"Error: the tool call failed: {type(e).__name__}: {e}", False, "exception"))
        return out

    def run(self, calls: Sequence[ToolCall], timeout_s: float | None = None) -> list[ToolResult]:
        """:meth:`submit` then :meth:`results`: the calls run concurrently, results in call order."""
        return self.results(self.submit(calls, timeout_s))

    def close(self, wait: bool = True) -> None:
        """Stop accepting calls; ``wait``: until the running ones have finished."""
        self._executor.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
