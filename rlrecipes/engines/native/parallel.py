"""Parallelism for the native engines: device meshes and TP/EP/FSDP2 on HF models (the shards of
the result: ``shards.py``; its gradients across the mesh: ``grads.py``).

Everything here follows ``docs/conventions.md``:

* rank order is Megatron's (TP fastest, then DP); the mesh of one engine is its layout's
  (``ParallelLayout.build_mesh``, ``rlrecipes/core/mesh.py``):
  ``("dp", "etp", "ep")`` of shape ``(dp, tp // ep, ep)`` with ``"tp"`` the flattening of
  ``("etp", "ep")``; so ``tp_rank = etp_rank * ep + ep_rank`` and ``ep_rank = tp_rank % ep``,
  i.e. EP groups are contiguous blocks of ranks inside one TP group (native engines require
  ``ep | tp``: every rank of an EP group sees the same tokens);
* TP sharding of HF parameter names (:func:`param_rule`) is done with PyTorch's own DTensor
  plans: ``ColwiseParallel`` (q/k/v, gate/up, MLA q_b/kv_b, lm_head), ``RowwiseParallel``
  (o_proj, down_proj; the embedding as vocab-parallel ``RowwiseParallel``);
* experts (fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``) are split along dim 0
  into contiguous blocks of ``E // ep`` experts; the block is a DTensor ``Shard(0)`` on the
  ``"ep"`` sub-mesh so that DCP checkpoints and ``full_tensor()`` exports see the whole tensor.
* data parallelism is FSDP2 (``fully_shard``) over the ``"dp"`` sub-mesh (``"dpsp"``, DP x SP flattened, under
  Ulysses sequence parallelism: ``MeshInfo.grad_mesh``). FSDP2 runs on gloo in
  torch >= 2.6 (gloo has reduce_scatter / all_gather_into_tensor), so the same code runs on
  CPU, CUDA and NPU; there is no separate DP all-reduce path.
"""
from __future__ import annotations

import re
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from rlrecipes.core.mesh import MeshInfo
from rlrecipes.engines.native import MOE_GROUPED_MM
from rlrecipes.engines.native.experts import local_experts, select_implementation
from rlrecipes.models.sharding import kind_of, tp_dim_of

# ---------------------------------------------------------------------------------------------
# Name -> sharding rule: derived from the model families' one table (rlrecipes/models/families).
# ---------------------------------------------------------------------------------------------
_RULE_OF_KIND = {"column": "col", "vocab": "vocab", "row": "row", "replicated": "replicate", "expert": "expert"}


def param_rule(name: str) -> str:
    """Sharding rule of an HF parameter name: ``col``, ``row``, ``vocab``, ``expert`` or ``replicate``.

    >>> param_rule("model.layers.0.self_attn.q_proj.bias")
    'col'
    >>> param_rule("model.layers.1.mlp.experts.gate_up_proj")
    'expert'
    """
    return _RULE_OF_KIND[kind_of(name)]


def tp_dim(name: str) -> int | None:
    """The dimension TP splits for this parameter (None: not split over TP; a row bias is replicated)."""
    return tp_dim_of(name)


def is_expert(name: str) -> bool:
    return kind_of(name) == "expert"


def tp_partial_grad(name: str) -> bool:
    """Replicated params that act per-head on TP-local heads: their grad is a partial sum over TP."""
    return bool(re.search(r"\.self_attn\.(q_norm|k_norm)\.weight$", name))


