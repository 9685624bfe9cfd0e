"""Log-probs of chosen tokens straight from hidden states, a chunk of tokens at a time: the model's
``[tokens, vocab]`` logits are never held whole, forward or backward.

An HF causal LM's forward ends in ``logits = self.lm_head(hidden)``: at 32K tokens and a 152K
vocabulary that is ~10 GB of bf16 logits, and the fp32 log-softmax and its backward more again.
Two pieces replace it:

* :func:`head_hidden_states` — inside the block the HF forward skips its head: ``model(...).logits``
  is the final hidden state ``[b, n, H]`` at the ``logits_to_keep`` positions (the head module is
  swapped for a pass-through for the call; its hooks, FSDP2's included, do not run);
* :func:`chunked_logprobs` — ``hidden [N, H]`` and the head module -> ``(logp [N], entropy [N])`` in
  fp32. Per chunk of ``chunk_tokens`` rows: ``logits = head(hidden_chunk)`` in the compute dtype,
  then log-softmax / gather / entropy in fp32 (:class:`_TokenLogProb`, analytic backward).
  Each chunk runs under non-reentrant ``torch.utils.checkpoint``: the forward keeps only the
  chunk's inputs and its ``[chunk]`` results, the backward recomputes one chunk's logits at a time.
  Peak memory is O(chunk_tokens x vocab) instead of O(N x vocab); results and gradients equal the
  unchunked computation (to fp32 rounding).

How the head weight is reached (FSDP2, ``torch.distributed.fsdp.fully_shard``):

* untied head, its own FSDP2 unit (``parallel.parallelize``): the head module is *called once*, with
  its ``forward`` replaced for that call by the chunk loop. FSDP2's hooks run exactly as for the
  plain ``lm_head(hidden)``: one all-gather before the loop, reshard after it, one all-gather when
  the gradient reaches the results (pre-backward hook on the call's outputs; every chunk's
  recomputation happens after it), one reduce-scatter when the gradient reaches ``hidden``
  (post-backward hook on the call's input). Inside the call the weight is the gathered plain tensor.
* tied head (the embedding's weight, in the root unit): the root stays gathered from its forward
  through the backward (FSDP2 does not reshard the root after forward), so the head computes with
  the gathered weight and the root's end-of-backward reduce-scatter takes its gradient.
* no FSDP: the plain module.

Two differences from the plain path under FSDP2, both harmless: FSDP2 records the order of units'
forwards (for backward prefetching) and clears it only at the end of a backward, and an untied
head now runs after the root's forward instead of inside it, so the *first* backward after no-grad
forwards prefetches the head once more at its end (one wasted all-gather, which FSDP2 discards:
``finalize_backward``'s "mistargeted unshard"); and when the model's very first forward runs inside
:func:`head_hidden_states`, FSDP2's debugging name for the head unit is ``lm_head.head``.

Cost: the backward recomputes the head's matmul (one more ``2 N H V`` FLOPs: a third more head
compute, a few percent of a model's step).

Tensor parallelism (the engine's vocab-parallel head, ``parallel.tp_plan(vocab_parallel_head=True)``):
pass ``vocab_start`` and ``group``. Then the head *module* is called per chunk (its TP hooks make
the replicated input a DTensor and return this rank's vocabulary shard of the logits, and
all-reduce the hidden gradient in backward) and the chunk's log-probs are vocab-parallel
(:func:`rlrecipes.algos.logprobs.vocab_parallel_logprobs_and_entropy`: two ``[chunk]`` all-reduces
per chunk, recomputed in backward in the same order on every rank). A vocab-parallel head that is
also an FSDP2 unit of its own (untied model, TP x DP with FSDP) is refused: per-chunk calls would
all-gather and reduce-scatter the head once per chunk; keep the unchunked path there. A head with
TP hooks without ``group`` (the gathered, non-vocab-parallel TP head) is refused too.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator

import torch
import torch.nn as nn

from rlrecipes.algos.logprobs import vocab_parallel_logprobs_and_entropy

from rlrecipes.engines.native import HEAD_CHUNK_TOKENS as DEFAULT_CHUNK_TOKENS
# config fields of HF models that transform the head's output before returning it as logits:
# a pass-through head would hand these transforms hidden states
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class _PassThrough(nn.Module):
    """Stands in for the head during :func:`head_hidden_states`: returns its input. It holds the head
    as a child so that the model's module tree still contains it (FSDP2's lazy initialisation, which
    may run inside that very forward, walks the tree to find every unit)."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _parent_of(model: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    for mod in model.modules():
        for name, c in mod._modules.items():
            if c is child:
                return mod, name
    raise ValueError(f"{type(model).__name__}: its output embeddings ({type(child).__name__}) are not a "
                     "submodule of the model")


