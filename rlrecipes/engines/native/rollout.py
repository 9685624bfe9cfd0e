"""Native rollout engine: a lean batched sampler over an HF model with a pre-allocated KV cache.

The loop is one prefill over the prompt (``prefill=``: the fast decoder's own layer loop writing
straight into its K/V buffers, over the prompts packed into one row or the left-padded square
(``prefill_layout=``), or HF ``model.forward``), then one 1-token decode step per generated
token, plus the sampling arithmetic; none of ``generate()``'s logits processors, stopping criteria or
per-step input preparation. Decode steps (``decode=``):

* ``"fast"`` (default): :class:`~rlrecipes.engines.native.decode.FastDecoder` -- hand-written
  attention steps for GQA (Qwen2, Qwen3-MoE) and MLA (DeepSeek-V3) layers over the engine's own
  pre-allocated K/V tensors, calling the layers' projection / norm / MLP / MoE modules (so TP
  DTensor linears and ``EPExperts`` run as in ``forward``), rotary computed once per call, no
  per-step mask construction or cache bookkeeping; other layer types use ``"layers"``;
* ``"layers"``: the HF decoder layers called directly on the same K/V tensors (generic fallback);
* ``"hf"``: ``model.forward`` on an HF ``StaticCache`` / ``DynamicCache`` (the reference path).

Static / captured steps (``decode_graphs=``, the fast decoder when every layer has a hand-written
step): ``"auto"`` (default) runs the static decode step (``static_step.StaticStep``: inputs, outputs and
counters in buffers of a power-of-two batch-size bucket, attention over the whole K/V capacity
with a mask) and captures it once per bucket where the device has graphs
(``device.graph_capture_supported``: CUDA graphs, the NPU's graph mode); where it has none (the
CPU) ``"auto"`` is ``"off"``, since uncaptured the static step only adds its padding rows and
full-capacity attention; ``"eager"``: the static step, never captured (what the CPU tests compare
with ``"off"``: the same step a device captures); ``"off"``: the step shaped by the call's batch
and length (the path before static steps). ``self.decode_graphs`` says which runs: ``"captured"``,
``"static"`` or ``"off"`` (``"off"`` too for ``decode="layers"``/``"hf"`` and while routing is
recorded: the recording hooks see every padding row and would not run under a replayed graph).
Sampling stays outside the step, on the device, with no host sync per token.

Tokens are drawn by the exponential race ``argmax(p / Exp(1))``, which is what
``torch.multinomial(p, 1)`` computes (same tokens for the same generator state) without its
per-call validity check and host sync; with no EOS ids the loop has no host sync at all.

Sampling and log-probs: the log-prob returned for a token is
``log_softmax(logits / temperature)[token]``, the *temperature-scaled, untruncated* distribution
(what the trainer recomputes with the same temperature); top-k / top-p only restrict the set the
token is drawn from. ``temperature == 0`` is greedy and returns ``log_softmax(logits)``.

TP consistency: every TP rank of a rollout group draws with the same seed (``seed`` offset by the
rollout DP rank) and, with ``tp > 1``, the tokens of TP rank 0 are broadcast to its group, so the
group always continues the same sequences. Different DP groups sample different tokens.
"""
from __future__ import annotations

import functools
import time
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlrecipes import device as devmod
from rlrecipes.engines.native import parallel as par
from rlrecipes.engines.native import shards as shard_ops
from rlrecipes.engines import base
from rlrecipes.engines.base import RolloutOutput, SamplingParams
from rlrecipes.engines.native import CAPABILITIES, MOE_GROUPED_MM
from rlrecipes.engines.native.batching import MeshRanks
from rlrecipes.engines.native import vision as vis
from rlrecipes.engines.native.decode import FastDecoder, supports_fast_decode
from rlrecipes.engines.native.prefill import PREFILL_LAYOUTS
from rlrecipes.engines.native.loader import ModelSource, build_model
from rlrecipes.core.mesh import build_mesh, world_layout
from rlrecipes.core.parallel import ParallelLayout
from rlrecipes.core.swap import SwappedStorages
from rlrecipes.engines.native.train import _resolve_dtype, resolve_device


