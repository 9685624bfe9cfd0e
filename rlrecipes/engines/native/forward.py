"""How a native train engine scores tokens: the model run on a micro-batch (padded rows, packed rows,
or this rank's share of every row under Ulysses sequence parallelism) and its head turned into
per-token log-probs (and entropy) of the response tokens, laid out ``[b, R]`` for the loss closure.

A mixin of :class:`~rlrecipes.engines.native.train.NativeTrainEngine`; it uses the engine's
``model``, ``mesh``, ``device``, ``pad_token_id``, ``_vocab_parallel`` / ``_vocab_start`` and the
chunked head's settings (``_chunk_head``, ``_head_chunk``: :mod:`.head`). A micro-batch arrives on the
engine's device (``engines/base.py``, "Devices")."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from rlrecipes.algos.logprobs import logprobs_and_entropy, vocab_parallel_logprobs_and_entropy
from rlrecipes.engines.native import head as head_ops
from rlrecipes.engines.native.vision import decoder_columns, forward_inputs as vision_inputs, pad_positions, touch_vision


def response_len_of(mb: Mapping[str, Any]) -> int:
    for key in ("response_mask", "responses"):
        if key in mb:
            return int(mb[key].shape[-1])
    if "response_len" in mb:
        return int(mb["response_len"])
    raise KeyError("micro-batch needs 'response_mask' [b, R], 'responses' [b, R] or 'response_len'; "
                   f"got keys {sorted(mb)}")


class TokenScores:
    """The forward paths of the native train engines (see the module docstring)."""

    def _head_output(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._vocab_parallel:  # logits: this rank's vocabulary shard [b, R, V / tp]
            return vocab_parallel_logprobs_and_entropy(logits, targets, vocab_start=self._vocab_start,
                                                       group=self.mesh.tp_mesh.get_group(),
                                                       temperature=temperature, with_entropy=with_entropy)
        # chunked: no full fp32 [b, R, V] log-softmax (GBs per micro-batch at a 152k vocabulary)
        return logprobs_and_entropy(logits, targets, temperature=temperature, with_entropy=with_entropy)

    def _scores(self, mb: Mapping[str, Any], targets: torch.Tensor, temperature: float, with_entropy: bool,
                select=None, **inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of ``targets`` at the model outputs ``select`` picks (all when None)."""
        if not self._chunk_head:
            logits = self._logits(mb, **inputs)
            return self._head_output(logits if select is None else select(logits), targets, temperature,
                                     with_entropy)
        with head_ops.head_hidden_states(self.model) as head:
            hidden = self._logits(mb, **inputs)  # [.., H]: the final hidden states
        tp = dict(vocab_start=self._vocab_start, group=self.mesh.tp_mesh.get_group()) if self._vocab_parallel else {}
        return head_ops.chunked_logprobs(hidden if select is None else select(hidden), head, targets,
                                         temperature=temperature, with_entropy=with_entropy,
                                         chunk_tokens=self._head_chunk, **tp)

    def _forward(self, mb: Mapping[str, Any], temperature: float = 1.0,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.mesh.sp > 1:
            return self._forward_sp(mb, temperature, with_entropy)
        if "position_ids" in mb:
            return self._forward_packed(mb, temperature, with_entropy)
        input_ids = mb["input_ids"]  # [b, T]
        attention_mask = mb["attention_mask"]  # [b, T]
        R = response_len_of(mb)
        T = input_ids.shape[1]
        if not 0 < R < T:
            raise ValueError(f"response length R={R} must be in (0, T={T})")
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)  # [b, T]
        images = vision_inputs(mb)  # a VL model's pixels, grids and [3, b, T] M-RoPE positions
        position_ids = images.pop("position_ids", position_ids)
        # positions T-R-1 .. T-2 of the R + 1 kept: [b, R, V] logits (or [b, R, H] hidden states)
        return self._scores(mb, input_ids[:, T - R:], temperature, with_entropy, select=lambda x: x[:, :-1],
                            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            logits_to_keep=R + 1, **images)

    def _forward_packed(self, mb: Mapping[str, Any], temperature: float,
                        with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of concatenated samples (``batching.packed_micro_batch``): block-diagonal attention over
        ``[rows, L]``, the head only at the response columns; the results are scattered back to the
        closure's ``[b, R]`` layout (zeros at padding)."""
        keep = (mb["keep_rows"], mb["keep_cols"])  # [rows, U, .] -> [1, M, .]
        images = vision_inputs(mb)  # a VL model's pixels in layout order and [4, rows, L] positions
        position_ids = images.pop("position_ids", mb["position_ids"])
        out, ent = self._scores(mb, mb["targets"][None], temperature, with_entropy,
                                select=lambda x: x[keep][None], input_ids=mb["input_ids"],
                                position_ids=position_ids, logits_to_keep=mb["logit_index"], **images)
        return self._unpack(mb, out[0]), (self._unpack(mb, ent[0]) if ent is not None else None)

    def _unpack(self, mb: Mapping[str, Any], t: torch.Tensor) -> torch.Tensor:
        """A packed micro-batch's per-response-token values ``[M]`` -> the closure's ``[b, R]`` (zeros
        at padding)."""
        rows, cols = mb["unpack_rows"], mb["unpack_cols"]  # [M]
        shape = tuple(mb["response_mask"].shape)  # [b, R]
        return torch.zeros(shape, dtype=t.dtype, device=t.device).index_put((rows, cols), t)

    def _forward_sp(self, mb: Mapping[str, Any], temperature: float,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Ulysses (``layout.sp``): this rank runs the model on its ``1 / sp`` of every row (attention
        over all-to-all head shards, :mod:`.ulysses`), scores its own tokens, and the SP group's
        pieces are gathered into whole rows; then the same columns as :meth:`_forward` /
        :meth:`_forward_packed` are read out."""
        from .ulysses import gather_sequence, pad_to, sequence_mask

        sp, group, rank = self.mesh.sp, self.mesh.sp_group, self.mesh.sp_rank
        ids = mb["input_ids"]  # [b, T]
        T = ids.shape[1]
        ids_p = pad_to(ids, sp, self.pad_token_id)  # [b, Tp]
        if "position_ids" in mb:  # packed rows: attention stays inside each sample
            pos_p = pad_to(mb["position_ids"], sp)
            # a sample per row (batching's one_per_row): causal attention is exact, no [rows, T, T] mask
            mask = None if mb.get("one_per_row") else sequence_mask(position_ids=pos_p)
        else:
            valid = mb["attention_mask"].bool()  # [b, T]
            pos_p = pad_to((valid.long().cumsum(-1) - 1).clamp_(min=0), sp)
            mask = sequence_mask(valid=pad_to(valid, sp, False))
        targets = pad_to(torch.cat([ids[:, 1:], ids[:, :1]], 1), sp, self.pad_token_id)  # [b, Tp]: token t + 1
        w = ids_p.shape[1] // sp
        cols = slice(rank * w, (rank + 1) * w)
        images = vision_inputs(mb)
        if images:  # a VL model: the whole row embedded (images scattered in), the decoder on this rank's columns
            mrope = images.pop("position_ids")[-3:]  # [3, b, T] (a packed row's text positions are in pos_p)
            with decoder_columns(self.model, cols):
                out, ent = self._scores(mb, targets[:, cols], temperature, with_entropy, input_ids=ids_p,
                                        position_ids=pad_positions(mrope, sp), attention_mask=mask, **images)
        else:
            out, ent = self._scores(mb, targets[:, cols], temperature, with_entropy, input_ids=ids_p[:, cols],
                                    position_ids=pos_p[:, cols], attention_mask=mask)  # [b, w]
        out = gather_sequence(out, group, sp, rank)[:, :T]  # [b, T]: position t scores token t + 1
        ent = gather_sequence(ent, group, sp, rank)[:, :T] if ent is not None else None
        if "position_ids" in mb:  # each response token's (row, column) in the packed rows
            pick = (mb["keep_rows"], mb["logit_index"][mb["keep_cols"]])
            return self._unpack(mb, out[pick]), (self._unpack(mb, ent[pick]) if ent is not None else None)
        R = response_len_of(mb)
        if not 0 < R < T:
            raise ValueError(f"response length R={R} must be in (0, T={T})")
        return out[:, T - R - 1:T - 1], (ent[:, T - R - 1:T - 1] if ent is not None else None)

    def _logits(self, mb: Mapping[str, Any], **inputs) -> torch.Tensor:
        routing = getattr(self, "routing", None)
        if routing is not None and "routed_experts" in mb:
            routing.start_replay(mb["routed_experts"])  # the rollout's experts for every recorded token
        try:
            out = self.model(use_cache=False, **inputs).logits
            spec = getattr(self, "_vision", None)
            if spec is not None and "pixel_values" not in inputs:  # the vision tower runs on every rank
                out = out + touch_vision(self.model, spec, out)
            return out
        finally:
            if routing is not None:
                routing.stop()
