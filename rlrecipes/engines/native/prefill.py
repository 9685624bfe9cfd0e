"""Prompt prefill of :class:`~rlrecipes.engines.native.decode.FastDecoder`: the prompts through the
layers' hand-written attention, K/V written straight into the decoder's :class:`KVBuffers`.

Two layouts of the same prompts (``FastDecoder(prefill_layout=...)``, the engine's ``prefill_layout``):

* ``"padded"``: the left-padded ``[B, P]`` square, a causal (+ left-padding) mask, one batched
  ``scaled_dot_product_attention`` per layer. Every matmul and the MLP / MoE see ``B * P`` tokens
  and attention costs ``B * P^2``, whatever the prompts' own lengths;
* ``"packed"``: the prompts concatenated into one row of ``T = sum(P_i)`` tokens (no pad token
  through any projection, norm or MLP / MoE), attention restricted to each prompt
  (``device.varlen_attention``: FlashAttention's varlen kernel on CUDA, ``npu_fusion_attention``
  with the ``TND`` layout on Ascend, one SDPA per prompt on the host), ``sum(P_i^2)`` attention
  work. Each token's K/V are scattered to the buffer column the padded layout gives it (row ``b``'s
  prompt ends at column ``P``; its pad columns ``[0, P - P_b)`` are zeroed and masked as before), so
  decode steps, the static / captured step, :meth:`extend`, ``grow`` and ``compact`` see the same
  buffers either way. The last layer computes its query, ``o_proj`` and MLP at each prompt's last
  token only, attending over the buffers like a decode step.

With no padding (all prompts of one length) or an empty prompt (a multi-turn row that sits the first
call out), ``"packed"`` runs the padded square: the same work, or rows the packed row cannot hold.
Multi-turn chunks after the first (:meth:`extend` with filled columns) attend to each row's own
history through a per-row mask and stay padded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rlrecipes import device as devmod

#: the prefill layouts (module docstring); the engine's default is ``rollout.DEFAULT_PREFILL_LAYOUT``
PREFILL_LAYOUTS = ("packed", "padded")


class PackedPrompts:
    """Where the packed row's tokens come from and go: ``lengths`` (host ints), ``rows``/``cols [T]``
    (each token's padded ``[B, P]`` position, i.e. its buffer row and column), ``last [B]`` (each
    prompt's last token in the row), ``cu [B + 1]`` (prompt offsets, int32), ``pad_rows``/``pad_cols``
    (the padded positions no token fills). Index tensors are built on the host and moved once."""

    def __init__(self, lengths: list[int], P: int, device: torch.device):
        lens = torch.tensor(lengths, dtype=torch.long)  # [B]
        B = lens.numel()
        cu = torch.zeros(B + 1, dtype=torch.long)
        cu[1:] = lens.cumsum(0)
        rows = torch.repeat_interleave(torch.arange(B), lens)  # [T]
        cols = torch.arange(int(cu[-1])) - cu[rows] + (P - lens[rows])  # [T]: right-aligned, as left_pad
        pads = P - lens
        pad_rows = torch.repeat_interleave(torch.arange(B), pads)
        pad_cu = torch.zeros(B + 1, dtype=torch.long)
        pad_cu[1:] = pads.cumsum(0)
        pad_cols = torch.arange(int(pad_cu[-1])) - pad_cu[pad_rows]
        self.lengths, self.T, self.B, self.P = [int(n) for n in lengths], int(cu[-1]), B, P
        self.rows, self.cols, self.last = rows.to(device), cols.to(device), (cu[1:] - 1).to(device)
        self.cu = cu.to(torch.int32).to(device)
        self.pad_rows, self.pad_cols = pad_rows.to(device), pad_cols.to(device)

    def scatter(self, buf: torch.Tensor, packed: torch.Tensor, width: int | None = None) -> None:
        """Write ``packed [T, H, D]`` into ``buf [B, H, L, >= D]`` at the tokens' columns, zeros at the pad ones."""
        if width is None:
            buf[self.rows, :, self.cols] = packed
            buf[self.pad_rows, :, self.pad_cols] = 0
        else:
            buf[self.rows, :, self.cols, :width] = packed
            buf[self.pad_rows, :, self.pad_cols] = 0


class PromptPrefill:
    """The prefill half of :class:`~rlrecipes.engines.native.decode.FastDecoder` (a mixin: it runs on
    the decoder's plan, buffers, rotary and static-step state)."""

    prefill_layout = "padded"

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, prompt_mask: torch.Tensor, pos: torch.Tensor, *, capacity: int,
                steps: int, lengths: list[int] | None = None) -> torch.Tensor:
        """Run the prompts through the layers, writing K/V straight into the buffers; next-token logits ``[B, V]``.

        ``ids, prompt_mask, pos [B, P]`` (left-padded prompts, 1 = real token, position ids
        ``cumsum(mask) - 1`` clamped at 0); ``lengths``: each prompt's real tokens (read from
        ``prompt_mask`` when not given). Same per-layer machinery as :meth:`step`: the layers' own
        q/k/v/o, norm, MLP / MoE modules; rope, the buffer write and attention by hand, in
        :attr:`prefill_layout` (module docstring). The last layer runs its query, ``o_proj`` and MLP
        on the last position only (only that position's logits are returned). Also sets up the
        rotary / mask of the ``steps`` decode steps that may follow. Requires :attr:`fast_prefill`.
        """
        if not self.fast_prefill:
            raise RuntimeError("prefill: some layers have no hand-written step; use model.forward + begin")
        self._prepare()
        if self.prefill_layout == "packed":
            if lengths is None:
                lengths = prompt_mask.sum(1).tolist()
            if 0 < min(lengths) and min(lengths) < ids.shape[1]:
                return self._prefill_packed(ids, prompt_mask, pos, capacity=capacity, steps=steps, lengths=lengths)
        return self._prefill_padded(ids, prompt_mask, pos, capacity=capacity, steps=steps)

    def _prompt_rotary(self, cos: torch.Tensor, sin: torch.Tensor):
        """The prompt's ``(cos, sin, sin_signed)`` in the steps' layout (half width when interleaved)."""
        if self.rope_interleave:
            cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        half = sin.shape[-1] // 2
        return cos, sin, torch.cat([-sin[..., :half], sin[..., half:]], -1)

    def _prefill_padded(self, ids: torch.Tensor, prompt_mask: torch.Tensor, pos: torch.Tensor, *, capacity: int,
                        steps: int) -> torch.Tensor:
        """The padded square: every layer over ``[B, P]`` with a causal (+ left-padding) mask. Padded
        query rows also see themselves, so no softmax row is empty (their outputs are never read)."""
        P = ids.shape[1]
        dev = ids.device
        all_real = bool(prompt_mask.all())
        h = self._embed(ids)  # [B, P, H]
        all_pos = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(max(steps, 1), device=dev)], 1)  # [B, P + S]
        cos, sin = self.rotary(h, all_pos)  # [B, P + S, D] each, in h's dtype
        self._set_rotary(cos[:, P:], sin[:, P:])
        self._set_decode_mask(prompt_mask, capacity, all_real)
        if all_real:
            mask = None  # plain causal
        else:
            ar = torch.arange(P, device=dev)
            causal = ar[None, :] <= ar[:, None]  # [P(query), P(key)]
            keep = prompt_mask.bool()[:, None, None, :] | torch.eye(P, dtype=torch.bool, device=dev)  # [B, 1, P, P]
            mask = keep & causal
        pcos, psin, psin_signed = self._prompt_rotary(cos[:, :P], sin[:, :P])  # [B, P, D] each

        def attend(i, kind, layer, plan, a, last_only):
            if kind == "gqa":
                return self._gqa_prefill(plan, a, i, capacity, pcos[:, :, None], psin_signed[:, :, None], mask,
                                         last_only=last_only)
            return self._mla_prefill(layer.self_attn, plan, a, i, capacity, pcos, psin, mask, last_only=last_only)

        # only the last position's logits are needed: [B, 1, H]
        return self._through_layers(h, attend, lambda x: x[:, -1:], prompt_mask, capacity)

    def _prefill_packed(self, ids: torch.Tensor, prompt_mask: torch.Tensor, pos: torch.Tensor, *, capacity: int,
                        steps: int, lengths: list[int]) -> torch.Tensor:
        """The prompts as one packed row of ``T = sum(lengths)`` tokens (module docstring)."""
        P = ids.shape[1]
        dev = ids.device
        pk = PackedPrompts(lengths, P, dev)
        h = self._embed(ids[pk.rows, pk.cols][None])  # [1, T, H]
        cos, sin = self.rotary(h, pos[pk.rows, pk.cols][None])  # [1, T, D] each, in h's dtype
        first = pos[:, -1:] + 1 + torch.arange(max(steps, 1), device=dev)  # [B, S]: the decode steps
        self._set_rotary(*self.rotary(h, first))
        self._set_decode_mask(prompt_mask, capacity, False)
        pcos, psin, psin_signed = self._prompt_rotary(cos, sin)  # [1, T, D] each
        keep = prompt_mask.bool()[:, None, None, :]  # [B, 1, 1, P]: the last layer's keys

        def attend(i, kind, layer, plan, a, last_only):
            if kind == "gqa":
                return self._gqa_packed(plan, a, i, capacity, pcos[:, :, None], psin_signed[:, :, None], pk, keep,
                                        last_only=last_only)
            return self._mla_packed(layer.self_attn, plan, a, i, capacity, pcos, psin, pk, keep, last_only=last_only)

        # only the prompts' last positions' logits are needed: [B, 1, H]
        return self._through_layers(h, attend, lambda x: x[0, pk.last][:, None], prompt_mask, capacity)

    def _through_layers(self, h: torch.Tensor, attend, last_rows, prompt_mask: torch.Tensor,
                        capacity: int) -> torch.Tensor:
        """The decoder stack over the prompt's hidden states ``h``, one layout's attention (``attend``,
        which writes the layer's K/V into the buffers) per layer; before the last layer's residual add
        ``last_rows`` keeps each prompt's last position ``[B, 1, H]``. Then the buffers advance past the
        prompt, the decode step is armed, and the last positions' logits ``[B, V]`` are returned."""
        B, P = prompt_mask.shape
        self._set_rows(B)
        self.buffers.reset(capacity)
        last = len(self.layers) - 1
        for i, (kind, layer, plan) in enumerate(zip(self.kinds, self.layers, self._plan)):
            a = attend(i, kind, layer, plan, plan["in_norm"](h), i == last)
            if i == last:
                h = last_rows(h)
            h = h + a
            h = h + plan["mlp"](plan["post_norm"](h))
        self.buffers.advance(P)
        self._arm(prompt_mask)
        return self._head(self._final_norm(h[:, -1:]))[:, -1]

    def _gqa_packed(self, plan, x, li, capacity, cos, sin_signed, pk: PackedPrompts, keep, last_only):
        """Qwen-style attention over the packed row ``x [1, T, H]``: K/V scattered to the buffers'
        padded columns; attention within each prompt (``device.varlen_attention``), or, for the last
        layer, of each prompt's last token over its buffer row (as a decode step): ``[1, T, H]`` or ``[B, 1, H]``."""
        T, B, D = x.shape[1], pk.B, plan["head_dim"]
        k = plan["k"](x).view(T, -1, D)  # [T, Hk, D]
        v = plan["v"](x).view(T, -1, D)  # [T, Hk, D]
        if plan["k_norm"] is not None:
            k = plan["k_norm"](k)
        c, s = cos[0], sin_signed[0]  # [T, 1, D]
        k = k * c + k.roll(D // 2, -1) * s
        Hk = k.shape[1]
        K, V = self.buffers.reserve(li, (B, Hk, pk.P, D), (B, Hk, pk.P, D), capacity, x)  # [B, Hk, L, D]
        pk.scatter(K, k)
        pk.scatter(V, v)
        if last_only:
            xq = x[0, pk.last][:, None]  # [B, 1, H]
            q = plan["q"](xq).view(B, -1, D)  # [B, Hq, D]
            if plan["q_norm"] is not None:
                q = plan["q_norm"](q)
            c, s = c[pk.last], s[pk.last]  # [B, 1, D]
            q = q * c + q.roll(D // 2, -1) * s
            Hq = q.shape[1]
            o = F.scaled_dot_product_attention(q[:, :, None], K[:, :, :pk.P], V[:, :, :pk.P], attn_mask=keep,
                                               scale=plan["scale"], enable_gqa=Hq != Hk)  # [B, Hq, 1, D]
            return plan["o"](o.reshape(B, 1, Hq * D))  # [B, 1, H]
        q = plan["q"](x).view(T, -1, D)  # [T, Hq, D]
        if plan["q_norm"] is not None:
            q = plan["q_norm"](q)
        q = q * c + q.roll(D // 2, -1) * s
        o = devmod.varlen_attention(q, k, v, pk.cu, pk.lengths, scale=plan["scale"])  # [T, Hq, D]
        return plan["o"](o.reshape(1, T, -1))  # [1, T, H]

    def _mla_packed(self, attn, plan, x, li, capacity, cos, sin, pk: PackedPrompts, keep, last_only):
        """DeepSeek MLA over the packed row ``x [1, T, H]`` (as :meth:`_gqa_packed`): expanded per-head
        K/V scattered to the buffers (V zero-padded to the key width, as :meth:`_mla_prefill`)."""
        T, B = x.shape[1], pk.B
        ckv = plan["kv_a_proj_with_mqa"](x)  # [1, T, r + rope]
        kv_nope, k_rot = torch.split(ckv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        kv_nope = plan["kv_a_layernorm"](kv_nope).view(1, 1, T, attn.kv_lora_rank)  # [1, 1, T, r]
        k_rot = self._mla_rope(k_rot.view(1, 1, T, attn.qk_rope_head_dim), cos[:, None], sin[:, None])
        key, value = attn.expand_kv(kv_nope, k_rot)  # [1, H, T, qk], [1, H, T, v]
        key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H, qk], [T, H, v]
        H, dv = key.shape[1], value.shape[-1]
        K, V = self.buffers.reserve(li, (B, H, pk.P, key.shape[-1]), (B, H, pk.P, key.shape[-1]), capacity, x)
        pk.scatter(K, key)
        pk.scatter(V, value, width=dv)
        xq = x[0, pk.last][:, None] if last_only else x  # [B, 1, H] or [1, T, H]
        if attn.q_lora_rank is None:
            q = plan["q_proj"](xq)
        else:
            q = plan["q_b_proj"](plan["q_a_layernorm"](plan["q_a_proj"](xq)))
        n = xq.shape[0] * xq.shape[1]
        q = q.view(n, -1, attn.qk_head_dim)  # [n, H, qk]
        q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        c, s = cos[0, :, None], sin[0, :, None]  # [T, 1, D or D/2]
        if last_only:
            c, s = c[pk.last], s[pk.last]
        query = torch.cat((q_pass, self._mla_rope(q_rot, c, s)), dim=-1)  # [n, H, qk]
        if last_only:
            o = F.scaled_dot_product_attention(query[:, :, None], K[:, :, :pk.P], V[:, :, :pk.P], attn_mask=keep,
                                               scale=attn.scaling)[..., :dv]  # [B, H, 1, v]
            return plan["o"](o.reshape(B, 1, -1))  # [B, 1, H]
        o = devmod.varlen_attention(query, key, value, pk.cu, pk.lengths, scale=attn.scaling)  # [T, H, v]
        return plan["o"](o.reshape(1, T, -1))  # [1, T, H]

    # ------------------------------------------------------------------------------- multi-turn
    @torch.no_grad()
    def extend(self, ids: torch.Tensor, keep: torch.Tensor, pos: torch.Tensor, history: torch.Tensor, *,
               capacity: int) -> torch.Tensor:
        """Append a chunk after the filled columns; next-token logits ``[B, V]`` at its last column.

        The multi-turn session's prefill (``session.py``): ``ids, keep, pos [B, T]`` are the chunk
        (left-padded per row, 1 = real token, each row's own position ids), ``history [B, n]`` says
        which filled columns each row may attend to (0 on padding, on columns of turns the row sat
        out, and on other rows' tool observations). The chunk's K/V go to columns ``[n, n + T)``; with
        ``n == 0`` this is :meth:`prefill`. Buffers are allocated (``n == 0``) or must already hold
        ``capacity`` columns (:meth:`grow`). Call :meth:`set_steps` before decode steps.
        """
        if not self.fast_prefill:
            raise RuntimeError("extend: some layers have no hand-written step")
        n = self.buffers.length
        if n == 0:
            return self.prefill(ids, keep, pos, capacity=capacity, steps=1)
        self._prepare()
        self._st = None  # set_steps arms the static step of the decode steps that follow
        B, T = ids.shape
        dev = ids.device
        h = self._embed(ids)  # [B, T, H]
        cos, sin = self.rotary(h, pos)  # [B, T, D]
        ar = torch.arange(T, device=dev)
        own = (keep.bool()[:, None, :] & (ar[None, :] <= ar[:, None])[None]) | torch.eye(T, dtype=torch.bool, device=dev)
        mask = torch.cat([history.bool()[:, None, :].expand(B, T, n), own], -1)[:, None]  # [B, 1, T, n + T]
        pcos, psin, psin_signed = self._prompt_rotary(cos, sin)
        last = len(self.layers) - 1
        for i, (kind, layer, plan) in enumerate(zip(self.kinds, self.layers, self._plan)):
            a = plan["in_norm"](h)
            if kind == "gqa":
                a = self._gqa_prefill(plan, a, i, capacity, pcos[:, :, None], psin_signed[:, :, None], mask,
                                      last_only=i == last, start=n)
            else:
                a = self._mla_prefill(layer.self_attn, plan, a, i, capacity, pcos, psin, mask, last_only=i == last,
                                      start=n)
            if i == last:
                h = h[:, -1:]
            h = h + a
            h = h + plan["mlp"](plan["post_norm"](h))
        self.buffers.advance(T)
        return self._head(self._final_norm(h[:, -1:]))[:, -1]  # [B, V]

    # ------------------------------------------------------------------------------- attention
    @staticmethod
    def _causal_last(mask, last_only: bool):
        """The attention mask of the query rows computed: all rows, or the last one (``[B, 1, 1, P]``)."""
        if not last_only:
            return mask, mask is None
        return (None if mask is None else mask[:, :, -1:]), False  # the last row sees every real key

    def _gqa_prefill(self, plan, x, li, capacity, cos, sin_signed, mask, last_only, start=0):
        """Qwen-style attention over the prompt ``x [B, P, H]``; K/V go to the buffers' ``[start:start + P]``
        (``start > 0``: a chunk after earlier columns, :meth:`extend`; ``mask`` then covers them all)."""
        B, P = x.shape[:2]
        D = plan["head_dim"]
        xq = x[:, -1:] if last_only else x
        q = plan["q"](xq).view(B, xq.shape[1], -1, D)  # [B, Pq, Hq, D]
        k = plan["k"](x).view(B, P, -1, D)  # [B, P, Hk, D]
        v = plan["v"](x).view(B, P, -1, D)  # [B, P, Hk, D]
        if plan["q_norm"] is not None:
            q, k = plan["q_norm"](q), plan["k_norm"](k)
        Hq, Hk = q.shape[2], k.shape[2]
        k = k * cos + k.roll(D // 2, -1) * sin_signed
        if last_only:
            q = q * cos[:, -1:] + q.roll(D // 2, -1) * sin_signed[:, -1:]
        else:
            q = q * cos + q.roll(D // 2, -1) * sin_signed
        if start:
            K, V = self.buffers.keys[li], self.buffers.values[li]
        else:
            K, V = self.buffers.reserve(li, (B, Hk, P, D), (B, Hk, P, D), capacity, x)  # [B, Hk, L, D]
        end = start + P
        K[:, :, start:end].copy_(k.transpose(1, 2))
        V[:, :, start:end].copy_(v.transpose(1, 2))
        m, causal = self._causal_last(mask, last_only)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), K[:, :, :end], V[:, :, :end], attn_mask=m,
                                           is_causal=causal, scale=plan["scale"],
                                           enable_gqa=Hq != Hk)  # [B, Hq, Pq, D]
        return plan["o"](o.transpose(1, 2).reshape(B, -1, Hq * D))  # [B, Pq, H]

    def _mla_prefill(self, attn, plan, x, li, capacity, cos, sin, mask, last_only, start=0):
        """DeepSeek MLA over the prompt ``x [B, P, H]``, writing expanded per-head K/V to the buffers
        (at ``[start:start + P]``, as :meth:`_gqa_prefill`)."""
        B, P = x.shape[:2]
        xq = x[:, -1:] if last_only else x
        if attn.q_lora_rank is None:
            q = plan["q_proj"](xq)
        else:
            q = plan["q_b_proj"](plan["q_a_layernorm"](plan["q_a_proj"](xq)))
        q = q.view(B, xq.shape[1], -1, attn.qk_head_dim).transpose(1, 2)  # [B, H, Pq, qk]
        q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        ckv = plan["kv_a_proj_with_mqa"](x)  # [B, P, r + rope]
        kv_nope, k_rot = torch.split(ckv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        kv_nope = plan["kv_a_layernorm"](kv_nope).view(B, 1, P, attn.kv_lora_rank)  # [B, 1, P, r]
        k_rot = k_rot.view(B, 1, P, attn.qk_rope_head_dim)  # [B, 1, P, rope]
        c, s = cos[:, None], sin[:, None]  # [B, 1, P, D or D/2]
        cq, sq = (c[:, :, -1:], s[:, :, -1:]) if last_only else (c, s)
        q_rot, k_rot = self._mla_rope(q_rot, cq, sq), self._mla_rope(k_rot, c, s)
        query = torch.cat((q_pass, q_rot), dim=-1)  # [B, H, Pq, qk]
        key, value = attn.expand_kv(kv_nope, k_rot)  # [B, H, P, qk], [B, H, P, v]
        dv = value.shape[-1]
        # V is stored zero-padded to the key width: SDPA then takes its fused (flash) CPU kernel
        # instead of the math fallback for qk != v head dims; the extra output columns are dropped
        if start:
            K, V = self.buffers.keys[li], self.buffers.values[li]
        else:
            K, V = self.buffers.reserve(li, tuple(key.shape), tuple(key.shape), capacity, key)
        end = start + P
        K[:, :, start:end].copy_(key)
        V[:, :, start:end, :dv].copy_(value)
        m, causal = self._causal_last(mask, last_only)
        o = F.scaled_dot_product_attention(query, key if not start else K[:, :, :end], V[:, :, :end], attn_mask=m,
                                           is_causal=causal, scale=attn.scaling)[..., :dv]  # [B, H, Pq, v]
        return plan["o"](o.transpose(1, 2).reshape(B, query.shape[2], -1))  # [B, Pq, H]


__all__ = ["PREFILL_LAYOUTS", "PackedPrompts", "PromptPrefill"]
