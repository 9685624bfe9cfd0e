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