# ---------------------------------------------------------------------------------------------
# EP: autograd-aware reduce over the EP group
# ---------------------------------------------------------------------------------------------
class _CopyToGroup(torch.autograd.Function):
    """Forward identity; backward sum-all-reduce (the input is replicated, its grad is partial)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward sum-all-reduce of partial outputs; backward identity (the output grad is replicated).

    ``torch.distributed.nn.functional.all_reduce`` would all-reduce the gradient too, which is
    right when every rank owns a different loss term but gives ``ep x`` the gradient here, where
    every rank of the group computes the same (replicated) loss.
    """

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class EPExperts(nn.Module):
    """Fused HF experts holding only this EP rank's contiguous block of ``E // ep`` experts.

    Drop-in for ``Qwen3MoeExperts`` / ``DeepseekV3Experts``: same call
    ``(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]`` and the same
    parameter names (``gate_up_proj``, ``down_proj``), so state-dict names do not change.
    Every rank of the EP group sees the same tokens and routing; each computes its local
    experts' contribution and a sum-all-reduce over the group combines them.

    ``grouped_mm``: the local experts as two grouped GEMMs (``torch._grouped_mm``) over the tokens
    sorted by expert, instead of a loop of two GEMMs per expert, where the op takes the operands
    (:func:`.experts.local_experts`); the same values (tests check forward and gradients).
    """

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh, grouped_mm: bool = MOE_GROUPED_MM):
        super().__init__()
        self.grouped_mm = bool(grouped_mm) and hasattr(torch, "_grouped_mm")
        gate_up = experts.gate_up_proj.detach()  # [E, 2I, H]
        down = experts.down_proj.detach()  # [E, H, I]
        if getattr(experts, "has_bias", False):
            raise NotImplementedError("EPExperts: experts with biases are not supported")
        ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        n_exp = gate_up.shape[0]
        if n_exp % ep:
            raise ValueError(f"num_experts={n_exp} is not divisible by ep={ep}")
        self.num_experts, self.num_local = n_exp, n_exp // ep
        self.first = rank * self.num_local
        sl = slice(self.first, self.first + self.num_local)
        self.gate_up_proj = nn.Parameter(DTensor.from_local(gate_up[sl].clone(), ep_mesh, [Shard(0)],
                                                            run_check=False))
        self.down_proj = nn.Parameter(DTensor.from_local(down[sl].clone(), ep_mesh, [Shard(0)], run_check=False))
        self.act_fn = experts.act_fn
        self.group = ep_mesh.get_group()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # One identity/all-reduce pair for hidden states and routing weights together: ranks whose
        # graphs differ (data-dependent expert hits) still issue exactly one backward collective,
        # in the same order; ``out`` always depends on it, even when no token hits a local expert.
        H = hidden_states.shape[-1]
        xw = _CopyToGroup.apply(torch.cat([hidden_states, top_k_weights.to(hidden_states.dtype)], -1), self.group)
        x, w = xw[:, :H], xw[:, H:]  # [N, H], [N, k]
        local_idx = top_k_index - self.first  # [N, k]
        hit = (local_idx >= 0) & (local_idx < self.num_local)  # [N, k]
        tok, slot = hit.nonzero(as_tuple=True)  # [M], [M]
        e_of = local_idx[tok, slot]  # [M]
        order = torch.argsort(e_of, stable=True)
        out = local_experts(x, w, tok[order], slot[order], e_of[order], _local(self.gate_up_proj),
                            _local(self.down_proj), self.act_fn, grouped=self.grouped_mm)  # [N, H]
        return _ReduceFromGroup.apply(out + 0.0 * xw.sum(), self.group)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------------------------
# Apply TP / EP / FSDP2 to an HF causal LM (or a backbone + value head)
# ---------------------------------------------------------------------------------------------
def _check_divisible(config, tp: int) -> None:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    if heads % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={heads}")
    if kv % tp and getattr(config, "kv_lora_rank", None) is None:
        raise ValueError(f"tp={tp} does not divide num_key_value_heads={kv}; choose tp | {kv}")


def tp_plan(model: nn.Module, *, vocab_parallel_head: bool = False) -> dict[str, object]:
    """The DTensor TP plan (exact module FQN -> ParallelStyle) derived from parameter names.

    ``vocab_parallel_head``: ``lm_head`` returns each rank's vocabulary shard of the logits
    ``[b, t, V / tp]`` (for vocab-parallel log-probs) instead of gathering ``[b, t, V]`` everywhere.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    for fqn, mod in model.named_modules():
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            continue
        rule = param_rule(f"{fqn}.weight")
        if rule == "vocab":
            plan[fqn] = RowwiseParallel(input_layouts=Replicate())
        elif rule == "col":
            if fqn == "lm_head" and not vocab_parallel_head:  # gather the vocab shards: [b, t, V] everywhere
                plan[fqn] = ColwiseParallel(output_layouts=Replicate())
            else:
                plan[fqn] = ColwiseParallel()
        elif rule == "row":
            plan[fqn] = RowwiseParallel()
    return plan


def parallelize(model: nn.Module, mesh: MeshInfo, *, fsdp: bool, mp_dtype: torch.dtype | None = None,
                replicate_head: bool = False, vocab_parallel_head: bool = False,
                moe_grouped_mm: bool = MOE_GROUPED_MM, fsdp_prefetch: int = 0) -> nn.Module:
    """TP (DTensor plans over ``mesh.tp_mesh``), EP (``EPExperts`` over ``mesh.ep_mesh``), then FSDP2.

    ``fsdp``: wrap every decoder layer and the root with ``fully_shard`` over ``mesh.dp_mesh``;
    ``mp_dtype``: FSDP2 mixed precision compute dtype (params stay in their own dtype as masters);
    ``replicate_head``: keep ``lm_head`` replicated (a critic's ``Linear(hidden, 1)`` value head);
    ``vocab_parallel_head``: under TP, ``lm_head`` returns local vocabulary shards (see :func:`tp_plan`);
    ``moe_grouped_mm``: MoE experts as grouped GEMMs, else a loop over the experts (:mod:`.experts`):
    transformers' own implementation at EP 1, :class:`EPExperts`' under EP;
    ``fsdp_prefetch``: with ``fsdp``, each decoder layer issues the all-gathers of the next this many
    layers in forward (the previous ones in backward) as soon as its own are copied out
    (:func:`set_layer_prefetch`); 0 leaves FSDP2's own overlap (the next unit's all-gather issued
    when the host reaches it).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    cfg = model.config
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) and hasattr(model, "lm_head")
    shares_head = tied and not replicate_head
    if mesh.tp > 1:
        _check_divisible(cfg, mesh.tp)
        plan = tp_plan(model, vocab_parallel_head=vocab_parallel_head)
        if tied or replicate_head:
            plan.pop("lm_head", None)
        tied = tied and not replicate_head
        _mla_rope_key_grad_hooks(model, mesh.tp_mesh.get_group())
        parallelize_module(model, mesh.tp_mesh, plan)
        if tied:
            # the embedding is vocab-parallel Shard(0): the same DTensor serves as a column-parallel head
            model.lm_head.weight = model.get_input_embeddings().weight
            _attach_colwise_hooks(model.lm_head, mesh.tp_mesh, gather=not vocab_parallel_head)
    select_implementation(model, moe_grouped_mm)  # EP 1: transformers' experts; under EP, EPExperts' below
    if mesh.ep > 1:
        for fqn, mod in list(model.named_modules()):
            if fqn.endswith("mlp.experts") and hasattr(mod, "gate_up_proj"):
                parent = model.get_submodule(fqn.rsplit(".", 1)[0])
                parent.experts = EPExperts(mod, mesh.ep_mesh, grouped_mm=moe_grouped_mm)
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else None
        kw = {"mesh": mesh.grad_mesh}
        if mp is not None:
            kw["mp_policy"] = mp
        layers = list(_decoder_layers(model))
        for layer in layers:
            fully_shard(layer, **kw)
        set_layer_prefetch(layers, fsdp_prefetch)
        if not shares_head and hasattr(model, "lm_head"):
            # untied: the embedding and the head are units of their own, gathered only around
            # their use (in the root they would stay gathered from forward through backward and
            # reduce-scatter together at its end: [V, H] twice over at the peak)
            fully_shard(model.get_input_embeddings(), **kw)
            if not replicate_head:
                fully_shard(model.lm_head, **kw)
        fully_shard(model, **kw)
    return model