def _transformed_logits(model: nn.Module) -> str | None:
    cfg = getattr(model, "config", None)
    for key in _LOGIT_TRANSFORMS:
        v = getattr(cfg, key, None)
        if v not in (None, 0, 0.0, 1, 1.0, False):
            return (f"{type(model).__name__}: config.{key}={v!r} transforms the head's output; the chunked head "
                    "computes plain logits")
    return None


def unsupported(model: nn.Module, *, vocab_parallel: bool = False) -> str | None:
    """Why :func:`head_hidden_states` + :func:`chunked_logprobs` cannot serve this (parallelized) model's
    LM head — logit transforms in its forward, no output embeddings, a vocab-parallel head that is an
    FSDP2 unit of its own, a tensor-parallel head used without ``vocab_parallel`` — or None."""
    why = _transformed_logits(model)
    if why:
        return why
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return f"{type(model).__name__} has no output embeddings (a causal LM head)"
    if vocab_parallel and _is_fsdp_unit(head):
        return ("the vocab-parallel head is also an FSDP2 unit of its own (untied embeddings, TP x FSDP): "
                "chunks would gather and reduce-scatter it once each")
    if not vocab_parallel and _foreign_hooks(head):
        return "the head has forward hooks other than FSDP2's (a tensor-parallel head needs vocab_parallel)"
    return None


@contextlib.contextmanager
def head_hidden_states(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, ``model(...)`` skips its output head: ``.logits`` are the final hidden states
    ``[b, n, H]`` (after the final norm, at the ``logits_to_keep`` positions). Yields the head module
    (``model.get_output_embeddings()``), for :func:`chunked_logprobs`.

    Refuses models whose forward transforms the head's output (logit soft-capping or scaling).
    """
    why = _transformed_logits(model)
    if why:
        raise NotImplementedError(why)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (a causal LM head)")
    parent, name = _parent_of(model, head)
    parent._modules[name] = _PassThrough(head)
    try:
        with warnings.catch_warnings():
            # the hidden states are a slice (a view) of the final norm's output; FSDP2 warns that an
            # in-place op on a root output that is a view would drop its pre-backward hook. The
            # callers slice and reshape it, out of place.
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            yield head
    finally:
        parent._modules[name] = head


# ------------------------------------------------------------------------------ per-chunk math
class _TokenLogProb(torch.autograd.Function):
    """``logits [c, V]`` -> ``(log softmax(z)[target], entropy(z) or None)`` in fp32, ``z = logits / T``.

    Saves only the logits it is given (and ``[c]`` vectors); the backward builds
    ``d/dz = g_logp (onehot - p) + g_ent p (E_p[z] - z)`` in one fp32 ``[c, V]`` buffer (two with
    entropy). Under the caller's checkpoint the saved logits are dropped after the forward and
    recomputed for the backward.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy):
        z = logits.float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)  # [c]
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        ent = mean_z = None
        if with_entropy:
            p = torch.exp(z - lse[:, None])  # [c, V] fp32
            mean_z = p.mul_(z).sum(-1)  # E_p[z]
            ent = lse - mean_z
        ctx.save_for_backward(logits, targets, lse, mean_z)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, mean_z = ctx.saved_tensors
        temperature = ctx.temperature
        z = logits.to(torch.float32, copy=True)
        if temperature != 1.0:
            z.div_(temperature)
        if g_logp is None:
            g_logp = lse.new_zeros(lse.shape)
        if mean_z is not None and g_ent is not None:
            coef = (mean_z[:, None] - z).mul_(g_ent[:, None]).sub_(g_logp[:, None])  # g_ent (E[z] - z) - g_logp
        else:
            coef = -g_logp[:, None]
        g = z.sub_(lse[:, None]).exp_().mul_(coef)  # p * coef, in z's buffer
        del coef
        g.scatter_add_(-1, targets[:, None], g_logp[:, None].to(g.dtype))
        if temperature != 1.0:
            g.div_(temperature)
        return g.to(logits.dtype), None, None, None


def _chunk_logprobs(head_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float, with_entropy: bool, vocab_start: int | None, group):
    logits = head_fn(hidden)  # [c, V] (or this rank's [c, V / tp])
    if group is None:
        return _TokenLogProb.apply(logits, targets, temperature, with_entropy)
    return vocab_parallel_logprobs_and_entropy(logits, targets, vocab_start=vocab_start, group=group,
                                               temperature=temperature, chunk_size=max(1, targets.shape[0]),
                                               with_entropy=with_entropy)


