"""Per-rank shards of a megatron-core model, in plain torch (no megatron import).

Megatron's tensor / expert / pipeline split of a model is an HF-level slice followed by the
converter: a rank's TP shard of q, k and v is a contiguous block of heads (whole query groups), of
``gate_proj`` / ``up_proj`` a block of rows, of ``o_proj`` / ``down_proj`` a block of columns, so
:func:`convert.hf_to_megatron` on those slices, with a model whose head / expert counts are the
rank's own (:func:`local_dims`), gives exactly the rank's megatron tensors: grouped ``linear_qkv``
per TP rank, ``linear_fc1 = [gate_r; up_r]`` as megatron's SwiGLU splits it, experts renumbered
locally from ``0``, layers numbered per stage. :func:`megatron_to_hf` undoes it the same way.

* vocabulary: megatron's ``VocabParallelEmbedding`` and output layer need the vocabulary to divide
  by TP; it is padded with zero rows to :func:`padded_vocab` (the padded logits are masked out of
  the log-probs, and dropped on the way back to HF);
* experts: EP rank ``k`` holds experts ``[k E/ep, (k+1) E/ep)``; expert-TP splits each expert's
  ``gate`` / ``up`` rows and ``down`` columns over the expert-TP group;
* tied embeddings with PP > 1: the last stage holds its own ``output_layer`` copy of the embedding
  (megatron keeps the two in sync through its embedding group);
* MLA's down projections (``q_a_proj``, ``kv_a_proj_with_mqa``) are whole on every TP rank (the
  engine's spec makes them megatron's duplicated ``Linear``, see model.py), as in the HF table.

The resharder (``rlrecipes.core.resharder``) sees HF names and contiguous slices in *its* layout
(:func:`resharder_shards`): TP slices are megatron's; an expert block is whole experts of EP block
``rank_in_stage % ep``, which is megatron's EP rank when expert-TP is 1; with expert-TP > 1 the
expert shards are gathered over expert-TP (and EP when the block differs) first.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

from ...core.parallel import ParallelLayout
from ...models import ModelDims
from ...models.sharding import param_specs as hf_param_specs
from .convert import hf_to_megatron, megatron_to_hf

Box = list  # [(start, stop)] per dimension
ReadBox = Callable[[str, tuple, Box], torch.Tensor]  # (HF name, full shape, box) -> tensor of the box


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where a rank sits in megatron's layout (sizes and this rank's coordinates)."""

    tp: int = 1
    tp_rank: int = 0
    pp_layers: tuple[int, ...] = ()
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    cp: int = 1
    """context-parallel size (``layout.sp``): CP peers hold the same weights, so no slice depends on it"""
    cp_rank: int = 0

    @property
    def pp(self) -> int:
        return max(len(self.pp_layers), 1)

    def layers(self, num_layers: int) -> tuple[int, int]:
        """``(first, stop)`` decoder layers of this rank's stage."""
        if not self.pp_layers:
            return 0, num_layers
        first = sum(self.pp_layers[:self.pp_rank])
        return first, first + self.pp_layers[self.pp_rank]


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary megatron's vocab-parallel layers hold: the next multiple of TP."""
    return -(-vocab // tp) * tp


def vocab_range(vocab: int, r: Ranks) -> tuple[int, int, int]:
    """``(start, stop, rows)``: the real vocabulary ids ``[start, stop)`` of this TP rank and its row
    count in the padded layout (``rows - (stop - start)`` zero rows follow)."""
    rows = padded_vocab(vocab, r.tp) // r.tp
    start = r.tp_rank * rows
    return min(start, vocab), min(start + rows, vocab), rows


class _LocalDims:
    """A model's dims with this rank's head / expert counts (what the converter reads)."""

    def __init__(self, dims: ModelDims, r: Ranks):
        self._dims = dims
        self.num_heads = dims.num_heads // r.tp
        self.num_kv_heads = dims.num_kv_heads // r.tp
        self.num_experts = dims.num_experts // r.ep if dims.num_experts else 0

    def __getattr__(self, key):
        return getattr(self._dims, key)


def local_dims(dims: ModelDims, r: Ranks):
    check_layout(dims, r)
    return _LocalDims(dims, r)


def layout_errors(dims: ModelDims, r: Ranks) -> list[str]:
    """What megatron needs of the model beyond the layout rules every engine shares (heads, KV
    heads, experts, the layer split: ``ParallelLayout.model_problems``, which ``plan`` reports once):
    the expert size divides by expert-TP, the MLP size by TP. Empty when it can."""
    why = []
    if dims.is_moe and dims.moe_intermediate_size % r.etp:
        why.append(f"expert size {dims.moe_intermediate_size} does not divide by expert-TP{r.etp}")
    if dims.intermediate_size % r.tp:
        why.append(f"MLP size {dims.intermediate_size} does not divide by TP{r.tp}")
    return why


def check_layout(dims: ModelDims, r: Ranks) -> None:
    """The layout's sizes divide the model as megatron needs (a clear error, before any build): the
    shared layout rules and megatron's own (:func:`layout_errors`)."""
    shared = ParallelLayout(tp=r.tp, pp=r.pp, ep=r.ep, pp_layers=r.pp_layers or None).model_problems(dims)
    why = [str(p) for p in shared] + layout_errors(dims, r)
    if why:
        raise ValueError("megatron layout: " + "; ".join(why))


# ------------------------------------------------------------------------------------- HF -> rank
def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    return i * (n // k), (i + 1) * (n // k)


def hf_local(name: str, shape: tuple, kind: str, read: ReadBox, dims: ModelDims, r: Ranks) -> torch.Tensor:
    """This rank's HF-level slice of one parameter (megatron's split), read box by box."""
    full = [(0, int(n)) for n in shape]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        a, b, rows = vocab_range(dims.vocab_size, r)
        t = read(name, shape, [(a, b)] + full[1:])
        return torch.cat([t, t.new_zeros(rows - (b - a), *t.shape[1:])]) if b - a < rows else t
    if kind == "expert":
        e = _chunk(shape[0], r.ep, r.ep_rank)
        if name.endswith("gate_up_proj"):  # [E, 2I, H]: the expert-TP rank's gate rows, then its up rows
            inter = shape[1] // 2
            g0, g1 = _chunk(inter, r.etp, r.etp_rank)
            return torch.cat([read(name, shape, [e, (g0, g1), full[2]]),
                              read(name, shape, [e, (inter + g0, inter + g1), full[2]])], dim=1)
        return read(name, shape, [e, full[1], _chunk(shape[2], r.etp, r.etp_rank)])  # down [E, H, I]
    if kind in ("column", "vocab"):
        return read(name, shape, [_chunk(shape[0], r.tp, r.tp_rank)] + full[1:])
    if kind == "row" and len(shape) > 1:
        return read(name, shape, [full[0], _chunk(shape[1], r.tp, r.tp_rank)] + full[2:])
    return read(name, shape, full)


def stage_specs(dims: ModelDims, r: Ranks) -> list:
    """HF ParamSpecs of the parameters on this rank's pipeline stage."""
    return [s for s in hf_param_specs(dims, r.pp_layers if r.pp > 1 else None) if s.pp_stage == r.pp_rank]


def megatron_shard(read: ReadBox, dims: ModelDims, r: Ranks) -> dict[str, torch.Tensor]:
    """This rank's megatron state dict (local names, local shapes) from HF tensors read by ``read``."""
    first, stop = r.layers(dims.num_layers)
    hf = {s.name: hf_local(s.name, s.shape, s.kind, read, dims, r) for s in stage_specs(dims, r)}
    mg = hf_to_megatron(hf, local_dims(dims, r), layers=(first, stop))
    if dims.tie_embeddings and stop == dims.num_layers and first > 0:  # the last stage's copy of the head
        spec = next(s for s in hf_param_specs(dims) if s.name.endswith("embed_tokens.weight"))
        mg["output_layer.weight"] = hf_local(spec.name, spec.shape, spec.kind, read, dims, r)
    return mg


def full_reader(hf: Mapping[str, torch.Tensor]) -> ReadBox:
    """A :data:`ReadBox` over full in-memory HF tensors."""
    return lambda name, shape, box: hf[name][tuple(slice(a, b) for a, b in box)]


# ------------------------------------------------------------------------------------- rank -> HF
def hf_from_shard(mg: Mapping[str, torch.Tensor], dims: ModelDims, r: Ranks) -> dict[str, torch.Tensor]:
    """The inverse of :func:`megatron_shard`: this rank's tensors under HF names, megatron's split
    (padding rows of the vocabulary dropped, experts numbered globally by their fused tensor's rows)."""
    first, stop = r.layers(dims.num_layers)
    mg = {k: v for k, v in mg.items() if not k.endswith("_extra_state")}
    if dims.tie_embeddings and first > 0:
        mg.pop("output_layer.weight", None)
    hf = megatron_to_hf(mg, local_dims(dims, r), layers=(first, stop))
    a, b, _ = vocab_range(dims.vocab_size, r)
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        if k in hf:
            hf[k] = hf[k][:b - a]
    return hf


@dataclasses.dataclass
class ExpertGroups:
    """Process groups to bring expert shards into the resharder's layout (ranks in group order)."""

    etp: object = None
    ep: object = None
    rank_in_stage: int = 0


def _gather(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def resharder_shards(hf: dict[str, torch.Tensor], dims: ModelDims, r: Ranks,
                     groups: Optional[ExpertGroups] = None) -> dict[str, torch.Tensor]:
    """:func:`hf_from_shard`'s tensors in the resharder's train layout (see the module docstring).
    Collective over the expert groups when expert-TP > 1 (every rank of the stage calls it)."""
    if not dims.is_moe or r.etp == 1:  # megatron's EP block is rank_in_stage % ep, the resharder's
        return hf
    want = groups.rank_in_stage % r.ep  # (the same on every rank of the stage: all of them gather)
    for name in sorted(k for k in hf if k.endswith(("experts.gate_up_proj", "experts.down_proj"))):
        t = hf[name]
        if r.etp > 1:
            parts = _gather(t, groups.etp, r.etp)
            if name.endswith("gate_up_proj"):  # each part is [gate_r; up_r] per expert
                t = torch.cat([torch.cat([p.chunk(2, dim=1)[h] for p in parts], dim=1) for h in (0, 1)], dim=1)
            else:
                t = torch.cat(parts, dim=2)
        if r.ep > 1:
            t = _gather(t, groups.ep, r.ep)[want]
        hf[name] = t
    return hf


# ------------------------------------------------------------------------------------- export
def gather_full(specs: list, shards: Mapping[str, torch.Tensor], layout: ParallelLayout, rank: int,
                write: Optional[Callable[[str, torch.Tensor], None]], group=None) -> None:
    """Assemble every parameter from the resharder-layout ``shards`` of all ranks on global rank 0 of
    ``group`` (one parameter at a time: rank 0 holds one full tensor, never the model) and pass it to
    ``write`` there. Collective over ``group`` (the ranks of ``layout``, in layout order)."""
    me = layout.coords(rank)
    for spec in specs:
        stage = layout.stage_of(spec)
        mine = None
        if stage == me["pp"] and spec.name in shards:
            c = layout.chunk_index(spec, rank)
            loc = rank % layout.stage_size
            first = next(i for i in range(layout.stage_size)
                         if layout.chunk_index(spec, stage * layout.stage_size + i) == c)
            if first == loc:  # one sender per chunk
                mine = (c, shards[spec.name].detach().cpu())
        got = [None] * layout.world if rank == 0 else None
        dist.gather_object(mine, got, dst=0, group=group)
        if rank != 0:
            continue
        pieces = sorted((p for p in got if p is not None), key=lambda p: p[0])
        full = pieces[0][1] if spec.split_dim is None else torch.cat([p for _, p in pieces], dim=spec.split_dim)
        if tuple(full.shape) != tuple(spec.shape):
            raise RuntimeError(f"{spec.name}: gathered {list(full.shape)}, the model has {list(spec.shape)}")
        write(spec.name, full)
