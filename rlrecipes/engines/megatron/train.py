"""megatron-core train engine: log-probs and train steps through megatron's pipeline schedule,
megatron DDP with the distributed optimizer (CUDA; on Ascend after ``mindspeed.megatron_adaptor``).

Layouts: TP, PP (any per-stage layer split, through megatron's ``pipeline_model_parallel_layout``),
EP and expert-TP (megatron's default, expert-TP = TP; ``EngineSpec.expert_tensor_parallel`` sets
another). Each rank reads only its own slices of the HF weights (``shard.py``: grouped q/k/v per
query group, ``[gate; up]`` per TP rank, the vocabulary padded to a multiple of TP, experts by EP
rank numbered locally). Micro-batches are right-aligned rows (each sample's prompt then response from
column 0, padding after it; ``layout.right_align``) under megatron's causal mask alone, padded to a
multiple of TP for sequence parallelism (on whenever TP > 1; ``layout.py``); log-probs come from
fp32 log-softmax over the vocabulary-parallel logits on the last stage and are broadcast to every
stage, so each rank of the model-parallel group returns them.

Context parallelism (``EngineSpec.sp`` = megatron's ``context_parallel_size``, carved out of DP):
each CP rank gets the load-balanced half-chunk pair of every row (``cp.py``), computes the log-probs
of its own columns and all-gathers them over the CP group (autograd-aware), so CP peers return the
same log-probs and compute the same loss, and see the same micro-batches as their TP / PP peers: the
data group (``model_parallel_group``) is TP x CP x PP. Attention: TransformerEngine's on CUDA,
MindSpeed's ``megatron_cp_algo`` on Ascend (``layout.core_attention`` / ``layout.mindspeed_args``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ... import device as devmod
from ...algos.logprobs import logprobs_and_entropy, vocab_parallel_logprobs_and_entropy
from ...core.param_spec import split_layers
from ...core.mesh import world_layout
from ...core.parallel import LayoutError, ParallelLayout
from ...models import ModelDims
from .. import base
from ..base import LossFn, SeqBatch
from ..native import batching
from ..native.loader import build_empty, build_model, source_folder
from ..native.train import resolve_device
from . import cp as cpmod
from . import shard, state
from .layout import (core_attention, ddp_config_kwargs, layout_problems, leading_padding,  # noqa: F401
                     mindspeed_args, mla_core_attention, optimizer_config_kwargs, padded_length, parallel_kwargs,
                     pipeline_layout, response_logit_index, right_align)
from .model import build_gpt, load_megatron_state


def _init_parallel(tp: int, pp: int, ep: int, etp: int, seed: int, cp: int = 1) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp)
    else:
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_context_parallel_world_size())
        if have != (tp, pp, ep, etp, cp):
            raise ValueError(f"megatron's parallel state is TP{have[0]} PP{have[1]} EP{have[2]} ETP{have[3]} "
                             f"CP{have[4]} in this process; this engine wants TP{tp} PP{pp} EP{ep} ETP{etp} CP{cp} "
                             "(megatron holds one layout per process: give ref/critic the actor's layout)")
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _mindspeed_repatch(args: Mapping[str, Any]) -> None:
    """Re-apply MindSpeed's patches with ``args`` (``layout.mindspeed_args``) where its adaptor is loaded
    (Ascend; ``device.prepare_megatron`` imported it with its defaults). ``repatch`` re-applies the
    pre-patches too, among them ``torch.compile`` -> a pass-through: restored afterwards, as at import
    (docs/upstream_contracts.md, MindSpeed import order)."""
    if not args or "mindspeed.megatron_adaptor" not in sys.modules:
        return
    from mindspeed.megatron_adaptor import repatch

    compile_ = torch.compile
    try:
        repatch(dict(args))
    finally:
        torch.compile = compile_


def _data_group(world: int, tp: int, cp: int, pp: int):
    """``(group, leader)``: the process group of this rank's TP x CP x PP peers (one DP rank, the same
    micro-batches) and its first global rank; megatron has no such group (its model-parallel group is
    TP x PP). Collective: every rank creates every group, in the same order."""
    me, mine = dist.get_rank(), None
    for ranks in cpmod.data_peer_ranks(world, tp, cp, pp):
        group = dist.new_group(ranks)
        if me in ranks:
            mine = (group, ranks[0])
    return mine


def _source(model):
    """(reader of HF boxes, dims, HF config dict, source folder or None), without reading weights
    of other ranks from a folder (smoke dims: the tiny model is built whole, seeded)."""
    folder = source_folder(model)
    if folder is None:
        hf_model, dims = build_model(model, seed=0)
        return shard.full_reader(hf_model.state_dict()), dims, hf_model.config.to_dict(), None
    from ...models.safetensors_io import SafetensorsFolder

    meta, dims = build_empty(folder)
    reader = SafetensorsFolder(folder)
    tied = "model.embed_tokens.weight" if dims.tie_embeddings else None
    return (lambda name, shape, box: reader.read_param(name, shape, box, tied_to=tied)), dims, meta.config.to_dict(), folder


class MegatronTrainEngine(base.TrainEngine):
    """Actor / reference on megatron-core (see the module docstring for the layouts)."""

    def __init__(self, model, *, role: str = "actor", layout: ParallelLayout | tuple = (1, 1), pp: int = 1,
                 pp_layers=None,
                 etp: Optional[int] = None, device=None, lr: float = 1e-6, weight_decay: float = 0.0,
                 grad_clip: float = 1.0, seed: int = 0, dtype: str = "auto", micro_batch_size: int = 4,
                 pad_token_id: int = 0, recompute: bool = False, offload_optimizer: bool = False, sp: int = 1):
        lay = world_layout(layout, role=role, sp=sp, pp=pp, pp_layers=pp_layers)  # ParallelLayout, or (tp, ep)
        tp, ep, pp, sp = lay.tp, lay.ep, lay.pp, lay.sp
        etp = int(etp or tp)
        self.device = resolve_device(device)
        read, self.dims, self.hf_config, self._folder = _source(model)  # HF dims and slices: no megatron import
        if lay.pp_layers is None:
            lay = dataclasses.replace(lay, pp_layers=tuple(split_layers(self.dims.num_layers, pp)))
        pp_layers = lay.pp_layers
        if lay.split_problems():
            raise LayoutError(str(lay.split_problems()[0]))
        from importlib.metadata import PackageNotFoundError, version

        try:
            mcore: Optional[str] = version("megatron-core")
        except PackageNotFoundError:
            mcore = None
        have_te = importlib.util.find_spec("transformer_engine") is not None
        problems = layout_problems(self.dims, tp=tp, pp=pp, ep=ep, etp=etp, device=self.device.type,
                                   have_te=have_te, have_mindspeed=importlib.util.find_spec("mindspeed") is not None,
                                   pp_layers=pp_layers, offload_optimizer=offload_optimizer and role != "ref",
                                   megatron_core=mcore, sp=sp)
        if problems:  # the rules plan checked (layout.plan_rules): only reached when plan was skipped
            raise RuntimeError("; ".join(problems))
        attention = core_attention(self.device.type, have_te, sp)  # TE's with CP on CUDA (checked above)
        devmod.prepare_megatron(self.device)  # MindSpeed's adaptor on Ascend, before any megatron import
        _mindspeed_repatch(mindspeed_args(self.dims, sp))  # MindSpeed's CP attention (Ascend, sp > 1)
        devmod.set_device(self.device)
        shard.check_layout(self.dims, shard.Ranks(tp=tp, pp_layers=pp_layers, ep=ep, etp=etp))
        lay.check(ep_groups="across_dp", etp=etp, engine="megatron")  # TP*PP*CP divides the world, EP x ETP a stage
        world = lay.world
        _init_parallel(tp, pp, ep, etp, seed, sp)
        from megatron.core import parallel_state as ps

        self.ranks = shard.Ranks(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), pp_layers=pp_layers,
                                 pp_rank=ps.get_pipeline_model_parallel_rank(), ep=ep,
                                 ep_rank=ps.get_expert_model_parallel_rank(), etp=etp,
                                 etp_rank=ps.get_expert_tensor_parallel_rank(), cp=sp,
                                 cp_rank=ps.get_context_parallel_rank() if sp > 1 else 0)
        self._data_peers = _data_group(world, tp, sp, pp) if sp > 1 else None
        # the resharder's replicas count the CP ranks (megatron's order: TP fastest, then CP, then DP; CP
        # peers hold the same weights as DP peers do)
        self.layout = lay if pp > 1 else dataclasses.replace(lay, pp_layers=None)
        self.role, self.trainable = role, role != "ref"
        self.compute_dtype = devmod.train_dtype(self.device, dtype)
        self.model = build_gpt(self.dims, hf_config=self.hf_config, ranks=self.ranks, dtype=self.compute_dtype,
                               recompute=recompute, training=self.trainable,
                               pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                               core_attention=attention).to(self.device)
        load_megatron_state(self.model, shard.megatron_shard(read, self.dims, self.ranks))
        del read
        self.micro_batch_size, self.pad_token_id = int(micro_batch_size), int(pad_token_id)
        self.optimizer = None
        if self.trainable:
            self._build_optimizer(lr, weight_decay, grad_clip, offload_optimizer)
        else:
            self.model.requires_grad_(False)
        self.step = 0
        self._offloaded = None

    @classmethod
    def create(cls, spec: base.EngineSpec) -> "MegatronTrainEngine":
        if spec.role == "critic":
            raise ValueError("the megatron engine has no critic (value head) in this release; use the native engine")
        return cls(spec.model, role=spec.role, layout=spec.layout, etp=spec.expert_tensor_parallel,
                   device=spec.device, lr=spec.lr,
                   weight_decay=spec.weight_decay, grad_clip=spec.grad_clip, seed=spec.seed, dtype=spec.dtype,
                   micro_batch_size=spec.micro_batch_size, pad_token_id=spec.pad_token_id,
                   recompute=spec.recompute if spec.role != "ref" else False,
                   offload_optimizer=spec.offload_optimizer)

    # ------------------------------------------------------------------ setup
    def _build_optimizer(self, lr, weight_decay, grad_clip, offload) -> None:
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.model.config
        self.model = DistributedDataParallel(config=cfg, module=self.model,
                                             ddp_config=DistributedDataParallelConfig(**ddp_config_kwargs()))
        opt = OptimizerConfig(**optimizer_config_kwargs(lr=lr, weight_decay=weight_decay, grad_clip=grad_clip,
                                                        dtype=self.compute_dtype, offload=offload))
        # grad mode off: the distributed optimizer hands its inner optimizer each fp32 parameter's shard
        # as a view of the parameter (the RMSNorm weights stay fp32 in a bf16 model), a non-leaf under
        # grad mode; the host optimizer (HybridDeviceOptimizer, offload) rebuilds a torch optimizer from
        # those views, which refuses non-leaves ("can't optimize a non-leaf Tensor"). Built under
        # no_grad the views are leaves; nothing else changes (docs/upstream_contracts.md)
        with torch.no_grad():
            self.optimizer = get_megatron_optimizer(opt, [self.model])
        cfg.finalize_model_grads_func = finalize_model_grads
        # the schedule multiplies each micro-batch's loss by this before backward (fp16: the dynamic
        # loss scale, which the optimizer step divides out of the gradients; 1 otherwise), as
        # Megatron-LM's training loop wires it
        cfg.grad_scale_func = self.optimizer.scale_loss

    # ------------------------------------------------------------------ batches
    def _length(self, mb: Mapping[str, Any]) -> int:
        """The columns megatron gets for ``mb``: its width, a multiple of TP under sequence parallelism,
        of ``2 * cp`` chunks under context parallelism (``layout.padded_length``)."""
        return padded_length(int(mb["input_ids"].shape[1]), self.ranks.tp, self.ranks.cp)

    def _device_batch(self, mb: Mapping[str, Any]) -> dict:
        """Padded rows -> megatron inputs: right-aligned ids ``[b, T']`` (``layout.right_align``: the
        causal mask alone is then exact, so no mask is passed) and positions; with CP this rank's
        load-balanced columns of both, ``[b, T' / cp]`` (``cp.split``; megatron slices RoPE alike)."""
        ids, _ = right_align(mb["input_ids"], mb["attention_mask"], self._length(mb), self.pad_token_id)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        r = self.ranks
        ids, pos = cpmod.split(ids, r.cp, r.cp_rank), cpmod.split(pos, r.cp, r.cp_rank)
        return {"ids": ids.to(self.device), "pos": pos.to(self.device)}

    def _token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
        """Log-probs (+ entropy) of ``labels [b, n]`` from this TP rank's vocabulary shard of the logits
        ``[b, n, vocab / tp]`` (the padding ids past the real vocabulary are left out)."""
        a, b, _ = shard.vocab_range(self.dims.vocab_size, self.ranks)
        if self.ranks.tp == 1:
            return logprobs_and_entropy(logits[..., :b], labels, with_entropy=with_entropy)
        from megatron.core import parallel_state as ps

        return vocab_parallel_logprobs_and_entropy(logits[..., :b - a], labels, vocab_start=a,
                                                   group=ps.get_tensor_model_parallel_group(),
                                                   with_entropy=with_entropy)

    def _logprobs(self, logits: torch.Tensor, mb: Mapping[str, Any], with_entropy: bool):
        """Log-probs (+ entropy) ``[b, R]`` of the response tokens from the right-aligned logits
        ``[b, T', vocab / tp]``. With CP (logits ``[b, T' / cp, vocab / tp]``, this rank's columns):
        every local column's next-token log-prob, gathered over the CP group into ``[b, T']``
        (``cp.gather``, autograd-aware), then the response columns as without CP."""
        R = mb["response_mask"].shape[1]
        P = mb["input_ids"].shape[1] - R
        lead = leading_padding(mb["attention_mask"].to(logits.device))  # [b]: how far each row moved left
        idx = response_logit_index(lead, P, R)  # [b, R]
        r = self.ranks
        if r.cp > 1:
            from megatron.core import parallel_state as ps

            ids, _ = right_align(mb["input_ids"], mb["attention_mask"], self._length(mb), self.pad_token_id)
            labels = cpmod.split(cpmod.next_token_labels(ids, self.pad_token_id), r.cp, r.cp_rank)
            logp, ent = self._token_logprobs(logits, labels.to(logits.device), with_entropy)  # [b, T' / cp]
            group = ps.get_context_parallel_group()
            logp, ent = (cpmod.gather(t, group, r.cp, r.cp_rank) for t in (logp, ent))  # [b, T']
            return logp.gather(1, idx), (ent.gather(1, idx) if ent is not None else None)
        ids = mb["input_ids"].to(logits.device)[:, -R:]
        logits = logits.gather(1, idx[..., None].expand(-1, -1, logits.shape[-1]))  # [b, R, vocab / tp]
        return self._token_logprobs(logits, ids, with_entropy)

    def _run(self, mbs: list[dict], step_fn, *, forward_only: bool) -> list:
        """Every micro-batch through megatron's schedule (1F1B over the stages when PP > 1); ``step_fn``
        runs on the last stage only."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        it = iter(mbs)

        def forward_step(_data_iterator, model):
            mb = next(it)
            d = self._device_batch(mb)
            out = model(d["ids"], d["pos"], attention_mask=None)  # megatron's causal mask
            return out, partial(step_fn, mb)

        T = max(self._length(mb) for mb in mbs)
        return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mbs),
                                           model=[self.model], num_microbatches=len(mbs), seq_length=T,
                                           micro_batch_size=self.micro_batch_size, forward_only=forward_only,
                                           collect_non_loss_data=forward_only)

    # ------------------------------------------------------------------ pipeline results
    def _pp(self):
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank(), \
            ps.is_pipeline_last_stage()

    def _from_last_stage(self, flat: Optional[torch.Tensor], numel: int) -> torch.Tensor:
        """The last stage's flat fp32 tensor on every stage of this rank's pipeline."""
        if self.ranks.pp == 1:
            return flat
        group, src, last = self._pp()
        buf = flat.to(self.device) if last else torch.empty(numel, dtype=torch.float32, device=self.device)
        dist.broadcast(buf, src=src, group=group)
        return buf.cpu()

    def _object_from_last_stage(self, obj):
        if self.ranks.pp == 1:
            return obj
        group, src, _ = self._pp()
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    # ------------------------------------------------------------------ interface
    def forward(self, batch: SeqBatch, *, with_entropy: bool = False):
        if not len(batch):
            return [], ([] if with_entropy else None)
        mbs = batching.micro_batches(batch, self.micro_batch_size, self.pad_token_id, device=self.device)
        outs: list = [None] * len(batch)
        ents: list = [None] * len(batch)
        self.model.eval()

        def collect(mb, logits, non_loss_data=False):
            logp, ent = self._logprobs(logits.float(), mb, with_entropy)
            batching.rows_to_samples(outs, mb, logp, batch)
            batching.rows_to_samples(ents, mb, ent, batch)
            return None

        with torch.no_grad():
            self._run(mbs, collect, forward_only=True)
        if self.trainable:
            self.model.train()
        if self.ranks.pp > 1:  # computed on the last stage: every stage returns them
            lens = [int(r.numel()) for r in batch.responses]
            cols = [outs] + ([ents] if with_entropy else [])
            last = self._pp()[2]
            flat = torch.cat([torch.cat(c) for c in cols]) if last else None
            got = self._from_last_stage(flat, sum(lens) * len(cols)).split(lens * len(cols))
            outs, ents = list(got[:len(lens)]), (list(got[len(lens):]) if with_entropy else ents)
        return outs, (ents if with_entropy else None)

    def _micro_batch_loss(self, mb, logits, *, loss_fn: LossFn, n: int, with_entropy: bool, losses: list,
                          acc: dict):
        """The loss of one micro-batch on the last stage, as megatron's schedule wants it: ``(loss * n,
        {"loss": ...})``; the closure's loss and metrics are recorded in ``losses`` / ``acc``. With CP
        every CP rank computes the same loss from the gathered log-probs."""
        logp, ent = self._logprobs(logits.float(), mb, with_entropy)
        cols = {k: (v.to(logp.device) if torch.is_tensor(v) else v) for k, v in mb.items()}
        loss, metrics = loss_fn(logp, ent, cols)
        losses.append(float(loss.detach()))
        for k, v in (metrics or {}).items():
            acc[k].append(float(v))
        # the schedule divides a 2-tuple loss by the micro-batch count (the closure's loss is already its
        # share) and multiplies it by the CP size, which DDP's 1 / (DP * CP) gradient average divides out
        # again: each CP rank's gradient is the part of its own tokens (cp.py)
        return loss * n, {"loss": loss.detach()}

    def train_step(self, batch: SeqBatch, loss_fn: LossFn, *, with_entropy: bool = False) -> dict:
        if not self.trainable:
            raise RuntimeError(f"training on a {self.role!r} engine: only actor/critic engines train")
        mbs = batching.micro_batches(batch, self.micro_batch_size, self.pad_token_id, device=self.device)
        if not mbs:
            return {f"{self.role}/skipped_step": 1.0}
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        n = len(mbs)
        acc: dict[str, list[float]] = defaultdict(list)
        losses: list[float] = []

        step_loss = partial(self._micro_batch_loss, loss_fn=loss_fn, n=n, with_entropy=with_entropy, losses=losses,
                            acc=acc)
        self._run(mbs, step_loss, forward_only=False)
        losses, acc = self._object_from_last_stage((losses, dict(acc)))  # the loss lives on the last stage
        bad = torch.tensor([0.0 if all(math.isfinite(x) for x in losses) else 1.0], device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():  # a non-finite loss on any rank: no update anywhere (bf16 has no grad scaler to skip it)
            ok, grad_norm = False, float("nan")
        else:
            ok, grad_norm, _ = self.optimizer.step()
        skipped = not ok
        if not skipped:
            self.step += 1
        return base.step_metrics(self.role, loss=sum(losses) / max(len(losses), 1), grad_norm=grad_norm or 0.0,
                                 lr=self.optimizer.param_groups[0]["lr"], skipped=skipped, micro_batches=n,
                                 closure=acc)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # ------------------------------------------------------------------ weights
    def _module(self):
        return getattr(self.model, "module", self.model)

    def _megatron_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self._module().state_dict().items()
                if torch.is_tensor(v) and not k.endswith("_extra_state")}

    def param_specs(self) -> list:
        from ...models import param_specs

        return param_specs(self.dims, self.ranks.pp_layers if self.ranks.pp > 1 else None)

    def local_shards(self) -> Mapping[str, torch.Tensor]:
        """This rank's weights under HF names in the resharder's train layout (``self.layout``).
        Collective over the expert groups when expert-TP > 1."""
        from megatron.core import parallel_state as ps

        hf = shard.hf_from_shard(self._megatron_state(), self.dims, self.ranks)
        groups = None
        if self.dims.is_moe and (self.ranks.etp > 1 or self.ranks.ep > 1):
            groups = shard.ExpertGroups(etp=ps.get_expert_tensor_parallel_group(), ep=ps.get_expert_model_parallel_group(),
                                        rank_in_stage=dist.get_rank() % self.layout.stage_size)
        return shard.resharder_shards(hf, self.dims, self.ranks, groups)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model under HF names on global rank 0 (empty elsewhere), on the host. Collective."""
        out: dict[str, torch.Tensor] = {}
        shard.gather_full(self.param_specs(), self.local_shards(), self.layout, dist.get_rank(),
                          lambda name, t: out.__setitem__(name, t))
        return out

    def model_parallel_group(self):
        """The ranks that see the same micro-batches: TP x PP peers (megatron's model-parallel group),
        and with CP their CP peers too (:func:`_data_group`)."""
        from megatron.core import parallel_state as ps

        if self.ranks.cp > 1:
            return self._data_peers
        if self.ranks.tp * self.ranks.pp == 1:
            return None, dist.get_rank()
        group = ps.get_model_parallel_group()
        return group, dist.get_global_rank(group, 0)

    @property
    def dp_rank(self) -> int:  # megatron's DP rank without CP: CP peers share it
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    @property
    def is_data_leader(self) -> bool:
        return self.model_parallel_group()[1] == dist.get_rank()

    # ------------------------------------------------------------------ memory and checkpoints
    def offload(self) -> None:
        """DDP parameter and gradient buffers, fp32 main parameters and Adam state to host (storage
        level: every view stays valid); a no-op when already offloaded or nothing is on the device."""
        if self._offloaded is None and devmod.is_accelerator(self.device.type):
            self._offloaded = state.offload(self.model, self.optimizer, self.device)

    def onload(self) -> None:
        if self._offloaded is not None:
            self._offloaded.restore()
            self._offloaded = None

    def _layout_record(self) -> dict:
        r = self.ranks
        return {"tp": r.tp, "pp_layers": list(r.pp_layers), "ep": r.ep, "etp": r.etp, "dp": self.layout.replicas,
                "family": self.dims.family, "num_layers": self.dims.num_layers, "hidden": self.dims.hidden_size,
                "dtype": str(self.compute_dtype), "optimizer": self.optimizer is not None}

    def save(self, path) -> None:
        """Per-rank checkpoint (model + distributed-optimizer shard) with a manifest (``state.py``)."""
        self.onload()
        state.save(path, self._module(), self.optimizer, layout=self._layout_record(), step=self.step)

    def load(self, path) -> None:
        self.onload()
        self.step = state.load(path, self._module(), self.optimizer, layout=self._layout_record())

    def export_hf(self, folder: str | os.PathLike) -> Path:
        """An HF folder written by global rank 0, one gathered parameter at a time. Collective."""
        from ..native.loader import HFFolderWriter
        from ...models import hf_config

        writer = HFFolderWriter(folder, hf_config(self.dims)) if dist.get_rank() == 0 else None
        shard.gather_full(self.param_specs(), self.local_shards(), self.layout, dist.get_rank(),
                          writer.add if writer is not None else None)
        if writer is not None:
            writer.close(tokenizer_from=self._folder)
        dist.barrier()
        return Path(folder)
