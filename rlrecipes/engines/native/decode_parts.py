"""What :class:`~rlrecipes.engines.native.decode.FastDecoder` can run, and the module calls it
makes without HF's wrappers: which attention kinds have a hand-written step, whether a layer's
hooks or norms allow the fused path, and the fused norm / MLP calls themselves."""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def supports_fast_decode(model: nn.Module) -> bool:
    """True when ``model`` is an HF causal LM whose decode step :class:`FastDecoder` can run."""
    backbone = getattr(model, "model", None)
    if backbone is None or not hasattr(model, "lm_head"):
        return False
    for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(backbone, attr):
            return False
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if any(t != "full_attention" for t in types):
        return False  # sliding-window layers need their own mask
    if getattr(cfg, "final_logit_softcapping", None):
        return False
    return True


def _has_hooks(mod: nn.Module) -> bool:
    from torch.nn.modules import module as _m

    return bool(mod._forward_hooks or mod._forward_pre_hooks or _m._global_forward_hooks
                or _m._global_forward_pre_hooks)


_RMS_PROBED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _fused_rms_norm_matches(mod: nn.Module, w: torch.Tensor, eps: float) -> bool:
    """Whether ``F.rms_norm`` reproduces this RMSNorm module bitwise (probed once per module)."""
    seen = _RMS_PROBED.setdefault(mod, {})
    key = (w.dtype, str(w.device), eps)
    if key not in seen:
        probe = torch.randn((8, w.shape[0]), generator=torch.Generator().manual_seed(0)).to(w.device)
        seen[key] = bool(torch.equal(F.rms_norm(probe, (w.shape[0],), w, eps), mod.forward(probe)))
    return seen[key]


def fast_call(mod: nn.Module):
    """A callable computing exactly ``mod(x)`` with less per-call Python.

    Hooked modules (DTensor TP plans install their layout conversions as hooks) are returned as
    is; a plain ``nn.Linear`` becomes ``F.linear`` on its current weight/bias objects; an fp32
    RMSNorm becomes ``F.rms_norm`` when that is bitwise equal on a probe; anything else runs its
    ``forward`` without ``nn.Module.__call__``.
    """
    if _has_hooks(mod):
        return mod
    if type(mod) is nn.Linear and not isinstance(mod.weight, DTensor):
        w, b = mod.weight, mod.bias
        return lambda x: F.linear(x, w, b)
    if type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
        w, eps = mod.weight, mod.variance_epsilon
        if not isinstance(w, DTensor) and w.dtype == torch.float32 and w.dim() == 1:
            shape = (w.shape[0],)
            if _fused_rms_norm_matches(mod, w, eps):
                return lambda x: F.rms_norm(x, shape, w, eps)
    return mod.forward


def mlp_call(mlp: nn.Module):
    """``down(act(gate(x)) * up(x))`` with fast calls for gated dense MLPs; the module itself otherwise."""
    parts = ("gate_proj", "up_proj", "down_proj", "act_fn")
    if _has_hooks(mlp) or not type(mlp).__name__.endswith("MLP") or not all(hasattr(mlp, a) for a in parts):
        return fast_call(mlp)
    gate, up, down, act = (fast_call(getattr(mlp, a)) for a in parts)
    return lambda x: down(act(gate(x)) * up(x))


_GQA_ATTENTION = ("Qwen2Attention", "Qwen3MoeAttention", "Qwen3Attention")
_MLA_ATTENTION = ("DeepseekV3Attention",)
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def attention_kind(layer: nn.Module) -> str:
    """``gqa`` / ``mla``: a hand-written decode step exists; ``layer``: call the HF decoder layer."""
    if not all(hasattr(layer, a) for a in _LAYER_PARTS):
        return "layer"
    name = type(layer.self_attn).__name__
    if name in _GQA_ATTENTION and getattr(layer.self_attn, "sliding_window", None) is None:
        return "gqa"
    if name in _MLA_ATTENTION:
        return "mla"
    return "layer"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
