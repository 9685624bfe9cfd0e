"""Multi-turn sessions of the native rollout engine: each sample's KV cache lives across turns.

A :class:`KVSession` holds one K/V buffer of ``B`` rows (the session's samples) for the whole
agent loop. A turn call (:meth:`KVSession.generate`) names the rows that go on; for each it feeds
the tokens not yet in the cache -- the last token the row sampled (sampled, never fed) and the
tool observation appended after it -- as one chunk (:meth:`FastDecoder.extend`), then decodes the
named rows until each stops (EOS, a stop token, its own token limit). Nothing of a conversation
is computed twice.

Columns are shared by the rows: a call appends ``chunk + steps`` columns to every row, and a row
that sat the call out (or whose chunk was shorter) has holes there, masked out of its attention
through the per-row keep-mask (``self.keep [B, L]``). Position ids are per row and count only a
row's real tokens, so the model sees each conversation exactly as the trainer's forward pass over
``prompt + response`` does (positions ``0 .. len - 1``, no gaps). When a call would not fit, the
buffers are compacted if more than half of their columns are holes (each row's attended columns
move to the front; keys are stored rotated, so nothing is recomputed), and grow (doubling)
otherwise: holes are the cost of batching rows that are at different turns, bounded this way.

Sampling is the engine's :func:`~rlrecipes.engines.native.rollout.sample_next` with its generator,
reseeded once per session; with TP > 1 the tokens of TP rank 0 are broadcast, as in ``sample``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from rlrecipes.engines.base import RolloutOutput, SamplingParams, TurnSession


class KVSession(TurnSession):
    """See the module doc. Built by ``NativeRolloutEngine.open_session`` (fast decode path only)."""

    def __init__(self, engine, prompts: Sequence[torch.Tensor], params: SamplingParams, *, seed: int,
                 stop_ids: Sequence[int], sample_next: Callable):
        self.eng, self.params, self.sample_next = engine, params, sample_next
        self.dev = engine.device
        self.fast = engine._fast
        self.prompts = [p.reshape(-1).long() for p in prompts]
        self.B = len(self.prompts)
        self.stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=self.dev)
        self.next_pos = torch.zeros(self.B, dtype=torch.long, device=self.dev)  # [B]: position of the next token fed
        self.pending = [p for p in self.prompts]  # tokens of each row not yet in the cache
        self.keep = None  # [B, L] bool
        self.started = False
        self.compactions = 0
        self.fast.release()  # a plain generate before may have left its buffers filled
        engine.reseed(seed)

    # ------------------------------------------------------------------------------ capacity
    def _compact(self) -> None:
        """Drop the holes: every row's attended columns move to the front, in order."""
        n = self.fast.buffers.length
        keep = self.keep[:, :n]
        counts = keep.sum(1)  # [B]
        W = int(counts.max())
        index = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :W]  # kept columns first
        self.fast.compact(index)
        self.keep.zero_()
        self.keep[:, :W] = torch.arange(W, device=self.dev)[None, :] < counts[:, None]
        self.compactions += 1

    def _ensure(self, needed: int) -> None:
        """The buffers and the keep-mask hold at least ``needed`` columns."""
        cap = self.keep.shape[1]
        if needed <= cap:
            return
        new = max(needed, 2 * cap)
        self.fast.grow(new)
        keep = torch.zeros((self.B, new), dtype=torch.bool, device=self.dev)
        keep[:, :cap] = self.keep
        self.keep = keep

    # ------------------------------------------------------------------------------ a turn
    @torch.no_grad()
    def generate(self, rows, appended, max_new_tokens) -> RolloutOutput:
        rows = [int(r) for r in rows]
        if not rows:
            return RolloutOutput([], [])
        if self.eng._sleeping_weights is not None:
            raise RuntimeError("turn session on a sleeping engine: call wake() first")
        for r, a in zip(rows, appended):
            if a is not None and a.numel():
                self.pending[r] = torch.cat([self.pending[r], a.reshape(-1).long()])
        named_rows = set(rows)
        named = torch.zeros(self.B, dtype=torch.bool, device=self.dev)
        named[rows] = True
        budget = torch.zeros(self.B, dtype=torch.long, device=self.dev)
        budget[rows] = torch.tensor([int(n) for n in max_new_tokens], dtype=torch.long, device=self.dev)
        steps = int(budget.max())
        # the chunk: each named row's pending tokens, left-padded; other rows feed nothing this call
        feed = [self.pending[r] if r in named_rows else self.pending[r][:0] for r in range(self.B)]
        T = max(1, max(int(x.numel()) for x in feed))
        pad = self.params.pad_token_id
        ids = torch.full((self.B, T), pad, dtype=torch.long)
        chunk_keep = torch.zeros((self.B, T), dtype=torch.bool)
        for r, x in enumerate(feed):
            if x.numel():
                ids[r, T - x.numel():] = x
                chunk_keep[r, T - x.numel():] = True
        ids, chunk_keep = ids.to(self.dev), chunk_keep.to(self.dev)
        pos = self.next_pos[:, None] + (chunk_keep.long().cumsum(1) - 1).clamp(min=0)  # [B, T]
        n = self.fast.buffers.length if self.started else 0
        if not self.started:
            capacity = T + 2 * steps + 16
            logits = self.fast.extend(ids, chunk_keep, pos, chunk_keep[:, :0], capacity=capacity)
            self.keep = torch.zeros((self.B, capacity), dtype=torch.bool, device=self.dev)
            self.started = True
        else:
            if n + T + steps > self.keep.shape[1] and int(self.keep[:, :n].sum(1).max()) * 2 <= n:
                self._compact()  # more than half of the columns are holes: drop them rather than grow
                n = self.fast.buffers.length
            self._ensure(n + T + steps)
            logits = self.fast.extend(ids, chunk_keep, pos, self.keep[:, :n], capacity=self.keep.shape[1])
        self._ensure(n + T + steps)
        self.keep[:, n:n + T] = chunk_keep
        self.next_pos += chunk_keep.sum(1)
        for r in rows:
            self.pending[r] = self.pending[r][:0]
        return self._decode(rows, named, budget, steps, logits)

    def _decode(self, rows, named, budget, steps, logits) -> RolloutOutput:
        p, eng, dev = self.params, self.eng, self.dev
        col0 = self.fast.buffers.length
        self.fast.set_steps(self.next_pos[:, None], steps, self.keep, logits)
        out_tok = torch.full((self.B, steps), p.pad_token_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((self.B, steps), dtype=torch.float32, device=dev)
        active = named.clone()
        count = torch.zeros(self.B, dtype=torch.long, device=dev)
        for t in range(steps):
            tok, lp = self.sample_next(logits, temperature=p.temperature, top_k=max(p.top_k, 0), top_p=p.top_p,
                                       generator=eng.generator)
            if eng._tp_group is not None:
                dist.broadcast(tok, src=eng._tp_src, group=eng._tp_group)
            tok = tok.masked_fill(~active, p.pad_token_id)
            out_tok[:, t] = tok
            out_lp[:, t] = lp.masked_fill(~active, 0.0)
            count += active.long()
            ended = active & (torch.isin(tok, self.stop) | (count >= budget))
            feed_on = active & ~ended  # the rows whose token is fed back now
            active &= ~ended
            if not bool(active.any()):
                break
            col = col0 + t
            self.keep[:, col] = feed_on
            logits = self.fast.step(tok, t)
            self.next_pos += feed_on.long()
        # the last sampled token of every row that stopped is pending (fed with its next chunk)
        out_tok, out_lp, count = out_tok.cpu(), out_lp.cpu(), count.cpu()
        responses, logps = [], []
        for r in rows:
            k = int(count[r])
            responses.append(out_tok[r, :k])
            logps.append(out_lp[r, :k])
            self.pending[r] = out_tok[r, k - 1:k].clone() if k else self.pending[r]
        gen = int(count.sum())
        return RolloutOutput(responses, logps, {"rollout/tokens": gen})

    def close(self) -> None:
        self.fast.release()
        self.keep = None


__all__ = ["KVSession"]