#: the fast prefill's default layout (``prefill.py``): packed, chosen by the CPU measurement of
#: ``benchmarks/prefill_packed.py`` (docs/engines.md); on GPUs / NPUs it is not yet measured
DEFAULT_PREFILL_LAYOUT = "packed"


def left_pad(prompts: Sequence[torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, P], mask [B, P])`` with prompts right-aligned (left padding)."""
    if not len(prompts):
        raise ValueError("generate: no prompts")
    lens = [int(p.numel()) for p in prompts]
    if min(lens) == 0:
        raise ValueError("generate: empty prompt at index %d" % lens.index(0))
    P = max(lens)
    flat = [p.reshape(-1).long() for p in prompts]
    if min(lens) == P:  # nothing to pad
        ids = torch.stack(flat)  # [B, P]
        return ids, torch.ones_like(ids)
    ids = torch.nn.utils.rnn.pad_sequence(flat, batch_first=True, padding_value=pad_token_id,
                                          padding_side="left")  # [B, P]
    mask = (torch.arange(P) >= P - torch.tensor(lens)[:, None]).long()  # [B, P]
    return ids, mask


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of ``probs [B, V]``: ``argmax(probs / Exp(1) noise)`` (exponential race).

    This is what ``torch.multinomial(probs, 1, generator=g)`` computes internally (same tokens for
    the same generator state), minus its validity checks, which cost a host sync every step.
    """
    q = torch.empty_like(probs).exponential_(1, generator=generator)  # [B, V]
    return (probs / q).argmax(-1)


