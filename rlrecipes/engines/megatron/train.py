"""megatron-core train engine: log-probs and train steps through megatron's schedule, megatron DDP
with the distributed optimizer (CUDA; on Ascend after ``mindspeed.megatron_adaptor``).

Written so far for one model-parallel rank per replica (TP1 PP1 EP1; data parallel over the
world): ``__init__`` refuses other layouts until the TP/EP slicing of converted tensors and the
pipeline stage split are written (docs/megatron.md). Micro-batches are padded rows (left-padded
prompt, right-padded response) with an explicit causal + key-padding mask, as megatron's local
attention takes; log-probs come from fp32 log-softmax over the (full, TP1) vocabulary.
"""
from __future__ import annotations

import math
import os
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ... import device as devmod
from ...algos.logprobs import logprobs_and_entropy
from ...models import ModelDims
from .. import base
from ..base import LossFn, SeqBatch
from ..native import batching
from ..native.loader import build_model
from ..native.train import resolve_device
from .model import build_gpt, load_hf_state


def _init_parallel(tp: int, pp: int, ep: int, seed: int) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _hf_source(model) -> tuple[dict, ModelDims, dict]:
    """(full HF state dict on the host, dims, HF config dict) of a folder or of smoke dims."""
    # TP1 PP1: this rank holds the whole model anyway (sliced reads come with the TP/PP split)
    hf_model, dims = build_model(model if isinstance(model, ModelDims) else str(model), seed=0)
    return hf_model.state_dict(), dims, hf_model.config.to_dict()


