"""MoE experts as grouped GEMMs or as a loop over experts (the engines' ``moe_grouped_mm`` option).

Two places run the routed experts of a fused HF experts module (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``: Qwen3-MoE, DeepSeek-V3):

* EP = 1: the HF module itself. transformers (>= 5.5, read in 5.19 and 5.24) dispatches its forward
  on ``config._experts_implementation``: ``"grouped_mm"`` (its default: the tokens sorted by expert,
  two ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` calls, and its own per-expert loop
  where the op cannot run, e.g. non-bf16 weights under ``torch.compile``) or ``"eager"`` (a loop over
  the experts that got tokens). :func:`select_implementation` sets it on every model of the tree;
  nothing here re-implements it.
* EP > 1: :class:`~rlrecipes.engines.native.parallel.EPExperts`, which holds only its rank's block of
  experts and runs :func:`local_experts` on the tokens routed to it.

Both paths compute the same values (tests: ``tests/unit/test_moe_grouped_mm.py``,
``tests/unit/test_ep_experts_grouped.py``, ``tests/dist/test_engine_native_dist.py``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

GROUPED, LOOP = "grouped_mm", "eager"
"""transformers' names of the two experts implementations (``config._experts_implementation``)."""

_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _aligned(t: torch.Tensor, check_ptr: bool) -> bool:
    """``torch._grouped_mm``'s operand rule (``torch/_meta_registrations.py``, ``_meta_grouped_mm_common``):
    one of the last two dimensions has stride 1, the other a stride of a multiple of 16 bytes; and
    (CUDA's TMA loads) a 16-byte aligned start."""
    elt = t.element_size()
    s = t.stride()
    ok = (s[-1] == 1 and s[-2] * elt % 16 == 0) or (s[-2] == 1 and s[-1] * elt % 16 == 0)
    return ok and (not check_ptr or t.data_ptr() % 16 == 0)


def grouped_mm_fits(*operands: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands as they are: the op exists, one dtype of
    bf16 / fp16 / fp32, 16-byte strides; under ``torch.compile`` bf16 only (the op's fake kernel
    refuses others). Elsewhere the caller loops over the experts."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    dtype = operands[0].dtype
    if dtype not in _GROUPED_DTYPES or any(t.dtype != dtype for t in operands):
        return False
    compiling = torch.compiler.is_compiling()
    if compiling and dtype != torch.bfloat16:
        return False
    return all(_aligned(t, check_ptr=not compiling) for t in operands)


def local_experts(x: torch.Tensor, weights: torch.Tensor, tok: torch.Tensor, slot: torch.Tensor,
                  expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn, *,
                  grouped: bool) -> torch.Tensor:
    """The experts' weighted outputs summed per token: ``[N, H]``.

    ``x [N, H]`` hidden states; ``weights [N, k]`` routing weights; ``tok, slot, expert [M]``: the
    (token, top-k slot) pairs routed to the experts held here and their local expert index, sorted by
    expert (stable); ``gate_up [E, 2I, H]``, ``down [E, H, I]``. ``grouped``: two grouped GEMMs over
    the sorted rows where :func:`grouped_mm_fits`, else one pair of GEMMs per expert with tokens.
    Experts no token reached get no gradient either way.
    """
    out = torch.zeros_like(x)  # [N, H]
    if tok.numel() == 0:
        return out
    counts = torch.bincount(expert, minlength=gate_up.shape[0])  # [E]
    rows = x[tok]  # [M, H]
    gu_t, down_t = gate_up.transpose(-2, -1), down.transpose(-2, -1)  # [E, H, 2I], [E, I, H]
    if grouped and grouped_mm_fits(rows, gu_t, down_t) and gate_up.shape[1] // 2 * rows.element_size() % 16 == 0:
        offs = counts.cumsum(0).to(torch.int32)  # [E]: the end row of each expert's group
        gate, up = torch._grouped_mm(rows, gu_t, offs=offs).chunk(2, dim=-1)  # [M, I] each
        y = torch._grouped_mm(act_fn(gate) * up, down_t, offs=offs)  # [M, H]
    else:
        parts, start = [], 0
        for e, c in enumerate(counts.tolist()):  # one host sync for the counts
            if c == 0:
                continue
            gate, up = F.linear(rows[start:start + c], gate_up[e]).chunk(2, dim=-1)  # [c, I] each
            parts.append(F.linear(act_fn(gate) * up, down[e]))  # [c, H]
            start += c
        y = torch.cat(parts)  # [M, H]
    return out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))


def fused_experts(model: nn.Module) -> list[nn.Module]:
    """The fused experts modules of ``model``: those holding a ``gate_up_proj`` parameter ``[E, 2I, H]``
    (found by attribute, not by name: PEFT's LoRA wraps ``mlp.experts`` when its target names match the
    experts' parameters, and the module then sits at ``mlp.experts.base_layer...``)."""
    return [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)]


def select_implementation(model: nn.Module, grouped: bool) -> str | None:
    """Set transformers' experts implementation of ``model`` (and its sub-models) to ``"grouped_mm"``
    or ``"eager"`` (the loop). Returns the name set, or None for a model without fused experts.

    A model whose transformers cannot switch (no ``set_experts_implementation``, or a class without
    ``@use_experts_implementation``) raises: the option would be silently ignored otherwise.
    """
    if not fused_experts(model):
        return None
    name = GROUPED if grouped else LOOP
    can = getattr(model, "_can_set_experts_implementation", None)
    if not hasattr(model, "set_experts_implementation") or (can is not None and not can()):
        raise NotImplementedError(
            f"moe_grouped_mm={grouped}: {type(model).__name__} cannot switch its experts implementation in "
            "this transformers (needs set_experts_implementation and @use_experts_implementation, "
            "transformers >= 5.5)")
    if model.config._experts_implementation != name:
        model.set_experts_implementation(name)
    return name


__all__ = ["GROUPED", "LOOP", "fused_experts", "grouped_mm_fits", "local_experts", "select_implementation"]