def sample_next(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None, banned: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. ``logits [B, V]`` -> ``(tokens [B], logp [B])`` (see module docstring).
    ``banned``: ids never drawn (a VL model's image token), filtered like top-k: the log-prob stays
    that of the whole distribution, the one the trainer computes."""
    logits = logits.float()
    if banned:
        keep = logits
        logits = logits.clone()
        logits[:, list(banned)] = float("-inf")
        if temperature <= 0:
            tok = logits.argmax(-1)
            return tok, F.log_softmax(keep, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
        scaled = keep / temperature if temperature != 1.0 else keep
        tok, _ = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        return tok, F.log_softmax(scaled, dim=-1).gather(-1, tok[:, None]).squeeze(-1)
    if temperature <= 0:
        logp_all = F.log_softmax(logits, dim=-1)  # [B, V]
        tok = logits.argmax(-1)  # [B]
        return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)
    scaled = logits / temperature if temperature != 1.0 else logits  # [B, V]
    logp_all = F.log_softmax(scaled, dim=-1)  # [B, V]
    filtered = scaled
    if top_k and 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [B, 1]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)  # [B, V]
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.empty_like(filtered).scatter_(-1, order, sorted_logits)
    probs = filtered.softmax(-1)  # [B, V]
    tok = _draw(probs, generator)  # [B]
    return tok, logp_all.gather(-1, tok[:, None]).squeeze(-1)


class NativeRolloutEngine(MeshRanks, base.RolloutEngine):
    """Batched KV-cache sampler with its own (tp, ep) layout, ``dp = world // tp``, pp = 1.

    Args:
        model: ``ModelDims`` (smoke, built from config with ``seed``) or a local HF folder.
        layout: the rollout's :class:`~rlrecipes.core.parallel.ParallelLayout` (its world is the process
            group's), or ``(tp, ep)``; ``ep`` must divide ``tp`` in the native engine.
        device: ``torch.device``, a type name or None (auto, ``LOCAL_RANK``-indexed).
        seed: sampling seed; TP ranks of one rollout group share it, DP groups offset it.
        dtype: ``"auto"`` (bf16 on accelerators, fp32 on CPU), ``"bf16"``, ``"fp32"``... or a dtype.
        cache: ``"static"`` (K/V pre-allocated and kept across calls of the same batch shape, or of
            the same bucket and capacity under static decode steps) or
            ``"dynamic"`` (allocated per call and released at its end; with ``decode="hf"``: HF
            DynamicCache, grows by concatenation).
        attn_implementation: HF attention backend (prefill and ``decode="hf"``/``"layers"``).
        decode: ``"fast"`` (default), ``"layers"`` or ``"hf"``; see the module docstring.
            ``self.decode_path`` says which one runs (models without ``model.model.layers`` /
            ``rotary_emb`` or with sliding-window layers always run ``"hf"``).
        decode_graphs: ``"auto"`` (default), ``"eager"`` or ``"off"``: static / captured decode steps,
            see the module docstring (an MoE model is never captured: its routing syncs with the
            host); ``create`` passes ``"off"`` for a recipe's ``rollout.inference.enforce_eager``.
        prefill: ``"fast"`` (default): :meth:`FastDecoder.prefill` -- the prompt goes through the same
            hand-written attention (causal + left-padding mask) as the fast decode steps, writing
            K/V straight into the engine's buffers; ``"hf"``: ``model.forward`` on a DynamicCache
            copied into the buffers. ``self.prefill_path`` says which one runs (``"hf"`` whenever
            the decode path is not ``"fast"`` or a layer has no hand-written step).
        moe_grouped_mm: MoE experts as grouped GEMMs, else a loop over the experts, in prefill and decode
            (the train engine's option of the same name, :mod:`.experts`; default
            :data:`~rlrecipes.engines.native.MOE_GROUPED_MM`).
        prefill_layout: the fast prefill's layout, ``"packed"`` (default, :data:`DEFAULT_PREFILL_LAYOUT`):
            the prompts concatenated into one row, attention restricted to each prompt (FlashAttention's
            varlen kernel on CUDA, ``npu_fusion_attention`` TND on Ascend, one SDPA per prompt on the
            host; ``engines/native/prefill.py``), or ``"padded"``: the left-padded ``[B, P]`` square.
            The K/V land in the same buffer columns either way. ``self.prefill_layout`` says which one
            runs (``"padded"`` for the HF prefill).

    Weights arrive from the resharder through :meth:`load_shards` in the ROLLOUT layout
    (docs/conventions.md slices for this rank); :meth:`shard_shapes` says what each rank expects.
    """

    capabilities = CAPABILITIES

    def __init__(self, model: ModelSource, *, layout: ParallelLayout | tuple[int, int] = (1, 1),
                 device: torch.device | str | None = None, seed: int = 0, dtype: str | torch.dtype = "auto",
                 cache: str = "static", attn_implementation: str = "sdpa", decode: str = "fast",
                 prefill: str = "fast", lora=None, decode_graphs: str = "auto",
                 moe_grouped_mm: bool = MOE_GROUPED_MM, prefill_layout: str | None = None):
        if cache not in ("static", "dynamic"):
            raise ValueError(f"cache={cache!r}: expected 'static' or 'dynamic'")
        if decode not in ("fast", "layers", "hf"):
            raise ValueError(f"decode={decode!r}: expected 'fast', 'layers' or 'hf'")
        if prefill not in ("fast", "hf"):
            raise ValueError(f"prefill={prefill!r}: expected 'fast' or 'hf'")
        prefill_layout = DEFAULT_PREFILL_LAYOUT if prefill_layout is None else prefill_layout
        if prefill_layout not in PREFILL_LAYOUTS:
            raise ValueError(f"prefill_layout={prefill_layout!r}: expected one of {PREFILL_LAYOUTS}")
        if decode_graphs not in ("auto", "eager", "off"):
            raise ValueError(f"decode_graphs={decode_graphs!r}: expected 'auto', 'eager' or 'off'")
        layout = world_layout(layout, role="rollout")  # a ParallelLayout, or (tp, ep)
        tp, ep = layout.tp, layout.ep
        self.device = resolve_device(device)
        self.dtype = _resolve_dtype(self.device, dtype)
        self.mesh = build_mesh(layout, self.device.type)
        devmod.set_device(self.device)
        hf_model, self.dims = build_model(model, dtype=self.dtype, seed=seed, attn_implementation=attn_implementation)
        if lora is not None:  # the same adapters as the actor's; only they arrive each step
            if tp > 1 or ep > 1:
                raise ValueError(f"rollout with LoRA adapters and TP{tp} EP{ep}: the native sampler applies "
                                 "adapters on unsharded layers only; set rollout.layout tp: 1, ep: 1")
            from .lora import inject

            hf_model = inject(hf_model, lora)
        hf_model.to(self.device)
        self.model = par.parallelize(hf_model, self.mesh, fsdp=False, moe_grouped_mm=moe_grouped_mm)
        self.model.eval()
        self.model.requires_grad_(False)
        self.config = self.model.config
        self.cache_kind = cache
        self.seed = seed
        self.generator = devmod.generator(self.device)
        self.generator.manual_seed(self._group_seed(seed))
        self._cache = None
        self._cache_key = None
        self._sleeping_weights: SwappedStorages | None = None
        self._tp_group = self.mesh.tp_mesh.get_group() if self.mesh.tp > 1 else None
        self._tp_src = dist.get_global_rank(self._tp_group, 0) if self._tp_group is not None else None
        self._vision = vis.vision_spec(self.model)  # a VL model: HF forward with pixels + M-RoPE (vision.py)
        # "auto": the static step where it is captured; on a device without graphs (the CPU) it only
        # costs its padding rows and full-capacity attention (dense smoke decode 10-22 % slower)
        # not an MoE model: its expert routing syncs with the host (HF's experts loop, EPExperts' splits),
        # which no capture survives; a capture that fails is not left to torch to recover from
        layers = getattr(getattr(self.model, "model", self.model), "layers", None) or []
        moe = any(hasattr(getattr(layer, "mlp", None), "experts") for layer in layers)
        capture = decode_graphs == "auto" and devmod.graph_capture_supported(self.device) and not moe
        self._fast = (FastDecoder(self.model, mode=decode, static=capture or decode_graphs == "eager",
                                  capture=capture, prefill_layout=prefill_layout)
                      if decode != "hf" and supports_fast_decode(self.model) else None)
        self.decode_path = decode if self._fast is not None else "hf"
        self.prefill_path = ("fast" if prefill == "fast" and self._fast is not None and self._fast.fast_prefill
                             else "hf")

    @property
    def decode_graphs(self) -> str:
        """Which decode step runs: ``"captured"`` (replayed device graphs), ``"static"`` (the same static
        step, eagerly) or ``"off"`` (the step shaped by each call)."""
        fast = self._fast
        if fast is None or not fast.static:
            return "off"
        return "captured" if fast.capture else "static"

    @property
    def prefill_layout(self) -> str:
        """The fast prefill's layout (``"packed"`` / ``"padded"``); ``"padded"`` for the HF prefill."""
        return self._fast.prefill_layout if self.prefill_path == "fast" else "padded"

    @prefill_layout.setter
    def prefill_layout(self, layout: str) -> None:
        """Switch the fast prefill's layout between calls (the benchmarks compare both on one engine)."""
        if layout not in PREFILL_LAYOUTS:
            raise ValueError(f"prefill_layout={layout!r}: expected one of {PREFILL_LAYOUTS}")
        if self._fast is not None:
            self._fast.prefill_layout = layout

    @classmethod
    def create(cls, spec: base.EngineSpec) -> "NativeRolloutEngine":
        eager = bool(getattr(spec.inference, "enforce_eager", False))  # the recipe's switch off graphs
        eng = cls(spec.model, layout=spec.layout, device=spec.device, seed=spec.seed, dtype=spec.dtype,
                  lora=spec.lora, decode_graphs="off" if eager else "auto")
        if spec.routing_replay:
            eng.record_routing()
        return eng

    def record_routing(self) -> None:
        """Record every token's routed experts (MoE routing replay); see ``routing.py``."""
        from .routing import attach

        self.routing = attach(self.model)
        if self._fast is not None:  # the hooks record per call: padding rows, and nothing under a replay
            self._fast.static = self._fast.capture = False

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.dtype

    def _group_seed(self, seed: int) -> int:
        return int(seed) + 1_000_003 * self.mesh.dp_rank

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(self._group_seed(seed))

    # ----------------------------------------------------------------------------- weights
    def _tensors(self) -> dict[str, torch.Tensor]:
        return dict(shard_ops.named_tensors(self.model))

    def shard_shapes(self) -> dict[str, tuple[int, ...]]:
        """Local (rollout-layout) shape of every parameter / persistent buffer on this rank."""
        return {n: tuple(par._local(t).shape) for n, t in self._tensors().items()}

    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's rollout-layout tensors (views, not copies)."""
        return {n: par._local(t.data if hasattr(t, "data") else t) for n, t in self._tensors().items()}

    @torch.no_grad()
    def load_shards(self, shards: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(name, local tensor in ROLLOUT layout)`` pairs into the weights in place.

        Returns how many tensors were copied; unknown names or wrong shapes raise.
        """
        targets = self._tensors()
        n = 0
        for name, value in shards:
            if name not in targets:
                raise KeyError(f"load_shards: {name!r} is not a parameter of the rollout model "
                               f"({type(self.model).__name__})")
            shard_ops.copy_shard_(targets[name], value, name)
            n += 1
        return n

    def update_weights(self, buckets) -> None:
        for bucket in buckets:
            self.load_shards(bucket)

    # ----------------------------------------------------------------------------- memory
    def sleep(self, *, weights: bool = False) -> None:
        """Release the KV cache (and, with ``weights=True``, swap the weights to host)."""
        self._cache, self._cache_key = None, None
        if self._fast is not None:
            self._fast.release()
        if weights and self._sleeping_weights is None:
            self._sleeping_weights = SwappedStorages((t for t in self._tensors().values()), self.device)
        devmod.empty_cache(self.device)

    def wake(self) -> None:
        """Take the weights back (the KV cache is re-allocated by the next ``generate``)."""
        if self._sleeping_weights is not None:
            self._sleeping_weights.restore()
            self._sleeping_weights = None

    # ----------------------------------------------------------------------------- sampling
    def _new_cache(self, batch: int, max_len: int):
        from transformers import DynamicCache, StaticCache

        if self.cache_kind == "dynamic":
            return DynamicCache(config=self.config)
        key = (batch, max_len)
        if self._cache is not None and self._cache_key == key:
            self._cache.reset()
            return self._cache
        self._cache = StaticCache(config=self.config, max_cache_len=max_len)
        self._cache_key = key
        return self._cache

    def _prefill_fast(self, ids, pmask, pos, max_new_tokens, lengths=None):
        """:class:`FastDecoder` prefill (K/V written straight into its buffers) and decode steps.

        Falls back to an HF forward over the prompt into a ``DynamicCache``, copied into the
        buffers, when the fast prefill does not apply (``prefill="hf"``, ``decode="layers"``,
        layers without a hand-written step). ``lengths``: the prompts' lengths (else read from ``pmask``).
        """
        from transformers import DynamicCache

        if self.prefill_path == "fast":
            logits = self._fast.prefill(ids, pmask, pos, capacity=ids.shape[1] + max_new_tokens,
                                        steps=max_new_tokens, lengths=lengths)  # [B, V]
            return logits, (self._fast.step if max_new_tokens > 1 else None)
        cache = DynamicCache(config=self.config)
        logits = self.model(input_ids=ids, attention_mask=pmask, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
        if max_new_tokens == 1:  # the prefill's logits give the only token: no decode step
            return logits, None
        self._fast.begin(cache, capacity=ids.shape[1] + max_new_tokens, first_pos=pos[:, -1:] + 1,
                         steps=max_new_tokens, prompt_mask=pmask, like=logits)
        return logits, self._fast.step

    def _prefill_hf(self, ids, pmask, pos, max_new_tokens):
        """Reference path: every step is a ``model.forward`` on an HF Static/DynamicCache."""
        B, P = ids.shape
        L = P + max_new_tokens
        static = self.cache_kind == "static"
        cache = self._new_cache(B, L)
        mask = torch.zeros((B, L), dtype=torch.long, device=ids.device)  # [B, L]
        mask[:, :P] = pmask
        logits = self.model(input_ids=ids, attention_mask=mask if static else pmask, position_ids=pos,
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
        first = pos[:, -1:] + 1  # [B, 1]

        def step(tok, t):
            mask[:, P + t] = 1
            return self.model(input_ids=tok[:, None], attention_mask=mask if static else mask[:, :P + t + 1],
                              position_ids=first + t, past_key_values=cache, use_cache=True).logits[:, -1]

        return logits, step

    def _prefill_vision(self, ids, pmask, prompts, images, max_new_tokens):
        """A VL model: ``model.forward`` over the prompts with their pixels and ``[3, B, P]`` M-RoPE
        positions into a DynamicCache, then one token per step at position ``next + t`` on all three
        axes (``vision.prefill_positions``), the positions the train-side forward computes."""
        from transformers import DynamicCache

        B, P = ids.shape
        pos, nxt = vis.prefill_positions(self._vision, prompts, images, P)
        pos, nxt = pos.to(ids.device), nxt.to(ids.device)  # [3, B, P], [B]
        cache = DynamicCache(config=self.config)
        mask = torch.zeros((B, P + max_new_tokens), dtype=torch.long, device=ids.device)  # [B, L]
        mask[:, :P] = pmask
        logits = self.model(input_ids=ids, attention_mask=pmask, position_ids=pos, cache=cache,
                            use_cache=True, logits_to_keep=1,
                            **vis.image_inputs(images, ids.device, self.dtype)).logits[:, -1]  # [B, V]

        def step(tok, t):
            mask[:, P + t] = 1
            p = (nxt + t)[None, :, None].expand(3, -1, 1)  # [3, B, 1]
            return self.model(input_ids=tok[:, None], attention_mask=mask[:, :P + t + 1], position_ids=p,
                              cache=cache, use_cache=True).logits[:, -1]

        return logits, step

    def open_session(self, prompts: Sequence[torch.Tensor], params: SamplingParams, *, seed: int,
                     images: Sequence | None = None) -> base.TurnSession:
        """Multi-turn: a :class:`~rlrecipes.engines.native.session.KVSession` that keeps every
        sample's KV cache across turns (fast prefill path); otherwise the base re-prefilling session."""
        if self._fast is None or self.prefill_path != "fast":
            return super().open_session(prompts, params, seed=seed, images=images)  # a VL model: re-prefilled
        from .session import KVSession

        return KVSession(self, prompts, params, seed=seed, stop_ids=params.ending_ids(), sample_next=sample_next)

    @torch.no_grad()
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, *, seed: int,
                 images: Sequence | None = None) -> RolloutOutput:
        if not prompts:  # a DP rank with no share this round (its TP peers have none either)
            return RolloutOutput([], [])
        return self.sample(prompts, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                           top_p=params.top_p, top_k=max(params.top_k, 0),
                           eos_token_id=params.ending_ids(), pad_token_id=params.pad_token_id, seed=seed,
                           images=images)

    def sample(self, prompts: Sequence[torch.Tensor], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int = 0, seed: int | None = None, images: Sequence | None = None) -> RolloutOutput:
        """Sample up to ``max_new_tokens`` per prompt (list of 1-D token tensors, any lengths).
        ``images[i]``: prompt ``i``'s ``VisionInput`` (or None), for a vision-language model.

        Stops a sequence at its first EOS (kept) and the batch when all stopped. ``seed`` reseeds
        the generator first (reproducible calls); otherwise the engine's stream continues.
        """
        if self._sleeping_weights is not None:
            raise RuntimeError("sample() on a sleeping engine: call wake() first")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if seed is not None:
            self.reseed(seed)
        dev = self.device
        ids, pmask = left_pad(prompts, pad_token_id)
        ids, pmask = ids.to(dev), pmask.to(dev)  # [B, P]
        B, P = ids.shape
        eos = torch.tensor(sorted({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or [])),
                           dtype=torch.long, device=dev)  # [n_eos]
        pos = (pmask.cumsum(-1) - 1).clamp_(min=0)  # [B, P]
        out_tok = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=dev)  # [B, N]
        out_lp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=dev)  # [B, N]
        finished = torch.zeros(B, dtype=torch.bool, device=dev)  # [B]
        lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=dev)  # [B]
        check_every = 8 if devmod.is_accelerator(dev.type) else 1
        has_eos = bool(eos.numel())
        t0 = time.perf_counter()
        if images is not None and self._vision is None and any(v is not None for v in images):
            raise ValueError(f"images given to a text-only model ({type(self.model).__name__}); train a "
                             "vision-language family (model.family: qwen2_5_vl)")
        prefill = (functools.partial(self._prefill_fast, lengths=[int(p.numel()) for p in prompts])
                   if self._fast is not None else self._prefill_hf)
        banned = self._vision.special_ids if self._vision is not None else ()
        if self._vision is not None:
            prefill = lambda i, m, _p, n: self._prefill_vision(i, m, prompts, images or [None] * B, n)  # noqa: E731
        routing = getattr(self, "routing", None)
        if routing is not None:
            routing.start_recording()
        logits, step = prefill(ids, pmask, pos, max_new_tokens)  # [B, V], step(tok [B], t) -> [B, V]
        steps = 0
        toks: list[torch.Tensor] = []
        lps: list[torch.Tensor] = []
        for t in range(max_new_tokens):
            tok, lp = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                  generator=self.generator, banned=banned)  # [B], [B]
            if self._tp_group is not None:
                dist.broadcast(tok, src=self._tp_src, group=self._tp_group)
            steps = t + 1
            if has_eos:
                tok = tok.masked_fill(finished, pad_token_id)
                out_tok[:, t] = tok
                out_lp[:, t] = lp.masked_fill(finished, 0.0)
                hit = torch.isin(tok, eos) & ~finished  # [B]
                lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
                finished |= hit
                if (t + 1) % check_every == 0 and bool(finished.all()):
                    break
            else:  # no EOS: nothing to mask, stack once at the end
                toks.append(tok)
                lps.append(lp)
            if t + 1 == max_new_tokens:
                break
            logits = step(tok, t)
        if self._fast is not None and self.cache_kind == "dynamic":
            self._fast.release()
        if toks:
            out_tok[:, :len(toks)] = torch.stack(toks, 1)
            out_lp[:, :len(lps)] = torch.stack(lps, 1)
        devmod.synchronize(dev)
        dt = time.perf_counter() - t0
        lengths = torch.minimum(lengths, torch.full_like(lengths, steps)).cpu()
        out_tok, out_lp = out_tok.cpu(), out_lp.cpu()
        # per-row views of the two fresh [B, N] tensors (no per-row copies)
        n_of = lengths.tolist()
        responses = [row[:n] for row, n in zip(out_tok.unbind(0), n_of)]
        logps = [row[:n] for row, n in zip(out_lp.unbind(0), n_of)]
        gen = int(lengths.sum())
        routed = None
        if routing is not None:
            from .routing import per_sample_routing

            routed = per_sample_routing(routing.recorded(), [int(p.numel()) for p in prompts], P, n_of)
            routing.stop()
        return RolloutOutput(responses, logps, {"rollout/tokens": gen, "rollout/seconds": dt,
                                                "rollout/tokens_per_s": gen / max(dt, 1e-9),
                                                "rollout/steps": steps}, routed)


__all__ = ["DEFAULT_PREFILL_LAYOUT", "NativeRolloutEngine", "left_pad", "sample_next"]
