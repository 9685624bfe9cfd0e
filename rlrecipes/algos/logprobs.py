"""Log-probs of chosen tokens and entropy from logits, computed in row chunks.

``log p(y) = logit_y - logsumexp(logits)``: per chunk of rows we take one ``logsumexp`` and one
``gather``, so no full ``[tokens, vocab]`` log-softmax tensor is ever built (a full
``log_softmax`` + ``gather`` materialises it once forward and once more in backward). Work is done
in float32 for bf16/fp16 logits, one chunk at a time.
"""
from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024


def _chunks(n: int, chunk_size: int):
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    for start in range(0, n, chunk_size):
        yield start, min(start + chunk_size, n)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """Log-prob of each label under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., vocab]`` (e.g. ``[batch, seq, vocab]``).
        labels: ``[...]`` int token ids (e.g. ``[batch, seq]``).
        chunk_size: rows (tokens) per chunk.
    Returns:
        ``[...]`` float32 log-probs.
    """
    return logprobs_and_entropy(logits, labels, temperature=temperature, chunk_size=chunk_size, with_entropy=False)[0]


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Entropy ``H = logsumexp(z) - sum softmax(z) z`` per position: ``[..., vocab] -> [...]`` float32."""
    dummy = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return logprobs_and_entropy(logits, dummy, temperature=temperature, chunk_size=chunk_size, with_entropy=True)[1]


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chosen-token log-probs and (optionally) entropy in one chunked pass.

    Args:
        logits: ``[..., vocab]``; labels: ``[...]`` (same leading shape).
    Returns:
        ``(logp [...], entropy [...] or None)`` float32.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: logits must be "
            "[..., vocab] with the labels' leading shape (shift logits/labels by one token first)"
        )
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)  # [tokens, vocab]
    flat_labels = labels.reshape(-1, 1).long()  # [tokens, 1]
    logps, ents = [], []
    for s, e in _chunks(flat.shape[0], chunk_size):
        z = flat[s:e].float()  # [chunk, vocab]
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)  # [chunk]
        logps.append(z.gather(-1, flat_labels[s:e]).squeeze(-1) - lse)
        if with_entropy:
            p = torch.softmax(z, dim=-1)
            ents.append(lse - (p * z).sum(-1))
    if not logps:
        empty = flat.new_zeros(labels.shape, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    logp = torch.cat(logps).reshape(labels.shape)
    ent = torch.cat(ents).reshape(labels.shape) if with_entropy else None
    return logp, ent


class _VocabParallel(torch.autograd.Function):
    """Log-probs and entropy from vocabulary-sharded logits (each rank holds ``[N, V_local]``).

    Forward: one MAX all-reduce of the row maxima and one SUM all-reduce of ``[3, N]`` partial
    sums (sum of exps, the label's logit where this rank owns it, sum of ``exp(z) z``); nothing of
    size ``V`` crosses ranks. Backward is local: ``d logp / dz = onehot - p`` and
    ``dH / dz = p (E_p[z] - z)``; the all-reduce of the hidden-state gradient that a column-parallel
    head needs is done by the head itself.
    """

    @staticmethod
    def forward(ctx, local_logits, labels, vocab_start, group, temperature, chunk_size):
        import torch.distributed as dist

        N, v_local = local_logits.shape
        inv_t = 1.0 / temperature
        rowmax = torch.empty(N, dtype=torch.float32, device=local_logits.device)
        for s, e in _chunks(N, chunk_size):
            rowmax[s:e] = local_logits[s:e].float().amax(-1) * inv_t
        dist.all_reduce(rowmax, op=dist.ReduceOp.MAX, group=group)
        local_label = labels - vocab_start  # [N]
        owned = (local_label >= 0) & (local_label < v_local)
        idx = torch.where(owned, local_label, torch.zeros_like(local_label))[:, None]
        sums = torch.zeros(3, N, dtype=torch.float32, device=local_logits.device)  # sumexp, z_label, sum exp*z
        for s, e in _chunks(N, chunk_size):
            z = local_logits[s:e].float() * inv_t  # [chunk, V_local]
            ez = torch.exp(z - rowmax[s:e, None])
            sums[0, s:e] = ez.sum(-1)
            sums[1, s:e] = torch.where(owned[s:e], z.gather(-1, idx[s:e]).squeeze(-1), 0.0)
            sums[2, s:e] = (ez * z).sum(-1)
        dist.all_reduce(sums, group=group)
        lse = rowmax + sums[0].log()  # [N]
        mean_z = sums[2] / sums[0]  # E_p[z]
        ctx.save_for_backward(local_logits, idx, owned, lse, mean_z)
        ctx.inv_t, ctx.chunk = inv_t, chunk_size
        return sums[1] - lse, lse - mean_z

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        local_logits, idx, owned, lse, mean_z = ctx.saved_tensors
        grad = torch.empty_like(local_logits)
        for s, e in _chunks(local_logits.shape[0], ctx.chunk):
            z = local_logits[s:e].float() * ctx.inv_t
            p = torch.exp(z - lse[s:e, None])  # [chunk, V_local]
            g = -p * g_logp[s:e, None]
            g.scatter_add_(-1, idx[s:e], torch.where(owned[s:e], g_logp[s:e], 0.0)[:, None])
            if g_ent is not None:
                g += g_ent[s:e, None] * p * (mean_z[s:e, None] - z)
            grad[s:e] = (g * ctx.inv_t).to(grad.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_logprobs_and_entropy(
    local_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    group,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logprobs_and_entropy` for logits sharded over the vocabulary across ``group``.

    Args:
        local_logits: ``[..., V_local]``, this rank's vocabulary ids ``[vocab_start, vocab_start + V_local)``.
        labels: ``[...]`` global token ids.
    Returns:
        ``(logp [...], entropy [...] or None)`` float32, equal on every rank of ``group``.
    """
    if local_logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(local_logits.shape)} and labels {tuple(labels.shape)} disagree")
    flat = local_logits.reshape(-1, local_logits.shape[-1])
    logp, ent = _VocabParallel.apply(flat, labels.reshape(-1).long(), int(vocab_start), group, float(temperature),
                                     int(chunk_size))
    return logp.reshape(labels.shape), (ent.reshape(labels.shape) if with_entropy else None)
