"""Parallelism for the native engines: device meshes, TP/EP/FSDP2 on HF models, grad-norm, shards.

Everything here follows ``docs/conventions.md``:

* rank order is Megatron's (TP fastest, then DP); the mesh of one engine is
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
* data parallelism is FSDP2 (``fully_shard``) over the ``"dp"`` sub-mesh. FSDP2 runs on gloo in
  torch >= 2.6 (gloo has reduce_scatter / all_gather_into_tensor), so the same code runs on
  CPU, CUDA and NPU; there is no separate DP all-reduce path.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

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
# Layout and meshes
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeshInfo:
    """One engine's device mesh over the whole world (see module docstring for the rank order)."""

    root: DeviceMesh  # ("dp", "etp", "ep")
    tp: int
    ep: int
    dp: int

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.root["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.root["tp"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        return self.root["ep"]

    @property
    def tp_rank(self) -> int:
        r = self.__dict__.get("_tp_rank")  # fixed for the mesh's life; asked on every call
        if r is None:
            r = self.__dict__["_tp_rank"] = self.tp_mesh.get_local_rank()
        return r

    @property
    def dp_rank(self) -> int:
        r = self.__dict__.get("_dp_rank")  # fixed for the mesh's life; asked on every call
        if r is None:
            r = self.__dict__["_dp_rank"] = self.dp_mesh.get_local_rank()
        return r

    @property
    def ep_rank(self) -> int:
        r = self.__dict__.get("_ep_rank")  # fixed for the mesh's life; asked on every call
        if r is None:
            r = self.__dict__["_ep_rank"] = self.ep_mesh.get_local_rank()
        return r

    @property
    def world(self) -> int:
        return self.tp * self.dp


def build_mesh(device_type: str, tp: int = 1, ep: int = 1) -> MeshInfo:
    """A (dp, tp) mesh with EP inside TP over the whole initialised world.

    Raises a clear error when the layout does not fit the world or ``ep`` does not divide ``tp``.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "torch.distributed.init_process_group(device.comm_backend(), ...) first "
                           "(a single process can use world_size=1)")
    world = dist.get_world_size()
    if tp < 1 or ep < 1:
        raise ValueError(f"layout tp={tp}, ep={ep}: both must be >= 1")
    if world % tp:
        raise ValueError(f"layout tp={tp} does not divide the world size {world}")
    if tp % ep:
        raise ValueError(f"native engines run EP inside the TP group, so ep must divide tp: got "
                         f"tp={tp}, ep={ep}; use the megatron engine for EP across DP ranks")
    dp = world // tp
    root = init_device_mesh(device_type, (dp, tp // ep, ep), mesh_dim_names=("dp", "etp", "ep"))
    root["etp", "ep"]._flatten("tp")
    return MeshInfo(root=root, tp=tp, ep=ep, dp=dp)


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
    """

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh):
        super().__init__()
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
        gate_up = _local(self.gate_up_proj)  # [E_local, 2I, H]
        down = _local(self.down_proj)  # [E_local, H, I]
        out = torch.zeros_like(x) + 0.0 * xw.sum()  # [N, H]
        local_idx = top_k_index - self.first  # [N, k]
        hit = (local_idx >= 0) & (local_idx < self.num_local)  # [N, k]
        tok, slot = hit.nonzero(as_tuple=True)  # [M], [M]
        if tok.numel():
            e_of = local_idx[tok, slot]  # [M]
            order = torch.argsort(e_of, stable=True)
            tok, slot, e_of = tok[order], slot[order], e_of[order]
            counts = torch.bincount(e_of, minlength=self.num_local).tolist()
            start = 0
            for e, c in enumerate(counts):
                if c == 0:
                    continue
                t, s = tok[start:start + c], slot[start:start + c]  # [c]
                start += c
                gate, up = F.linear(x[t], gate_up[e]).chunk(2, dim=-1)  # [c, I] each
                y = F.linear(self.act_fn(gate) * up, down[e])  # [c, H]
                out.index_add_(0, t, (y * w[t, s, None]).to(out.dtype))
        return _ReduceFromGroup.apply(out, self.group)


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
                replicate_head: bool = False, vocab_parallel_head: bool = False) -> nn.Module:
    """TP (DTensor plans over ``mesh.tp_mesh``), EP (``EPExperts`` over ``mesh.ep_mesh``), then FSDP2.

    ``fsdp``: wrap every decoder layer and the root with ``fully_shard`` over ``mesh.dp_mesh``;
    ``mp_dtype``: FSDP2 mixed precision compute dtype (params stay in their own dtype as masters);
    ``replicate_head``: keep ``lm_head`` replicated (a critic's ``Linear(hidden, 1)`` value head);
    ``vocab_parallel_head``: under TP, ``lm_head`` returns local vocabulary shards (see :func:`tp_plan`).
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
    if mesh.ep > 1:
        for fqn, mod in list(model.named_modules()):
            if fqn.endswith("mlp.experts") and hasattr(mod, "gate_up_proj"):
                parent = model.get_submodule(fqn.rsplit(".", 1)[0])
                parent.experts = EPExperts(mod, mesh.ep_mesh)
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype else None
        kw = {"mesh": mesh.dp_mesh}
        if mp is not None:
            kw["mp_policy"] = mp
        for layer in _decoder_layers(model):
            fully_shard(layer, **kw)
        if not shares_head and hasattr(model, "lm_head"):
            # untied: the embedding and the head are units of their own, gathered only around
            # their use (in the root they would stay gathered from forward through backward and
            # reduce-scatter together at its end: [V, H] twice over at the peak)
            fully_shard(model.get_input_embeddings(), **kw)
            if not replicate_head:
                fully_shard(model.lm_head, **kw)
        fully_shard(model, **kw)
    return model


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
    backbone = getattr(model, "model", model)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no .model.layers to shard with FSDP2")
    return list(layers)


# ---------------------------------------------------------------------------------------------
# Shards, full tensors, grad norm
# ---------------------------------------------------------------------------------------------
def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones under every name) and persistent buffers, with HF names."""
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.add(name)
        yield name, p
    sd_keys = set(model.state_dict().keys())
    for name, b in model.named_buffers():
        if name in sd_keys and name not in seen:
            yield name, b


