"""Small shared helpers for the algos package (masked reductions, name lookup)."""
from __future__ import annotations

import difflib
from typing import Iterable

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set. ``x``, ``mask``: same shape (e.g. ``[batch, seq]``)."""
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set (0 when the mask is empty)."""
    m = mask.to(x.dtype)
    denom = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / denom.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over masked positions (Bessel-corrected when ``unbiased``)."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    n = m.sum()
    var = masked_sum((x - mean) ** 2, m)
    denom = (n - 1.0) if unbiased else n
    return var / denom.clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over masked positions; masked-out positions become 0."""
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def unknown_name_error(kind: str, name: str, choices: Iterable[str], where: str = "") -> ValueError:
    """A ValueError that lists the valid choices and a difflib "did you mean" suggestion."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    loc = f" ({where})" if where else ""
    return ValueError(f"unknown {kind} {name!r}{loc}; choose one of: {', '.join(choices)}.{hint}")


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise a ValueError naming the tensors when their shapes differ."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"shape mismatch: {first_name} has shape {tuple(first.shape)} but {name} has "
                f"{tuple(t.shape)}; pass padded [batch, seq] tensors of the same shape"
            )
