"""Fast single-token decode steps for the native rollout engine.

``model.forward`` of an HF causal LM spends most of a 1-token decode step outside the layers:
output-capture decorators, ``create_causal_mask``, position ids / ``cache_position`` bookkeeping,
the rotary embedding, the cache-layer update logic. :class:`FastDecoder` keeps the layers and
drops the rest:

* K/V live in :class:`KVBuffers`, one pre-allocated ``[B, heads, L, dim]`` tensor pair per layer
  (whatever 4-D states the attention module caches: per-head K/V for Qwen, the compressed latent
  ``(kv_nope, k_rot)`` for DeepSeek MLA). ``update`` slice-assigns the new position and returns
  views of the filled prefix, i.e. the same keys a ``DynamicCache`` would return;
* the rotary ``(cos, sin)`` of every decode position is computed once per ``generate`` call;
* the attention mask is a boolean ``[B, 1, 1, L]`` keep-mask over the padded prompt, sliced per
  step (``None`` when nothing is padded, as HF does);
* a step calls ``embed_tokens -> decoder layers -> norm -> lm_head`` directly.

The layers, attention modules and MoE blocks are HF's own (or the engine's TP/EP replacements:
DTensor-parallel linears, ``EPExperts``), so the math -- Qwen3 ``q_norm``/``k_norm``, DeepSeek MLA
latent expansion, routing -- and the TP/EP collectives are exactly those of ``model.forward``.
Prefill (:meth:`FastDecoder.prefill`, ``prefill.py``) runs the prompts through the same per-layer
machinery, writing K/V straight into the buffers (no HF cache object, no copy), either as the
left-padded square with a causal (+ left-padding) mask or packed into one row of the prompts' own
tokens with attention restricted to each prompt (``prefill_layout``); the last layer computes its
query / MLP on the last position only. When a layer has no hand-written step (``mode="layers"``,
other attention types), prefill falls back to a normal ``model.forward`` over a ``DynamicCache``,
whose states are then copied in (:meth:`FastDecoder.begin`).

Static steps (``static=True``, the engine's default where every layer has a hand-written step): the
decode step reads nothing that changes per token from Python. Its inputs and outputs live in
buffers of a batch-size bucket (:class:`StaticStep`: the tokens, the K/V column written
``col``, the rotary step index ``t``, both ``[1]`` device tensors advanced by the step itself, the
keep-mask and the rotary tables), rows past the real batch are padding (their K/V rows exist in
the storage of :class:`KVBuffers`, their outputs are never read), and attention runs over the
buffers' whole capacity with a mask (``keep | col0 <= column <= col``) instead of a slice
``[:n + 1]``. The same step is therefore captured once per bucket and replayed on devices with
graphs (``device.capture_graph``: CUDA graphs, the NPU's graph mode), after one eager run that
warms it up; on the host it runs eagerly. The masked full-capacity attention is the same
arithmetic up to rounding (masked columns weigh exactly 0, but the sums run over another
length): log-probs agree with the sliced step to ~1e-6, not bitwise.

Supported: decoder stacks under ``model.model`` with ``embed_tokens``, ``layers``, ``norm``,
``rotary_emb`` and only full-attention layers. :func:`supports_fast_decode` says whether a model
qualifies; the engine falls back to ``model.forward`` otherwise.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from rlrecipes import device as devmod
from rlrecipes.engines.native.kv_buffers import KVBuffers
from rlrecipes.engines.native.prefill import PREFILL_LAYOUTS, PromptPrefill
from rlrecipes.engines.native.static_step import MAX_BUCKET, StaticStep, bucket_rows
from rlrecipes.engines.native.decode_parts import attention_kind, fast_call, mlp_call, rotate_half, supports_fast_decode

log = logging.getLogger(__name__)

class FastDecoder(PromptPrefill):
    """Runs 1-token decode steps of an HF causal LM on its own KV buffers (see module docstring).

    One ``generate`` call: :meth:`prefill` (or :meth:`begin` after an HF prefill), then :meth:`step` per token.

    ``mode="fast"`` (default): hand-written attention decode steps for GQA attention (Qwen2,
    Qwen3/Qwen3-MoE) and DeepSeek MLA, calling the attention's own projection / norm modules
    (so DTensor TP linears and the MLA rope-key hook run as in ``forward``) and doing only rope,
    the cache write and ``scaled_dot_product_attention`` by hand; MLP / MoE blocks and norms are
    the layer's modules. MLA keeps *expanded* per-head K/V (``kv_b_proj`` is applied to the new
    position only, instead of re-expanding the whole latent cache every step as HF does): O(1)
    instead of O(length) work per step, for ``heads * (qk_head_dim + v_head_dim)`` instead of
    ``kv_lora_rank + qk_rope_head_dim`` cache elements per position (after the fast prefill, V is
    stored zero-padded to ``qk_head_dim`` so SDPA runs its fused kernel). Any other layer, or
    ``mode="layers"``, calls the HF decoder layer itself with :class:`KVBuffers` as its cache.
    ``prefill_layout``: ``"packed"`` or ``"padded"`` (``prefill.py``).
    """

    def __init__(self, model: nn.Module, mode: str = "fast", *, static: bool = False, capture: bool = False,
                 max_bucket: int = MAX_BUCKET, prefill_layout: str = "padded"):
        if not supports_fast_decode(model):
            raise ValueError(f"{type(model).__name__}: no fast decode path")
        if mode not in ("fast", "layers"):
            raise ValueError(f"mode={mode!r}: expected 'fast' or 'layers'")
        if prefill_layout not in PREFILL_LAYOUTS:
            raise ValueError(f"prefill_layout={prefill_layout!r}: expected one of {PREFILL_LAYOUTS}")
        self.prefill_layout = prefill_layout
        self.model = model
        backbone = model.model
        self.embed = backbone.embed_tokens
        self.layers = list(backbone.layers[: model.config.num_hidden_layers])
        self.norm = backbone.norm
        self.rotary = backbone.rotary_emb
        self.lm_head = model.lm_head
        self.kinds = [attention_kind(layer) if mode == "fast" else "layer" for layer in self.layers]
        self.rope_interleave = bool(getattr(model.config, "rope_interleave", False))
        self.buffers = KVBuffers(len(self.layers))
        self._cos = self._sin = self._sin_signed = None
        self._mask = None
        self._plan: list[dict | None] = []
        # static steps (module docstring): only where every layer has a hand-written step
        self.static = bool(static) and self.fast_prefill
        self.capture = bool(capture) and self.static
        self.max_bucket = max_bucket
        self._statics: dict[tuple[int, int], StaticStep] = {}
        self._st: StaticStep | None = None  # the static step the current call's steps run
        self._pool = None  # the captured graphs' shared memory pool

    # ------------------------------------------------------------------------------- setup
    @property
    def fast_prefill(self) -> bool:
        """Whether :meth:`prefill` applies: every layer has a hand-written (``gqa`` / ``mla``) step."""
        return bool(self.kinds) and all(k in ("gqa", "mla") for k in self.kinds)

    def _prepare(self) -> None:
        """Per-call callables (rebuilt every ``generate``: weights may have been swapped / reloaded)."""
        self._plan = [self._layer_plan(kind, layer) for kind, layer in zip(self.kinds, self.layers)]
        self._embed, self._final_norm, self._head = (fast_call(self.embed), fast_call(self.norm),
                                                     fast_call(self.lm_head))

    def _set_rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Store the decode steps' ``(cos, sin) [B, S, D]`` (rotary module layout) in the step layouts."""
        if self.rope_interleave:  # cos/sin are cat(freqs, freqs): keep the per-pair half
            cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        self._cos, self._sin = cos[:, :, None], sin[:, :, None]  # [B, S, 1, D]: broadcast over heads
        half = sin.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * cat(-sin[:half], sin[half:]) exactly (sign flips are exact)
        self._sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], -1)[:, :, None]  # [B, S, 1, D]

    def _set_decode_mask(self, prompt_mask: torch.Tensor, capacity: int, all_real: bool) -> None:
        if all_real:
            self._mask = None
        else:
            B, P = prompt_mask.shape
            keep = torch.ones((B, 1, 1, capacity), dtype=torch.bool, device=prompt_mask.device)  # [B, 1, 1, L]
            keep[:, 0, 0, :P] = prompt_mask.bool()
            self._mask = keep

    def begin(self, prefill_cache, *, capacity: int, first_pos: torch.Tensor, steps: int,
              prompt_mask: torch.Tensor, like: torch.Tensor) -> None:
        """Take over a prefilled ``DynamicCache``; precompute rotary and mask for ``steps`` decode steps.

        The fallback of :meth:`prefill` (after an HF ``model.forward`` prefill). ``first_pos [B, 1]``:
        position id of the first decoded token; ``prompt_mask [B, P]`` (1 = real token); ``like``: a
        tensor in the compute dtype/device (the prefill logits; rotary only reads those).
        """
        self._prepare()
        if "mla" in self.kinds:
            prefill_cache = self._expand_mla_prefill(prefill_cache)
        self._set_rows(prompt_mask.shape[0])
        self.buffers.load_prefill(prefill_cache, capacity)
        pos = first_pos + torch.arange(max(steps, 1), device=first_pos.device)  # [B, S]
        self._set_rotary(*self.rotary(like, pos))  # [B, S, D] each, in like's dtype
        self._set_decode_mask(prompt_mask, capacity, bool(prompt_mask.all()))
        self._arm(prompt_mask)

    def set_steps(self, first_pos: torch.Tensor, steps: int, keep: torch.Tensor, like: torch.Tensor) -> None:
        """Rotary of ``steps`` decode steps from ``first_pos [B, 1]`` and the keep-mask ``[B, L]`` the
        steps attend through (the caller sets each step's own column in it before the step)."""
        pos = first_pos + torch.arange(max(steps, 1), device=first_pos.device)  # [B, S]
        self._set_rotary(*self.rotary(like, pos))
        self._mask = keep[:, None, None, :]  # [B, 1, 1, L], a view: the caller's updates are seen
        self._arm(keep)

    def grow(self, capacity: int) -> None:
        """Re-allocate every layer's buffers with ``capacity`` columns, keeping the filled ones."""
        self.buffers.grow(capacity)
        self._st = None  # the next set_steps arms a static step of the new capacity

    def compact(self, index: torch.Tensor) -> None:
        """Move each row's columns ``index[b]`` (``[B, W]``, in order) to the front: the filled columns
        become ``[0, W)``. Keys are stored rotated, so a column's position stays what it was."""
        buf = self.buffers
        n, W = buf.length, index.shape[1]
        for li, (k, v) in enumerate(zip(buf.keys, buf.values)):
            for t in (k, v):
                g = index[:, None, :, None].expand(t.shape[0], t.shape[1], W, t.shape[3])
                t[:, :, :W].copy_(torch.gather(t[:, :, :n], 2, g))
        buf.length = W

    def _mla_rope(self, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """DeepSeek's rotary on the rope part ``x [..., rope]`` (interleaved pairs or rotate-half)."""
        if self.rope_interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        return x * c + rotate_half(x) * s

    @staticmethod
    def _layer_plan(kind: str, layer: nn.Module) -> dict | None:
        """The per-call callables of one layer (rebuilt every ``generate``: weights may be swapped)."""
        if kind == "layer":
            return None
        attn = layer.self_attn
        plan = {"in_norm": fast_call(layer.input_layernorm), "post_norm": fast_call(layer.post_attention_layernorm),
                "mlp": mlp_call(layer.mlp), "o": fast_call(attn.o_proj)}
        if kind == "gqa":
            plan.update(q=fast_call(attn.q_proj), k=fast_call(attn.k_proj), v=fast_call(attn.v_proj),
                        head_dim=attn.head_dim, scale=attn.scaling)
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            plan.update(q_norm=fast_call(qn) if qn is not None else None,
                        k_norm=fast_call(kn) if kn is not None else None)
        if kind == "mla":
            plan.update({name: fast_call(getattr(attn, name)) for name in (
                "q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm")
                if getattr(attn, name, None) is not None})
        return plan

    def _expand_mla_prefill(self, cache):
        """Latent (kv_nope, k_rot) of the MLA layers -> their per-head (key, value) states."""

        class _Layer:
            def __init__(self, keys, values):
                self.keys, self.values = keys, values

        class _Cache:
            layers = []

        out = _Cache()
        out.layers = []
        for kind, layer, cl in zip(self.kinds, self.layers, cache.layers):
            if kind == "mla":
                out.layers.append(_Layer(*layer.self_attn.expand_kv(cl.keys, cl.values)))
            else:
                out.layers.append(cl)
        return out

    # ------------------------------------------------------------------------------- static steps
    def _set_rows(self, batch: int) -> None:
        """The K/V storage rows of a call of ``batch`` rows: its bucket for static steps, else its own."""
        self._st = None
        self.buffers.rows = bucket_rows(batch, self.max_bucket) if self.static else 0

    def _arm(self, keep: torch.Tensor) -> None:
        """Point the coming decode steps at the static step of this call's bucket and capacity.

        ``keep [B, >= n]``: the filled columns (``n = buffers.length``) each row attends to; the decode
        columns from ``n`` on are attended by every row (the per-row keep of a multi-turn session
        only drops rows whose outputs are not read). Fills the static keep-mask, rotary tables and
        counters; nothing here syncs with the host."""
        if not self.static:
            return
        buf = self.buffers
        B, n, L = keep.shape[0], buf.length, buf.capacity
        rows = buf.store_keys[0].shape[0]
        key = (rows, L)
        # only this key's step can replay: the K/V storage of any other bucket or capacity is gone
        # (this call's storage replaced it), so its graph would read freed memory; kept, they pile up
        for stale in [k for k in self._statics if k != key]:
            del self._statics[stale]
        st = self._statics.get(key)
        if st is None:
            st = self._statics[key] = StaticStep(rows, L, keep.device)
        ptrs = tuple(t.data_ptr() for t in buf.store_keys + buf.store_values)
        if st.ptrs != ptrs:  # new storage: what was captured reads the old one
            st.ptrs, st.graph, st.warm, st.logits = ptrs, None, False, None
        st.keep[:B].zero_()
        st.keep[:B, :n] = keep[:, :n].bool()
        st.keep[B:] = True  # padding rows attend everywhere: finite outputs, never read
        st.col.fill_(n)
        st.col0.fill_(n)
        st.t.zero_()
        st.fill_rotary(self._cos, self._sin, self._sin_signed)
        self._st = st

    def _static_forward(self, st: StaticStep) -> torch.Tensor:
        """One decode step of all ``st.rows`` rows, from and into static buffers: logits ``[R, V]``."""
        buf = self.buffers
        h = self._embed(st.tok[:, None])  # [R, 1, H]
        mask = (st.keep | ((st.cols >= st.col0) & (st.cols <= st.col)))[:, None, None, :]  # [R, 1, 1, L]
        cos = st.cos.index_select(1, st.t)[:, 0]  # [R, 1, D]
        sin = st.sin.index_select(1, st.t)[:, 0]
        sin_signed = st.sin_signed.index_select(1, st.t)[:, 0]
        for i in range(len(self.layers)):
            h = self._layer_step(i, h, st.col, cos, sin, sin_signed, mask,
                                 kv=(buf.store_keys[i], buf.store_values[i]))
        st.col.add_(1)
        st.t.add_(1)
        return self._head(self._final_norm(h))[:, -1]  # [R, V]

    def _step_static(self, tokens: torch.Tensor) -> torch.Tensor:
        st = self._st
        B = tokens.shape[0]
        st.tok[:B].copy_(tokens)
        if st.graph is None and self.capture and st.warm and not st.failed:
            try:
                st.graph, st.logits = devmod.capture_graph(tokens.device, lambda: self._static_forward(st),
                                                           pool=self._pool)
                self._pool = st.graph.pool()
            except Exception as e:  # e.g. an MoE block that syncs with the host: this bucket stays eager
                log.warning("decode step of %d rows not captured (%s: %s); it runs eagerly", st.rows,
                            type(e).__name__, e)
                st.failed, st.graph = True, None
        if st.graph is not None:
            st.graph.replay()
            out = st.logits
        else:
            out = self._static_forward(st)
            st.warm = True
        self.buffers.advance(1)
        return out[:B]

    # ------------------------------------------------------------------------------- steps
    @torch.no_grad()
    def step(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Feed ``tokens [B]`` as decode step ``t`` (0-based); returns next-token logits ``[B, V]``.

        With a static step armed (:meth:`_arm`), ``t`` is the step's own device counter (the caller's
        ``t`` counts the same steps) and the logits are a view of rows ``[:B]`` of its output."""
        if self._st is not None:
            return self._step_static(tokens)
        buf = self.buffers
        n = buf.length
        h = self._embed(tokens[:, None])  # [B, 1, H]
        mask = None if self._mask is None else self._mask[..., :n + 1]  # [B, 1, 1, n + 1]
        cos, sin = self._cos[:, t], self._sin[:, t]  # [B, 1, D]
        sin_signed = self._sin_signed[:, t]
        pe = None
        for i, (kind, layer) in enumerate(zip(self.kinds, self.layers)):
            if kind == "layer":
                if pe is None:
                    pe = self._hf_position_embeddings(t)
                h = layer(h, attention_mask=mask, position_embeddings=pe, past_key_values=buf, use_cache=True)
                continue
            h = self._layer_step(i, h, n, cos, sin, sin_signed, mask)
        buf.advance(1)
        return self._head(self._final_norm(h))[:, -1]  # [B, V]

    def _layer_step(self, i: int, h: torch.Tensor, col, cos, sin, sin_signed, mask, kv=None) -> torch.Tensor:
        """Decoder layer ``i``'s hand-written decode step on ``h [B, 1, H]``, writing K/V column ``col``
        (an int, or the static step's ``[1]`` device counter, with ``kv`` its storage)."""
        plan = self._plan[i]
        a = plan["in_norm"](h)
        if self.kinds[i] == "gqa":
            a = self._gqa(plan, a, i, col, cos, sin_signed, mask, kv=kv)
        else:
            a = self._mla(self.layers[i].self_attn, plan, a, i, col, cos, sin, mask, kv=kv)
        h = h + a
        return h + plan["mlp"](plan["post_norm"](h))

    def _hf_position_embeddings(self, t: int):
        """(cos, sin) ``[B, 1, D]`` in the rotary module's own layout, for the HF layer path."""
        if self.rope_interleave:
            cos, sin = self._cos[:, t], self._sin[:, t]
            return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        return self._cos[:, t], self._sin[:, t]

    def _gqa(self, plan, x, li, n, cos, sin_signed, mask, kv=None):
        """Qwen-style attention of one new position: q/k/v modules, (q/k norm), rope, SDPA, o_proj.

        ``n``: the column written (an int: attention over ``[:n + 1]``; a ``[1]`` tensor, the static
        step: over the whole storage ``kv``, with ``mask`` excluding the columns not attended)."""
        B = x.shape[0]
        D = plan["head_dim"]
        q = plan["q"](x).view(B, -1, D)  # [B, Hq, D] (local heads under TP)
        k = plan["k"](x).view(B, -1, D)  # [B, Hk, D]
        v = plan["v"](x).view(B, -1, D)  # [B, Hk, D]
        if plan["q_norm"] is not None:
            q, k = plan["q_norm"](q), plan["k_norm"](k)
        Hq, Hk = q.shape[1], k.shape[1]
        qk = torch.cat([q, k], 1)  # [B, Hq + Hk, D]: one rope for both
        qk = qk * cos + qk.roll(D // 2, -1) * sin_signed
        if kv is None:
            K, V = self.buffers.keys[li], self.buffers.values[li]  # [B, Hk, L, D]
            K[:, :, n].copy_(qk[:, Hq:])
            V[:, :, n].copy_(v)
            K, V = K[:, :, :n + 1], V[:, :, :n + 1]
        else:
            K, V = kv  # [R, Hk, L, D]
            K.index_copy_(2, n, qk[:, Hq:, None])
            V.index_copy_(2, n, v[:, :, None])
        # GQA without repeating K/V: the Hq // Hk query heads of a KV head act as its query rows
        qg = qk[:, :Hq].reshape(B, Hk, Hq // Hk, D)  # [B, Hk, rep, D]
        o = F.scaled_dot_product_attention(qg, K, V, attn_mask=mask, scale=plan["scale"])  # [B, Hk, rep, D]
        return plan["o"](o.reshape(B, 1, Hq * D))  # [B, 1, H]

    def _mla(self, attn, plan, x, li, n, cos, sin, mask, kv=None):
        """DeepSeek MLA of one new position, with expanded per-head K/V buffers (``n``, ``kv``: as :meth:`_gqa`)."""
        B = x.shape[0]
        if attn.q_lora_rank is None:
            q = plan["q_proj"](x)
        else:
            q = plan["q_b_proj"](plan["q_a_layernorm"](plan["q_a_proj"](x)))
        q = q.view(B, -1, 1, attn.qk_head_dim)  # [B, H, 1, qk]
        q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        ckv = plan["kv_a_proj_with_mqa"](x)  # [B, 1, r + rope] (TP: its rope-key grad hook runs)
        kv_nope, k_rot = torch.split(ckv, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        kv_nope = plan["kv_a_layernorm"](kv_nope).view(B, 1, 1, attn.kv_lora_rank)  # [B, 1, 1, r]
        k_rot = k_rot.view(B, 1, 1, attn.qk_rope_head_dim)  # [B, 1, 1, rope]
        c, s = cos[:, None], sin[:, None]  # [B, 1, 1, D or D/2]
        q_rot, k_rot = self._mla_rope(q_rot, c, s), self._mla_rope(k_rot, c, s)
        query = torch.cat((q_pass, q_rot), dim=-1)  # [B, H, 1, qk]
        key, value = attn.expand_kv(kv_nope, k_rot)  # [B, H, 1, qk], [B, H, 1, v]
        dv = value.shape[-1]  # V may be zero-padded to the key width (fast prefill): drop those columns
        if kv is None:
            K, V = self.buffers.keys[li], self.buffers.values[li]
            K[:, :, n:n + 1].copy_(key)
            V[:, :, n:n + 1, :dv].copy_(value)
            K, V = K[:, :, :n + 1], V[:, :, :n + 1]
        else:
            K, V = kv  # [R, H, L, qk], [R, H, L, >= v]
            K.index_copy_(2, n, key)
            V[..., :dv].index_copy_(2, n, value)
        o = F.scaled_dot_product_attention(query, K, V, attn_mask=mask, scale=attn.scaling)[..., :dv]  # [B, H, 1, v]
        return plan["o"](o.transpose(1, 2).reshape(B, 1, -1))  # [B, 1, H]

    def release(self) -> None:
        """Drop the K/V buffers, the static steps and their captured graphs."""
        self.buffers = KVBuffers(len(self.layers))
        self._cos = self._sin = self._sin_signed = self._mask = None
        self._plan = []
        self._statics, self._st, self._pool = {}, None, None


__all__ = ["FastDecoder", "KVBuffers", "StaticStep", "bucket_rows", "supports_fast_decode"]
