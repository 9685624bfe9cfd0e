"""Native train engine: an HF causal LM sharded with DTensor TP, EP-inside-TP and FSDP2 (FSDP2 only
where it is needed: DP > 1 or mixed precision; at DP1 fp32 the model is the plain HF module). The PPO
critic, :class:`~rlrecipes.engines.native.value.NativeValueEngine`, subclasses it in ``value.py``;
the registry builds it for the critic role (the package's ``CRITIC``), and this module never imports it.

Batches (one *micro-batch* is a mapping):

* ``input_ids [b, T]`` — left-padded prompt followed by the right-padded response; the last
  ``R`` positions are the response slots;
* ``attention_mask [b, T]`` — 1 on real tokens (prompt and response), 0 on padding;
* ``response_mask [b, R]`` (or ``responses [b, R]``) — fixes ``R``; the engine does not look
  at its values, the loss closure does.

Position ids are ``cumsum(attention_mask) - 1`` (left padding is skipped). The log-prob of the
response token at slot ``j`` is read from the logits at position ``T - R - 1 + j``; padded
response slots get a finite but meaningless value that the caller masks.

Gradient semantics: ``train_step`` back-propagates ``loss / len(micro_batches)`` per micro-batch
(``loss_scale="mean"``) or the loss as returned (``loss_scale="sum"``), then FSDP2 *averages*
gradients over the DP ranks. A loss closure that returns the mean loss of its micro-batch
therefore gives the gradient of the mean over all micro-batches of all DP ranks; for token-level
aggregation over the global batch, weight the loss inside the closure and use ``"sum"``.
"""
from __future__ import annotations

import contextlib
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from rlrecipes import device as devmod
from rlrecipes.core.mesh import build_mesh, world_layout
from rlrecipes.core.parallel import ParallelLayout
from rlrecipes.core.swap import SwappedStorages
from rlrecipes.engines import base
from rlrecipes.engines.base import LossFn, SeqBatch
from rlrecipes.engines.native import (CAPABILITIES, COMPILE_LAYERS, MOE_GROUPED_MM, SMALL_MODEL_BYTES,
                                      small_model)
from rlrecipes.engines.native import compiled
from rlrecipes.engines.native import parallel as par
from rlrecipes.engines.native import grads as grad_ops
from rlrecipes.engines.native import head as head_ops
from rlrecipes.engines.native import shards as shard_ops
from rlrecipes.engines.native.forward import TokenScores, response_len_of
from rlrecipes.engines.native.state import EngineState
from rlrecipes.engines.native import vision as vis
from rlrecipes.engines.native.batching import MeshRanks, micro_batches, packed_micro_batches, rows_to_samples
from rlrecipes.engines.native.loader import (HFFolderWriter, ModelSource, build_empty, build_model, materialize,
                                             source_folder)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """A torch.device from a device, a type name (``cpu``/``cuda``/``npu``/``auto``) or None (auto)."""
    if isinstance(device, torch.device):
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return devmod.torch_device(device, local_rank=local_rank)