def _chunk_loop(head_fn, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                chunk_tokens: int, vocab_start: int | None, group):
    from torch.utils.checkpoint import checkpoint

    N = hidden.shape[0]
    recompute = torch.is_grad_enabled()
    logps, ents = [], []
    for s in range(0, N, chunk_tokens):
        e = min(s + chunk_tokens, N)
        args = (head_fn, hidden[s:e], targets[s:e], temperature, with_entropy, vocab_start, group)
        if recompute:
            lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        logps.append(lp)
        ents.append(ent)
    if len(logps) == 1:  # a fresh tensor (not a view) either way: FSDP2 hooks the call's outputs
        return logps[0], ents[0]
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def _foreign_hooks(module: nn.Module) -> list:
    """The module's forward (pre-)hooks that are not FSDP2's (tensor-parallel styles register theirs)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - a torch without FSDP2's state class
        FSDPState = ()
    hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
    return [h for h in hooks if not isinstance(getattr(h, "__self__", None), FSDPState)]


def _is_fsdp_unit(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, FSDPModule)


def chunked_logprobs(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *, temperature: float = 1.0,
                     with_entropy: bool = False, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     vocab_start: int | None = None, group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target under ``softmax(head(hidden) / temperature)``, and the entropy.

    Args:
        hidden: ``[N, H]`` (or ``[..., H]``) final hidden states, e.g. from :func:`head_hidden_states`.
        head: the output head module (``model.get_output_embeddings()``); called as a module.
        targets: ``[N]`` (or ``[...]``, the hidden states' leading shape) token ids.
        chunk_tokens: rows per chunk; the peak memory is about ``chunk_tokens x vocab x 12`` bytes
            (compute-dtype logits + two fp32 buffers in the backward) instead of ``N x vocab x ...``.
        vocab_start, group: a vocab-parallel (TP) head: this rank's first vocabulary id and the TP
            process group; results are equal on every rank of the group.
    Returns:
        ``(logp, entropy or None)``, fp32, of ``targets``' shape.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive; got {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: hidden must be "
                         "[..., H] with the targets' leading shape")
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    flat_t = targets.reshape(-1).long()  # [N]
    temperature = float(temperature)
    if flat_h.shape[0] == 0:
        empty = flat_h.new_zeros(shape, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)

    if group is not None:  # vocab-parallel: the head's TP hooks run per chunk
        if vocab_start is None:
            raise ValueError("a vocab-parallel head needs vocab_start (this rank's first vocabulary id)")
        if _is_fsdp_unit(head):
            raise NotImplementedError(
                "chunked_logprobs: a vocab-parallel head that is also an FSDP2 unit of its own (untied "
                "embeddings, TP x FSDP) would be all-gathered and reduce-scattered once per chunk; use the "
                "unchunked vocab-parallel log-probs for this layout")
        logp, ent = _chunk_loop(head, flat_h, flat_t, temperature, with_entropy, int(chunk_tokens),
                                int(vocab_start), group)
    else:
        foreign = _foreign_hooks(head)
        if foreign:
            raise NotImplementedError(
                f"chunked_logprobs: the head {type(head).__name__} has forward hooks that are not FSDP2's "
                f"({len(foreign)}; tensor parallelism registers some): a vocab-parallel head needs "
                "vocab_start= and group=; a gathered TP head is not supported")
        logp, ent = _call_once(head, flat_h, flat_t, temperature, with_entropy, int(chunk_tokens))
    return logp.reshape(shape), (ent.reshape(shape) if ent is not None else None)


def _call_once(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
               with_entropy: bool, chunk_tokens: int):
    """One call of the head module whose ``forward`` is, for that call, the chunk loop over its own
    (hook-free) forward: FSDP2's hooks gather the weight once around it (see the module docstring)."""
    own_forward = head.forward  # the class's forward, bound (or an instance override someone set)
    had_instance_forward = "forward" in head.__dict__

    def loop(x: torch.Tensor):
        for name, p in head.named_parameters():
            if _is_dtensor(p):
                raise RuntimeError(
                    f"chunked_logprobs: head parameter {name!r} is a DTensor inside the head call: a "
                    "tensor-parallel head (pass vocab_start= and group=), or an FSDP2-sharded tied weight "
                    "used outside the root's forward (the root was resharded before the head ran)")
        return _chunk_loop(own_forward, x, targets, temperature, with_entropy, chunk_tokens, None, None)

    head.forward = loop
    try:
        return head(hidden)
    finally:
        if had_instance_forward:
            head.forward = own_forward
        else:
            del head.forward


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


__all__ = ["DEFAULT_CHUNK_TOKENS", "chunked_logprobs", "head_hidden_states", "unsupported"]