class MegatronTrainEngine(base.TrainEngine):
    """Actor / reference on megatron-core (see the module docstring for the layouts written so far)."""

    def __init__(self, model, *, role: str = "actor", layout=(1, 1), pp: int = 1, device=None,
                 lr: float = 1e-6, weight_decay: float = 0.0, grad_clip: float = 1.0, seed: int = 0,
                 dtype: str = "auto", micro_batch_size: int = 4, pad_token_id: int = 0,
                 recompute: bool = False, offload_optimizer: bool = False):
        tp, ep = (tuple(layout) + (1,))[:2]
        if (tp, pp, ep) != (1, 1, 1):
            raise NotImplementedError(f"megatron engine: TP{tp} PP{pp} EP{ep} is not written yet (TP1 PP1 EP1 "
                                      "is); docs/megatron.md says what is missing")
        self.device = resolve_device(device)
        devmod.prepare_megatron(self.device)  # MindSpeed's adaptor on Ascend; refuses the CPU
        devmod.set_device(self.device)
        _init_parallel(tp, pp, ep, seed)
        self.role, self.trainable = role, role != "ref"
        self.compute_dtype = devmod.train_dtype(self.device, dtype)
        hf_state, self.dims, self.hf_config = _hf_source(model)
        extra: dict[str, Any] = {}
        if recompute:
            extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        self.model = build_gpt(self.dims, hf_config=self.hf_config, params_dtype=self.compute_dtype,
                               **extra).to(self.device)
        load_hf_state(self.model, hf_state, self.dims)
        del hf_state
        self.micro_batch_size, self.pad_token_id = int(micro_batch_size), int(pad_token_id)
        self.optimizer = None
        if self.trainable:
            self._build_optimizer(lr, weight_decay, grad_clip, offload_optimizer)
        else:
            self.model.requires_grad_(False)
        self.step = 0

    # ------------------------------------------------------------------ setup
    def _build_optimizer(self, lr, weight_decay, grad_clip, offload) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.model.config
        self.model = DistributedDataParallel(
            config=cfg, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
            module=self.model)
        bf16 = self.compute_dtype == torch.bfloat16
        opt = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=grad_clip, bf16=bf16,
                              fp16=self.compute_dtype == torch.float16, params_dtype=self.compute_dtype,
                              use_distributed_optimizer=True, optimizer_cpu_offload=offload,
                              adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8)
        self.optimizer = get_megatron_optimizer(opt, [self.model])
        from megatron.core.distributed import finalize_model_grads

        cfg.finalize_model_grads_func = finalize_model_grads

    # ------------------------------------------------------------------ batches
    def _device_batch(self, mb: Mapping[str, Any]) -> dict:
        """Padded rows -> megatron inputs: ids, positions, a [b, 1, T, T] mask (True = masked)."""
        ids = mb["input_ids"].to(self.device)
        keep = mb["attention_mask"].to(self.device).bool()
        T = ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        mask = ~(causal[None] & keep[:, None, :])[:, None]  # [b, 1, T, T]
        pos = (keep.long().cumsum(-1) - 1).clamp(min=0)
        return {"ids": ids, "pos": pos, "mask": mask}

    def _logprobs(self, logits: torch.Tensor, mb: Mapping[str, Any], with_entropy: bool):
        R = mb["response_mask"].shape[1]
        ids = mb["input_ids"].to(logits.device)
        return logprobs_and_entropy(logits[:, -R - 1:-1], ids[:, -R:], with_entropy=with_entropy)

    def _run(self, mbs: list[dict], step_fn, *, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        it = iter(mbs)

        def forward_step(_data_iterator, model):
            mb = next(it)
            d = self._device_batch(mb)
            out = model(d["ids"], d["pos"], attention_mask=d["mask"])
            return out, partial(step_fn, mb)

        T = max(int(mb["input_ids"].shape[1]) for mb in mbs)
        return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mbs),
                                           model=[self.model], num_microbatches=len(mbs), seq_length=T,
                                           micro_batch_size=self.micro_batch_size, forward_only=forward_only,
                                           collect_non_loss_data=forward_only)

    # ------------------------------------------------------------------ interface
    def forward(self, batch: SeqBatch, *, with_entropy: bool = False):
        if not len(batch):
            return [], ([] if with_entropy else None)
        mbs = batching.micro_batches(batch, self.micro_batch_size, self.pad_token_id)
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
        return outs, (ents if with_entropy else None)

    def train_step(self, batch: SeqBatch, loss_fn: LossFn, *, with_entropy: bool = False) -> dict:
        if not self.trainable:
            raise RuntimeError(f"training on a {self.role!r} engine: only actor/critic engines train")
        mbs = batching.micro_batches(batch, self.micro_batch_size, self.pad_token_id)
        if not mbs:
            return {f"{self.role}/skipped_step": 1.0}
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        n = len(mbs)
        acc: dict[str, list[float]] = defaultdict(list)
        losses: list[float] = []

        def step_loss(mb, logits):
            logp, ent = self._logprobs(logits.float(), mb, with_entropy)
            cols = {k: (v.to(logp.device) if torch.is_tensor(v) else v) for k, v in mb.items()}
            loss, metrics = loss_fn(logp, ent, cols)
            losses.append(float(loss.detach()))
            for k, v in (metrics or {}).items():
                acc[k].append(float(v))
            # the schedule divides by the micro-batch count; the closure's loss is already its share
            return loss * n, {"loss": loss.detach()}

        self._run(mbs, step_loss, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        skipped = not ok or not all(math.isfinite(x) for x in losses)
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

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model under HF names (TP1 PP1: this rank holds all of it), on the host."""
        from .convert import megatron_to_hf

        mg = {k: v.detach().cpu() for k, v in self._module().state_dict().items() if not k.endswith("_extra_state")}
        return megatron_to_hf(mg, self.dims)

    def param_specs(self) -> list:
        raise NotImplementedError("megatron engine: resharder specs are not written yet (docs/megatron.md)")

    def local_shards(self) -> Mapping[str, torch.Tensor]:
        return self.hf_state_dict()

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    @property
    def is_data_leader(self) -> bool:
        return True  # TP1 PP1: every rank is its own replica's leader

    def offload(self) -> None:
        raise NotImplementedError("megatron engine: offload is not written yet (docs/megatron.md)")

    def onload(self) -> None:
        raise NotImplementedError("megatron engine: onload is not written yet (docs/megatron.md)")

    def save(self, path) -> None:
        raise NotImplementedError("megatron engine: checkpoints are not written yet (docs/megatron.md)")

    def load(self, path) -> None:
        raise NotImplementedError("megatron engine: checkpoints are not written yet (docs/megatron.md)")

    def export_hf(self, folder: str | os.PathLike) -> Path:
        from ..native.loader import save_hf_folder
        from ...models import hf_config

        state = self.hf_state_dict()
        if dist.get_rank() == 0:
            save_hf_folder(state, hf_config(self.dims), folder)
        dist.barrier()
        return Path(folder)