def _resolve_dtype(dev: torch.device, dtype: str | torch.dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else devmod.train_dtype(dev, dtype)



class NativeTrainEngine(TokenScores, EngineState, MeshRanks, base.TrainEngine):
    """HF model + DTensor TP + EP (inside TP) + FSDP2 over a (dp, tp) DeviceMesh of the whole world,
    (dp, sp, tp) with Ulysses sequence parallelism.

    Args:
        model: ``ModelDims`` (smoke: built from ``hf_config(dims)``, seeded) or a local HF folder
            (config.json + safetensors).
        role: ``"actor"`` (trainable: AdamW, fp32 master weights) or ``"ref"`` (frozen, weights
            stored in the compute dtype, no optimizer).
        layout: the role's :class:`~rlrecipes.core.parallel.ParallelLayout` (its world is the process
            group's), or ``(tp, ep)``; ``dp = world // (tp * sp)``; ``ep`` must divide ``tp``.
        device: ``torch.device``, a type name or None (auto, ``LOCAL_RANK``-indexed).
        lr, weight_decay, betas, eps: AdamW settings.
        grad_clip: max global L2 norm of the gradients (``<= 0``: no clipping, the norm is still
            reported).
        seed: seeds the smoke model's init (same on every rank) and torch's RNG.
        dtype: ``"auto"`` (bf16 where ``device.supports_bf16``, fp32 on CPU), ``"bf16"``,
            ``"fp16"``, ``"fp32"`` or a torch.dtype: the compute dtype. Actor master weights,
            gradient reduction and optimizer state stay fp32 (FSDP2 mixed precision).
        fsdp: wrap with FSDP2; default: when the actor computes in low precision, or ``dp > 1``
            and the model is not small (``small_model_bytes``). ``False`` at ``dp > 1``: replicated.
        attn_implementation: HF attention backend (``"sdpa"`` or ``"eager"``).
        micro_batch_size: samples per forward/backward in :meth:`forward` / :meth:`train_step`.
        pad_token_id: token id written at padded positions (masked out; any id works).
        small_model_bytes: a model of at most this many parameter bytes is *small*
            (:data:`~rlrecipes.engines.native.SMALL_MODEL_BYTES`, 256 MiB; 0: nothing is). Small and
            in full precision at DP > 1 (``fsdp=None``): replicated, with one all-reduce of all
            gradients per step (DDP-style, exact to FSDP within fp32 rounding). Small under FSDP
            (low precision): every unit stays gathered through a whole :meth:`forward` /
            :meth:`train_micro_batches` call instead of being re-gathered per micro-batch and
            in backward, then reshards.
        lora: ``actor.lora`` (PEFT adapters trained, the base frozen; :mod:`.lora`), or None.
        sp: with a ``(tp, ep)`` layout, Ulysses sequence-parallel ranks per DP group (``layout.sp``,
            :mod:`.ulysses`): they hold the same samples, each runs ``1 / sp`` of every row.
        head_chunk_tokens: tokens per chunk of the LM head (:mod:`.head`; 0: the HF head's logits).
        moe_grouped_mm: MoE experts as grouped GEMMs (``torch._grouped_mm``) instead of a loop over the
            experts (:mod:`.experts`): transformers' ``grouped_mm`` experts at EP 1, :class:`.parallel.EPExperts`'
            under EP; the loop runs where the op cannot take the operands. Default
            :data:`~rlrecipes.engines.native.MOE_GROUPED_MM` (measured on the CPU; a GPU run of
            ``gpu_suite.py`` sweeps it).
        compile_layers: ``torch.compile`` each decoder layer after FSDP2 wrapping (:mod:`.compiled`):
            False, True (inductor) or a backend name; TP1 EP1 SP1 only. A device where the backend cannot
            generate code (no C++ compiler on the CPU, no Triton on CUDA) is an error at construction.
            Default :data:`~rlrecipes.engines.native.COMPILE_LAYERS`.
        fsdp_prefetch: under FSDP2, layers whose all-gathers each layer prefetches ahead in forward and
            backward (:func:`.parallel.set_layer_prefetch`); 0 (default): FSDP2's own overlap. The
            default stays 0 until a GPU measurement says otherwise (``gpu_suite.py`` sweeps it).
    """

    metric_prefix = "actor"
    capabilities = CAPABILITIES
    serves: tuple[str, ...] = ("actor", "ref")
    """The roles :meth:`create` builds with this class."""

    def __init__(self, model: ModelSource, *, role: str = "actor",
                 layout: ParallelLayout | tuple[int, int] = (1, 1),
                 device: torch.device | str | None = None, lr: float = 1e-6, weight_decay: float = 0.0,
                 grad_clip: float = 1.0, seed: int = 0, dtype: str | torch.dtype = "auto",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, fsdp: bool | None = None,
                 attn_implementation: str = "sdpa", micro_batch_size: int = 4, pad_token_id: int = 0,
                 max_tokens_per_micro_batch: int | None = None, recompute: bool = False,
                 offload_optimizer: bool = False, small_model_bytes: int = SMALL_MODEL_BYTES, lora: Any = None,
                 sp: int = 1, head_chunk_tokens: int = head_ops.DEFAULT_CHUNK_TOKENS,
                 moe_grouped_mm: bool = MOE_GROUPED_MM, freeze_vision_tower: bool = True, fsdp_prefetch: int = 0,
                 compile_layers: bool | str = COMPILE_LAYERS):
        if role not in self.serves:
            raise ValueError(f"role={role!r}: {type(self).__name__} builds {' or '.join(map(repr, self.serves))}"
                             + (" (the critic is NativeValueEngine)" if role == "critic" else ""))
        layout = world_layout(layout, role=role, sp=sp)  # a ParallelLayout, or (tp, ep) with sp
        tp, ep, sp = layout.tp, layout.ep, layout.sp
        self.compile_backend = compiled.backend_of(compile_layers)  # None: eager layers
        if self.compile_backend is not None and (tp > 1 or ep > 1 or int(sp) > 1):
            raise ValueError(f"{role}: compile_layers with TP{tp} EP{ep} SP{sp}: the native engine compiles the "
                             "decoder layers at TP1 EP1 SP1 (FSDP2 / data parallel) in this release; set "
                             "compile_layers=False or the layout to tp: 1, ep: 1, sp: 1")
        self.role, self.device, self.seed = role, resolve_device(device), seed
        self.trainable = role != "ref"
        self.compute_dtype = _resolve_dtype(self.device, dtype)
        if int(sp) > 1:
            if tp > 1 or ep > 1:
                raise ValueError(f"{role}: layout.sp={sp} with TP{tp} EP{ep}: the native engine runs Ulysses sequence "
                                 "parallelism at TP1 EP1 in this release; set tp: 1, ep: 1 or sp: 1")
            from . import ulysses

            attn_implementation = ulysses.register()  # attention over all-to-all head shards
        self.mesh = build_mesh(layout, self.device.type)
        devmod.set_device(self.device)
        torch.manual_seed(seed)
        param_dtype = torch.float32 if self.trainable else self.compute_dtype
        self._source_folder = source_folder(model)
        if self._source_folder is None:  # smoke dimensions: a tiny model, built whole and seeded
            hf_model, self.dims = build_model(model, dtype=param_dtype, seed=seed,
                                              attn_implementation=attn_implementation)
            hf_model = self._adapt_model(hf_model).to(self.device)
        else:  # a real checkpoint: empty (meta) build, sharded, then each rank reads only its boxes
            hf_model, self.dims = build_empty(self._source_folder, dtype=param_dtype,
                                              attn_implementation=attn_implementation)
            hf_model = self._adapt_model(hf_model)
        self.lora = lora if lora is not None and getattr(lora, "enabled", True) else None
        if self.lora is not None:
            if tp > 1 or ep > 1:
                raise ValueError(f"actor.lora with TP{tp} EP{ep}: the native engine trains LoRA adapters with "
                                 "FSDP2 / data parallelism only (PEFT's LoRA layers are not DTensor-sharded here)")
            from .lora import inject

            hf_model = inject(hf_model, self.lora)
        self._vision = vis.prepare(hf_model, freeze_tower=freeze_vision_tower and self.trainable)  # None: text only
        low_precision = self.compute_dtype != param_dtype
        small = small_model(sum(p.numel() * p.element_size() for p in hf_model.parameters()), small_model_bytes)
        grad_ranks = self.mesh.grad_size  # DP, and the SP ranks inside each DP group
        self.fsdp = bool(fsdp) if fsdp is not None else (low_precision or (grad_ranks > 1 and not small))
        self._replicated = not self.fsdp and grad_ranks > 1  # DP (x SP) copies: gradients all-reduced
        if low_precision and not self.fsdp:
            raise ValueError("mixed precision training needs FSDP2 (fsdp=True) in the native engine")
        if recompute:
            # per decoder layer, non-reentrant (composes with FSDP2's all-gather hooks)
            if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.x
                hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.recompute = bool(recompute)
        # under TP the actor's head keeps its vocabulary shard: log-probs are vocab-parallel, no rank
        # ever holds [tokens, V] logits
        self._vocab_parallel = self.mesh.tp > 1 and role != "critic"
        self.model = par.parallelize(hf_model, self.mesh, fsdp=self.fsdp,
                                     mp_dtype=self.compute_dtype if low_precision else None,
                                     replicate_head=role == "critic", vocab_parallel_head=self._vocab_parallel,
                                     moe_grouped_mm=moe_grouped_mm, fsdp_prefetch=fsdp_prefetch if self.fsdp else 0)
        if self.compile_backend is not None:  # after FSDP2: its hooks stay outside the compiled forward
            compiled.compile_layers(self.model, self.device, self.compile_backend)
        if self._vocab_parallel:
            self._vocab_start = self.mesh.tp_rank * -(-self.dims.vocab_size // self.mesh.tp)
        if self.mesh.sp > 1:  # every attention module learns its SP group (recompute in backward finds it)
            from . import ulysses

            ulysses.attach(self.model, self.mesh.sp_group, self.mesh.sp)
        # the LM head straight from hidden states, chunk_tokens at a time (head.py): no [tokens, V]
        # logits, forward or backward. Not the critic (a value head), not an untied vocab-parallel
        # head under FSDP (head_ops.unsupported says why); 0 turns it off
        self._head_chunk = int(head_chunk_tokens)
        self._chunk_head = (role != "critic" and self._head_chunk > 0
                            and head_ops.unsupported(self.model, vocab_parallel=self._vocab_parallel) is None)
        if self._source_folder is not None:
            named = shard_ops.named_tensors(self.model)
            if self.lora is not None:  # a LoRA layer's base weight is the checkpoint's weight
                from .lora import base_name

                named = ((base_name(n), t) for n, t in named)
            materialize(self.model, self.device, self._source_folder, local_box=shard_ops.local_box,
                        named_tensors=named, init_missing=self._init_missing)
        self.config = self.model.config
        self.optimizer = None
        if self.trainable:
            self.model.train()
            # LoRA: the frozen base holds no gradients and no optimizer state
            self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                               betas=betas, eps=eps, weight_decay=weight_decay)
        else:
            self.model.eval()
            self.model.requires_grad_(False)
        self.grad_clip = grad_clip
        self.step = 0
        self._offloaded: list | None = None
        self.micro_batch_size, self.pad_token_id = int(micro_batch_size), int(pad_token_id)
        self.max_tokens_per_micro_batch = int(max_tokens_per_micro_batch or 0)
        # flash-attention kernels take one packed row natively; dense masks (sdpa, eager) want short rows
        self._varlen_attention = str(attn_implementation).startswith("flash")  # (SP: a dict, no varlen kernel)
        self.offload_optimizer = bool(offload_optimizer)
        self._opt_parked: SwappedStorages | None = None
        self._tp_partial: list[torch.Tensor] | None = None  # q/k-norm weights whose grads sum over TP
        self._fsdp_units = [m for m in self.model.modules() if m is not self.model and hasattr(m, "reshard")] \
            if self.fsdp and small else []

    @classmethod
    def create(cls, spec: base.EngineSpec) -> "NativeTrainEngine":
        """The engine for ``spec.role``: this class builds the actor and the reference model,
        :class:`~rlrecipes.engines.native.value.NativeValueEngine` (the package's ``CRITIC``) the critic."""
        if spec.layout.pp != 1:
            raise ValueError(f"{spec.role}: the native engine has no pipeline parallelism (PP{spec.layout.pp})")
        if spec.role not in cls.serves:
            raise ValueError(f"{cls.__name__} builds the {' / '.join(cls.serves)} role, not {spec.role!r} "
                             "(the registry builds each role from the class its package names)")
        eng = cls(spec.model, role=spec.role, layout=spec.layout, device=spec.device, lr=spec.lr,
                  weight_decay=spec.weight_decay, grad_clip=spec.grad_clip, seed=spec.seed, dtype=spec.dtype,
                  micro_batch_size=spec.micro_batch_size, pad_token_id=spec.pad_token_id,
                  max_tokens_per_micro_batch=spec.max_tokens_per_micro_batch,
                  recompute=spec.recompute if spec.role != "ref" else False,
                  offload_optimizer=spec.offload_optimizer, lora=spec.lora if spec.role == "actor" else None,
                  freeze_vision_tower=spec.freeze_vision_tower)
        if spec.routing_replay and spec.role == "actor":
            if spec.layout.sp > 1:
                raise ValueError("routing replay with layout.sp > 1: the recorded experts are not split along the "
                                 "sequence in this release; set layout.sp: 1 or algorithm.routing_replay: false")
            eng.replay_routing()
        return eng

    def replay_routing(self) -> None:
        """Route each token to the experts the rollout recorded when a batch carries them (R3)."""
        from .routing import attach

        self.routing = attach(self.model)

    # ----------------------------------------------------------------------------- layout
    def param_specs(self) -> list:
        from rlrecipes.models import param_specs

        if self.lora is not None:  # only the adapters move to the rollout (its base is loaded once)
            from .lora import is_lora_name

            # (a parameter's shape is the whole tensor's, FSDP-sharded or not: no gather needed)
            return param_specs({n: t.shape for n, t in shard_ops.named_tensors(self.model) if is_lora_name(n)})
        return param_specs(self.dims)

    # ----------------------------------------------------------------------------- model hooks
    def _adapt_model(self, model: nn.Module) -> nn.Module:
        """Subclasses swap heads here (before sharding; ``model`` may be on the meta device)."""
        return model

    def _init_missing(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Full initial value of a parameter a checkpoint does not hold (None: it must be there):
        LoRA adapters start as PEFT starts them, the same on every rank."""
        if self.lora is not None:
            from .lora import init_adapter, is_lora_name

            if is_lora_name(name):
                return init_adapter(name, shape, seed=self.seed)
        return None

    def _micro_batches(self, batch: SeqBatch, training: bool = True) -> list[dict]:
        """Token-budget packed micro-batches when ``max_tokens_per_micro_batch`` is set, else padded
        groups of ``micro_batch_size``; the same count on every DP rank."""
        # the count is agreed over DP ranks only: TP peers hold the same batch (the data contract).
        # Replicated DP runs no collective in a forward: inference needs no agreement; training
        # keeps it, so "mean" loss scaling divides by the same count everywhere
        collective = self.mesh.grad_size > 1 and (training or not self._replicated)
        if self.max_tokens_per_micro_batch:
            return packed_micro_batches(batch, self.max_tokens_per_micro_batch, self.pad_token_id,
                                        varlen=self._varlen_attention, collective=collective, device=self.device,
                                        one_per_row=self.mesh.sp > 1, vision=self._vision)
        return micro_batches(batch, self.micro_batch_size, self.pad_token_id, collective=collective,
                             device=self.device, vision=self._vision)

    # ----------------------------------------------------------------------------- inference
    @torch.no_grad()
    def log_probs(self, batch: Mapping[str, Any], *, temperature: float = 1.0, with_entropy: bool = False,
                  micro_batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs ``[B, R]`` (fp32) of the response tokens, and entropy ``[B, R]`` or None.

        ``batch`` is a micro-batch mapping (see module docstring); ``micro_batch_size`` splits it.
        """
        self._set_training(False)
        batch = base.micro_batch_to(batch, self.device)
        B = batch["input_ids"].shape[0]
        mbs = micro_batch_size or B
        outs, ents = [], []
        for s in range(0, B, mbs):
            mb = {k: (v[s:s + mbs] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == B else v)
                  for k, v in batch.items()}
            logp, ent = self._forward(mb, temperature, with_entropy)
            outs.append(logp)
            ents.append(ent)
        self._set_training(self.trainable)
        return torch.cat(outs), (torch.cat(ents) if with_entropy else None)

    def forward(self, batch: SeqBatch, *, with_entropy: bool = False):
        """Interface forward: per-sample ``[R_i]`` log-probs (values for a critic) on the host."""
        if not len(batch):
            return [], ([] if with_entropy else None)
        outs: list = [None] * len(batch)
        ents: list = [None] * len(batch)
        self._set_training(False)
        with torch.no_grad(), self._gathered_once():
            for mb in self._micro_batches(batch, training=False):
                logp, ent = self._forward(mb, 1.0, with_entropy)
                rows_to_samples(outs, mb, logp, batch)
                rows_to_samples(ents, mb, ent, batch)
        if self.fsdp:
            # FSDP2 keeps the root unit (a tied embedding) gathered after forward, for a backward
            # that an inference pass never runs: give that memory back between stages
            self.model.reshard()
        self._set_training(self.trainable)
        return outs, (ents if with_entropy else None)

    @contextlib.contextmanager
    def _gathered_once(self):
        """Small models under FSDP (see ``small_model_bytes``): every unit stays gathered from its
        first all-gather to the end of the call (no re-gather per micro-batch or in backward; the
        gradient reduce-scatter still runs once, on the last micro-batch), then reshards."""
        units = self._fsdp_units
        if not units:
            yield
            return
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        try:
            yield
        finally:
            for m in units:
                m.set_reshard_after_forward(True, recurse=False)
                m.set_reshard_after_backward(True, recurse=False)
                m.reshard()

    def _set_training(self, mode: bool) -> None:
        """``model.train(mode)`` only when the mode changes (the call walks every module)."""
        if self.model.training != mode:
            self.model.train(mode)

    # ----------------------------------------------------------------------------- training
    def _params(self) -> list[torch.Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def train_step(self, batch: SeqBatch, loss_fn: LossFn, *, with_entropy: bool = False) -> dict:
        """Interface step: packed or padded micro-batches (see :meth:`_micro_batches`), the closure's
        losses summed (``loss_scale="sum"``, see the module docstring)."""
        mbs = self._micro_batches(batch)
        if not mbs:
            return {f"{self.metric_prefix}/skipped_step": 1.0}
        return self.train_micro_batches(mbs, loss_fn, with_entropy=with_entropy, loss_scale="sum")

    def train_micro_batches(self, micro_batches: Sequence[Mapping[str, Any]], loss_fn: LossFn, *,
                            temperature: float = 1.0, with_entropy: bool = False, loss_scale: str = "mean") -> dict:
        """Forward/backward every micro-batch, clip, AdamW step; returns metrics.

        ``loss_fn(logp [b, R], entropy [b, R] | None, micro_batch) -> (loss, metrics)``.
        Metrics: ``<role>/loss`` (mean over micro-batches), ``<role>/grad_norm`` (global, before
        clipping), ``<role>/lr``, ``<role>/skipped_step`` (1.0 when the loss or the grad norm was
        NaN/inf anywhere: the update is skipped on every rank) and the closure's metrics reduced
        over micro-batches (``base.reduce_closure_metric``: ``*_sum`` summed, ``*_max`` maxed, else mean).
        """
        if not self.trainable:
            raise RuntimeError(f"training on a {self.role!r} engine: only actor/critic engines train")
        if not micro_batches:
            raise ValueError("train_micro_batches: no micro-batches")
        if loss_scale not in ("mean", "sum"):
            raise ValueError(f"loss_scale={loss_scale!r}: expected 'mean' or 'sum'")
        self._set_training(True)
        self.optimizer.zero_grad(set_to_none=True)
        micro_batches = [base.micro_batch_to(mb, self.device) for mb in micro_batches]  # no-op when built here
        n = len(micro_batches)
        acc: dict[str, list[float]] = defaultdict(list)
        losses = []
        with self._gathered_once():
            for i, mb in enumerate(micro_batches):
                if self.fsdp:
                    self.model.set_requires_gradient_sync(i == n - 1)
                logp, ent = self._forward(mb, temperature, with_entropy)
                loss, metrics = loss_fn(logp, ent, mb)
                # SP: every rank of the group computes the whole loss, its gradients are its tokens'
                # share, and the gradient mean runs over DP x SP ranks: x sp makes it the SP sum
                ((loss / n if loss_scale == "mean" else loss) * self.mesh.sp).backward()
                losses.append(loss.detach().float())
                for k, v in (metrics or {}).items():
                    acc[k].append(float(v))
        params = self._params()
        losses_t = torch.stack(losses)  # [n]
        bad_here = (~torch.isfinite(losses_t).all()).double()
        if self._tp_partial is None:
            self._tp_partial = grad_ops.tp_partial_params(self.model, self.mesh)
        both = grad_ops.finish_gradients(params, self.mesh, replicated=self._replicated, bad=bad_here,
                                         device=self.device, tp_partial=self._tp_partial)
        # one host sync for the three numbers the step needs
        bad, norm, mean_loss = torch.stack([both[1].float(), both[0].sqrt().float(), losses_t.mean()]).tolist()
        skipped = bad > 0 or not math.isfinite(norm)
        if not skipped:
            if self.grad_clip and self.grad_clip > 0:
                coef = self.grad_clip / (norm + 1e-6)
                if coef < 1.0:
                    grad_ops.scale_grads_(params, coef)
            self._unpark_optimizer()
            self.optimizer.step()
            self._park_optimizer()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return base.step_metrics(self.metric_prefix, loss=mean_loss, grad_norm=norm,
                                 lr=self.optimizer.param_groups[0]["lr"], skipped=skipped, micro_batches=n,
                                 closure=acc)

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    # ----------------------------------------------------------------------------- weights
    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every parameter (and persistent buffer) in the TRAIN layout.

        TP shard for column/row/vocab params, full tensor for replicated ones, the EP block for
        experts; the FSDP (DP) dimension all-gathered. Collective: call on every rank.
        """
        shards = shard_ops.local_shards(self.model)
        if self.lora is not None:
            from .lora import is_lora_name

            return {n: t for n, t in shards.items() if is_lora_name(n)}
        return shards

    def base_forward(self, batch: SeqBatch, *, with_entropy: bool = False):
        """LoRA: :meth:`forward` of the base model (adapters off), the reference policy."""
        from .lora import adapters_off

        with adapters_off(self.model):
            return self.forward(batch, with_entropy=with_entropy)

    def weights_finite(self) -> bool:
        """Local check of this rank's shards (no gather)."""
        return all(bool(torch.isfinite(par._local(p.data)).all()) for p in self.model.parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded tensors on every rank (collective; small models and tests)."""
        return shard_ops.full_state_dict(self.model)

    def export_adapter(self, folder: str | os.PathLike) -> Path | None:
        """LoRA: the adapters as a PEFT adapter folder (rank 0 writes; all ranks call)."""
        if self.lora is None:
            return None
        from .lora import write_adapter_folder

        tensors = self.local_shards()  # collective: the FSDP dimension gathered
        if dist.get_rank() == 0:
            write_adapter_folder(folder, tensors, self.lora,
                                 str(self._source_folder) if self._source_folder is not None else None)
        dist.barrier()
        return Path(folder)

    def export_hf(self, folder: str | os.PathLike, *, dtype: torch.dtype | None = None,
                  max_shard_bytes: int = 4 << 30) -> Path:
        """Write the model as an HF folder, one parameter gathered at a time (all ranks call; rank 0
        writes, flushing a file every ``max_shard_bytes``): no rank ever holds the whole model."""
        from torch.distributed.tensor import DTensor

        from .lora import base_name, is_lora_name, merged

        writer = HFFolderWriter(folder, self.config, dtype=dtype, max_shard_bytes=max_shard_bytes) \
            if dist.get_rank() == 0 else None
        # LoRA: the merged model (base + adapters), under the base checkpoint's names
        with torch.no_grad(), merged(self.model, enabled=self.lora is not None):
            for name, t in shard_ops.named_tensors(self.model):
                if is_lora_name(name):
                    continue
                full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
                if writer is not None:
                    writer.add(base_name(name), full)
                del full
            if writer is not None:  # (inside: a buffered tensor may be a view of a merged weight)
                writer.close(tokenizer_from=self._source_folder)
        dist.barrier()
        return Path(folder)



__all__ = ["NativeTrainEngine", "resolve_device", "response_len_of"]
