"""Ulysses sequence parallelism for the native train engines (``layout.sp``).

The ``sp`` ranks of a group hold the same micro-batch. Each feeds the model only its contiguous
``1 / sp`` of every row, so embeddings, MLPs, norms and the head run on ``T / sp`` tokens. Attention
needs the whole sequence. It goes through the HF attention interface under the name
:data:`ATTENTION`, which does the following:

1. q, k, v ``[b, heads, T / sp, d]`` go through one all-to-all each (over the SP group) to
   ``[b, heads / sp, T, d]``: every rank now holds whole sequences for its share of the heads.
2. Plain SDPA runs on them: causal, or with the whole rows' mask of packed or padded rows, built
   once per forward by :func:`sequence_mask` and passed to the model as its 4-D ``attention_mask``.
3. One all-to-all brings the output back to ``[b, T / sp, heads, d]``.

KV heads that ``sp`` does not divide are repeated to the query heads first (GQA with fewer KV heads
than ranks).

The engine then turns each rank's head output into log-probs of its own tokens.
:func:`gather_sequence` assembles them into the whole row on every rank: forward, an all-gather;
backward, the rank's own slice of the gradient. Every rank then computes the same loss, and each
rank's parameter gradients are the part contributed by its tokens. The SP group's sum is the
gradient, so the engine scales the loss by ``sp`` under a DP x SP mean.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION = "rlrecipes_ulysses"
"""The attention implementation name registered with transformers."""


def attach(model, group, sp: int) -> int:
    """Give every attention module of ``model`` its SP group: the attention reads it from the module
    it is called with, so recomputation in backward (activation checkpointing, autograd's own
    threads) finds it too. Returns how many modules got it."""
    n = 0
    for name, m in model.named_modules():
        if name.endswith("self_attn"):
            m.ulysses_group, m.ulysses_sp = group, int(sp)
            n += 1
    if not n:
        raise ValueError(f"{type(model).__name__}: no '*.self_attn' modules for Ulysses sequence parallelism")
    return n


# ---------------------------------------------------------------------------------------------
# collectives with autograd
class _AllToAll(torch.autograd.Function):
    """``x [sp, ...]``: chunk j goes to rank j; rank j's chunk i comes from rank i. The exchange is its
    own transpose, so backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)  # (contiguous: the exchange fills it chunk by chunk along dim 0)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """``[b, h, T / sp, d]`` (this rank's tokens, every head) -> ``[b, h / sp, T, d]``."""
    b, h, s, d = x.shape
    x = x.reshape(b, sp, h // sp, s, d).transpose(0, 1)  # [sp(head group), b, h / sp, s, d]
    x = _AllToAll.apply(x, group)  # [sp(token block), b, h / sp, s, d]
    return x.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def heads_to_seq(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """``[b, T, h / sp, d]`` (every token, this rank's heads) -> ``[b, T / sp, h, d]``."""
    b, t, hl, d = x.shape
    x = x.reshape(b, sp, t // sp, hl, d).transpose(0, 1)  # [sp(token block), b, T / sp, h / sp, d]
    x = _AllToAll.apply(x, group)  # [sp(head group), b, T / sp, h / sp, d]
    return x.permute(1, 2, 0, 3, 4).reshape(b, t // sp, sp * hl, d)


class _GatherSequence(torch.autograd.Function):
    """Forward: ``[b, T / sp]`` pieces all-gathered along dim 1; backward: this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, sp, rank):
        ctx.rank, ctx.width = rank, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.width
        return grad[:, ctx.rank * w:(ctx.rank + 1) * w], None, None, None


def gather_sequence(x: torch.Tensor, group, sp: int, rank: int) -> torch.Tensor:
    """This rank's ``[b, T / sp]`` per-token values -> the whole rows ``[b, T]`` on every rank (each
    rank then computes the same loss; its gradient flows back to its own tokens only)."""
    return _GatherSequence.apply(x, group, sp, rank)


# ---------------------------------------------------------------------------------------------
# the attention implementation
def sequence_mask(*, position_ids: Optional[torch.Tensor] = None,
                  valid: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The whole rows' attention mask ``[b, 1, T, T]`` (True: attend), or None where plain causal
    attention is exact.

    ``position_ids [b, T]`` (packed rows): a sample starts where its position drops to 0; attention
    stays inside each sample. ``valid [b, T]`` (padded rows): False at padding; only padding before a
    row's tokens needs a mask (causal attention never looks ahead, and outputs at trailing padding
    are never read)."""
    mask = None
    if position_ids is not None:
        starts = position_ids == 0
        starts[:, 0] = True
        if bool(starts[:, 1:].any()):
            T = position_ids.shape[1]
            seg = starts.long().cumsum(1)  # [b, T]: the sample each column belongs to
            causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
            mask = (seg[:, :, None] == seg[:, None, :]) & causal  # [b, T, T]
    if valid is not None:
        leading = ~valid & (valid.long().cummax(1).values == 0)  # [b, T]: padding before the tokens
        if bool(leading.any()):
            T = valid.shape[1]
            if mask is None:
                mask = torch.ones(T, T, dtype=torch.bool, device=valid.device).tril().expand(valid.shape[0], T, T)
            mask = mask & valid[:, None, :]
            mask = mask | torch.eye(T, dtype=torch.bool, device=mask.device)  # a padded query sees itself
    return None if mask is None else mask[:, None]


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, sliding_window=None, softcap=None, **kwargs):
    """HF attention interface: ``query [b, h, T / sp, d]``, ``key / value [b, kv, T / sp, d]`` ->
    ``([b, T / sp, h, d_v], None)``. ``attention_mask``: the whole rows' ``[b, 1, T, T]`` mask the
    engine passes to the model (HF hands a 4-D mask through unchanged), or None: causal."""
    group, sp = getattr(module, "ulysses_group", None), getattr(module, "ulysses_sp", 0)
    if not sp:
        raise RuntimeError(f"attention {ATTENTION!r} on a module without an SP group: ulysses.attach(model, ...) "
                           "gives every attention module its group")
    if sliding_window is not None or softcap is not None:
        raise NotImplementedError(f"attention {ATTENTION!r}: sliding_window={sliding_window}, softcap={softcap} are "
                                  "not implemented under sequence parallelism; set layout.sp: 1 for this model")
    h, kv = query.shape[1], key.shape[1]
    if h % sp:
        fits = [d for d in range(1, h + 1) if h % d == 0]
        raise ValueError(f"layout.sp={sp} does not divide the {h} attention heads of a rank; use layout.sp in {fits}")
    mask = attention_mask
    # KV heads SP does not divide are repeated to the query heads; so are they beside a mask: SDPA's
    # GQA path runs on the flash and math kernels only, and flash takes no mask
    if kv % sp or (kv != h and mask is not None):
        key = key.repeat_interleave(h // kv, dim=1)
        value = value.repeat_interleave(h // kv, dim=1)
        kv = h
    q = seq_to_heads(query, group, sp)  # [b, h / sp, T, d]
    k = seq_to_heads(key, group, sp)
    v = seq_to_heads(value, group, sp)
    T = q.shape[2]
    if mask is not None and mask.shape[-1] != T:
        raise RuntimeError(f"ulysses: the mask covers {mask.shape[-1]} tokens, the attention {T}")
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout if module.training else 0.0,
                                         is_causal=mask is None, scale=scaling,
                                         enable_gqa=kv != h)  # [b, h / sp, T, d_v]
    return heads_to_seq(out.transpose(1, 2), group, sp), None


def _no_mask(*args, **kwargs):
    """Mask function registered for :data:`ATTENTION`: HF builds no mask for the local length (the
    engine passes the whole rows' 4-D mask, which HF hands through, or none for causal rows)."""
    return None


def register() -> dict[str, str]:
    """Register the attention (and its mask function) with transformers; returns the model's
    ``attn_implementation``: the decoder's attention by this name, a vision-language model's vision
    tower on plain SDPA (it runs whole images on every rank of the group: only the decoder's
    sequence is split, see ``vision.decoder_columns``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
    return {"": ATTENTION, "text_config": ATTENTION, "vision_config": "sdpa"}


def pad_to(t: torch.Tensor, multiple: int, value=None) -> torch.Tensor:
    """Right-pad dim 1 of ``t`` to a multiple of ``multiple`` with ``value``, or (None) with the
    positions that continue each row's last one (no new sample starts in the padding)."""
    extra = -t.shape[1] % multiple
    if not extra:
        return t
    if value is None:
        tail = t[:, -1:] + torch.arange(1, extra + 1, device=t.device, dtype=t.dtype)[None, :]
    else:
        tail = t.new_full((t.shape[0], extra, *t.shape[2:]), value)
    return torch.cat([t, tail], dim=1)


__all__ = ["ATTENTION", "attach", "gather_sequence", "heads_to_seq", "pad_to", "register", "seq_to_heads",
           "sequence_mask", "ulysses_attention"]