def set_layer_prefetch(layers: list, depth: int) -> None:
    """FSDP2 explicit prefetch over ``layers`` (each already ``fully_shard``-ed): in forward, layer
    ``i`` prefetches layers ``i+1 .. i+depth``; in backward, ``i-1 .. i-depth`` (nearest first).
    Depth 1 is FSDP2's default order issued earlier from the host (what helps a host-bound step);
    2 and more overlap further at the cost of that many gathered layers held at once."""
    if depth < 0:
        raise ValueError(f"fsdp_prefetch={depth}: a number of layers, 0 or more")
    if depth == 0:
        return
    for i, layer in enumerate(layers):
        ahead = layers[i + 1:i + 1 + depth]
        behind = layers[max(0, i - depth):i][::-1]
        if ahead:
            layer.set_modules_to_forward_prefetch(ahead)
        if behind:
            layer.set_modules_to_backward_prefetch(behind)


def _mla_rope_key_grad_hooks(model: nn.Module, tp_group) -> None:
    """MLA: the rope key (last ``qk_rope_head_dim`` outputs of ``kv_a_proj_with_mqa``) is shared by
    all heads, but each TP rank only uses it for its local heads, so its grad is a partial sum over
    TP. A forward hook routes that slice through copy-to-group (identity fwd, all-reduce bwd)."""
    cfg = model.config
    rope = getattr(cfg, "qk_rope_head_dim", None)
    if not getattr(cfg, "kv_lora_rank", None) or not rope:
        return

    def hook(_m, _args, out):  # out: [b, t, kv_lora_rank + rope]
        latent, k_rot = out.split([out.shape[-1] - rope, rope], dim=-1)
        return torch.cat([latent, _CopyToGroup.apply(k_rot, tp_group)], dim=-1)

    for fqn, mod in model.named_modules():
        if fqn.endswith("self_attn.kv_a_proj_with_mqa"):
            mod.register_forward_hook(hook)


def _attach_colwise_hooks(lm_head: nn.Module, tp_mesh: DeviceMesh, *, gather: bool = True) -> None:
    """Input Replicate -> DTensor and output Shard(-1) -> Replicate (``gather``) or the local vocabulary
    shard, for a head sharing the embedding."""

    def pre(_m, args):
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
        return (x,) + tuple(args[1:])

    def post(_m, _args, out):
        if not isinstance(out, DTensor):
            return out
        return out.redistribute(tp_mesh, [Replicate()]).to_local() if gather else out.to_local()

    lm_head.register_forward_pre_hook(pre)
    lm_head.register_forward_hook(post)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units below the root: the decoder layers, and a VL model's vision blocks too."""
    backbone = getattr(model, "model", model)
    if hasattr(backbone, "language_model") and hasattr(backbone, "visual"):  # Qwen2.5-VL
        return list(backbone.visual.blocks) + list(backbone.language_model.layers)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no .model.layers to shard with FSDP2")
    return list(layers)


__all__ = ["EPExperts", "is_expert", "param_rule", "parallelize", "tp_dim",
           "tp_partial_grad", "tp_plan"]