def train_layout_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's TP/EP shard of a (possibly FSDP-sharded) DTensor with the DP dim all-gathered."""
    if not isinstance(t, DTensor):
        return t.detach()
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or ()
    placements = [Replicate() if (i < len(names) and names[i] == "dp") else p for i, p in enumerate(t.placements)]
    if list(placements) != list(t.placements):
        t = t.redistribute(mesh, placements)
    return t.to_local().detach()


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter/persistent buffer of this rank in the train layout (see conventions).

    Tensors FSDP shards plainly along dim 0 (nothing else splits dim 0) are gathered together: one
    all-gather per dtype over the DP group instead of one per tensor (a step's weight hand-off at
    DP > 1 was one collective per parameter). The rest go one at a time through ``redistribute``."""
    with torch.no_grad():
        items = list(named_tensors(model))
        out: dict[str, torch.Tensor] = {}
        batch: dict[tuple, list[tuple[str, DTensor]]] = {}
        for name, t in items:
            dp = _plain_dp_dim(t)
            if dp is None:
                out[name] = train_layout_shard(t)
            else:
                batch.setdefault((t.dtype, id(t.device_mesh), dp), []).append((name, t))
        for (_, _, dp), group in batch.items():
            out.update(_gather_dim0(group, dp))
        return {name: out[name] for name, _ in items}


def _plain_dp_dim(t: torch.Tensor) -> int | None:
    """The mesh dim of "dp" when ``t`` is FSDP-sharded as a plain ``Shard(0)`` there and no other
    mesh dim splits dim 0 (else None: the general path)."""
    if not isinstance(t, DTensor) or t.dim() == 0:
        return None
    names = t.device_mesh.mesh_dim_names or ()
    dp = names.index("dp") if "dp" in names else None
    if dp is None or type(t.placements[dp]) is not Shard or t.placements[dp].dim != 0:
        return None
    for i, p in enumerate(t.placements):
        if i != dp and not (isinstance(p, Replicate) or (type(p) is Shard and p.dim != 0)):
            return None
    return dp


def _gather_dim0(group: list[tuple[str, DTensor]], dp: int) -> dict[str, torch.Tensor]:
    """All-gather the dim-0 FSDP shards of ``group`` (same dtype and mesh) in one collective.

    Each rank sends its shard rows padded to ``ceil(rows / dp_size)`` (torch.chunk's split, which
    DTensor's Shard(0) uses), flattened back to back; the full rows are then cut out per tensor."""
    mesh = group[0][1].device_mesh
    pg, size = mesh.get_group(dp), mesh.size(dp)
    locals_ = [t.to_local() for _, t in group]
    rows = [int(t.shape[0]) for _, t in group]
    per_row = [torch.Size(loc.shape[1:]).numel() for loc in locals_]
    chunk = [-(-n // size) for n in rows]
    sizes = [c * r for c, r in zip(chunk, per_row)]
    send = torch.zeros(sum(sizes), dtype=locals_[0].dtype, device=locals_[0].device)
    off = 0
    for loc, n in zip(locals_, sizes):
        send[off:off + loc.numel()].copy_(loc.reshape(-1))
        off += n
    recv = torch.empty(size * send.numel(), dtype=send.dtype, device=send.device)
    dist.all_gather_into_tensor(recv, send, group=pg)
    recv = recv.view(size, -1)  # [dp ranks, packed shards]
    out, off = {}, 0
    for (name, t), loc, n, c, r, k in zip(group, locals_, rows, chunk, per_row, sizes):
        parts = [recv[q, off:off + max(0, min(c, n - q * c)) * r] for q in range(size)]
        out[name] = torch.cat(parts).view(n, *loc.shape[1:])
        off += k
    return out


def local_box(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, stop)`` per dimension of this rank's local shard of ``t`` in global coordinates.

    Every placement the engine creates (TP ``Shard``, EP ``Shard(0)``, FSDP2's ``Shard(0)`` and its
    strided form when FSDP and TP split the same dimension) leaves each rank one contiguous box.
    """
    if not isinstance(t, DTensor):
        return [(0, int(n)) for n in t.shape]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return [(int(o), int(o) + int(n)) for o, n in zip(offset, shape)]


def full_state_dict(model: nn.Module, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded tensors (collective on every rank; ``keep=False`` drops them, e.g. off rank 0)."""
    out = {}
    with torch.no_grad():
        for name, t in named_tensors(model):
            full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            if keep:
                out[name] = full.cpu().clone()
    return out


def copy_shard_(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy ``value`` (this rank's local shard) into ``param`` in place, checking the shape."""
    dst = _local(param.data if isinstance(param, nn.Parameter) else param)
    if tuple(dst.shape) != tuple(value.shape):
        raise ValueError(f"load_shards: {name}: got shape {tuple(value.shape)}, this rank holds "
                         f"{tuple(dst.shape)} (wrong layout?)")
    dst.copy_(value.to(device=dst.device, dtype=dst.dtype))


def _replication(t: torch.Tensor, world: int) -> int:
    """How many ranks of the world hold each element of ``t``'s local shard."""
    if not isinstance(t, DTensor):
        return world
    shards = 1
    for i, p in enumerate(t.placements):
        if p.is_shard():
            shards *= t.device_mesh.size(i)
    return max(world // shards, 1)


def allreduce_dp_grads(params: Sequence[torch.Tensor], mesh: MeshInfo,
                       flag: torch.Tensor | None = None) -> torch.Tensor | None:
    """Replicated DP (no FSDP): average every gradient over the DP group in one all-reduce of one
    flat buffer per dtype (a missing gradient counts as zeros, so every rank sends the same
    layout). Each rank's local TP/EP shard is reduced with the DP peers holding the same shard.
    ``flag`` (a 0-dim number) rides in the first buffer and comes back summed over the group."""
    group = mesh.dp_mesh.get_group()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(_local(p.grad))
    summed = None
    for grads in by_dtype.values():
        parts = [g.reshape(-1) for g in grads]
        if flag is not None and summed is None:
            parts.append(flag.reshape(1).to(grads[0].dtype))
        flat = torch.cat(parts)  # [sum numel (+ 1)]
        dist.all_reduce(flat, group=group)
        if flag is not None and summed is None:
            summed, flat = flat[-1].double(), flat[:-1]
        flat /= mesh.dp
        for g, v in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(v.view_as(g))
    return summed if flag is not None else None


def local_grad_sq_sum(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global grad norm (float64): ``sum |g_local|^2 / replication``
    (replication = ranks holding that element: TP copies of norms, ``tp/ep`` copies of expert blocks,
    DP copies without FSDP). A sum-all-reduce over the world gives the squared global norm."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        g = p.grad
        if g is None:
            continue
        gl = _local(g)
        total += gl.detach().double().pow(2).sum() / _replication(g, world)
    return total


def global_grad_norm(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients across the whole mesh, counting every distinct element once
    (:func:`local_grad_sq_sum` and one sum-all-reduce over the world): identical on every rank."""
    total = local_grad_sq_sum(params, device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt().float()


def scale_grads_(params: Iterable[torch.Tensor], coef: float) -> None:
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef)


def tp_partial_params(model: nn.Module, mesh: MeshInfo) -> list[torch.Tensor]:
    """The parameters whose grads :func:`allreduce_tp_partial_grads` sums over TP (none at TP1)."""
    if mesh.tp == 1:
        return []
    return [p for name, p in model.named_parameters() if tp_partial_grad(name)]


def allreduce_tp_partial_grads(model: nn.Module, mesh: MeshInfo, *, params: list[torch.Tensor] | None = None) -> None:
    """Sum the per-head norm grads (q_norm/k_norm) over the TP group (each rank saw its heads only).
    ``params``: :func:`tp_partial_params` of ``model``, when the caller keeps it across steps."""
    if mesh.tp == 1:
        return
    group = mesh.tp_mesh.get_group()
    for p in (tp_partial_params(model, mesh) if params is None else params):
        if p.grad is not None:
            dist.all_reduce(_local(p.grad), group=group)


def convention_slice(full: torch.Tensor, name: str, tp: int, tp_rank: int, ep: int, ep_rank: int) -> torch.Tensor:
    """The slice of a full tensor a rank holds per docs/conventions.md (torch.chunk semantics)."""
    if is_expert(name):
        return torch.chunk(full, ep, dim=0)[ep_rank] if ep > 1 else full
    d = tp_dim(name)
    if d is None or tp == 1:
        return full
    return torch.chunk(full, tp, dim=d)[tp_rank]


__all__ = ["EPExperts", "MeshInfo", "allreduce_tp_partial_grads", "build_mesh", "convention_slice",
           "copy_shard_", "full_state_dict", "global_grad_norm", "is_expert", "local_box", "local_grad_sq_sum",
           "local_shards",
           "named_tensors",
           "param_rule", "parallelize", "scale_grads_", "tp_dim", "tp_partial_grad", "tp_partial_params", "tp_plan",
           "train_layout_shard"]
