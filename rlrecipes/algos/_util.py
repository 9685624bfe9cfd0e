"""Small shared helpers for the algos package (masked reductions, name lookup)."""
from __future__ import annotations

import difflib
from typing import Any, Callable, Iterable, Iterator

import torch


def masked_select_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` is set, 0 elsewhere, by selection: a NaN or inf at a masked-out
    (padded) position does not leak into sums (``x * mask`` would give ``nan * 0 = nan``)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set. ``x``, ``mask``: same shape (e.g. ``[batch, seq]``)."""
    sel = masked_select_zero(x, mask)
    return sel.sum() if dim is None else sel.sum(dim=dim)


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
    return masked_select_zero(out, mask)


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


class Registry:
    """Name -> implementation for one recipe key (``algorithm.kl_estimator``, ...).

    Implementations register themselves where they are defined::

        KL_ESTIMATORS = Registry("kl_estimator", "algorithm.kl_estimator")

        @KL_ESTIMATORS.register("k3", "low_var_kl")
        def k3(d): ...

    and callers dispatch with ``KL_ESTIMATORS.get(name)``; an unknown name raises a ValueError that
    names the recipe key, lists the choices and suggests the closest one.
    """

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key
        self._table: dict[str, Any] = {}

    def register(self, name: str, *aliases: str) -> Callable[[Any], Any]:
        def deco(obj):
            for n in (name, *aliases):
                if n in self._table:
                    raise ValueError(f"{self.key}: {n!r} is registered twice")
                self._table[n] = obj
            return obj

        return deco

    def get(self, name: str) -> Any:
        if name not in self._table:
            raise unknown_name_error(self.kind, name, self._table, self.key)
        return self._table[name]

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def names(self) -> list[str]:
        return list(self._table)
