"""The two engine interfaces the workflow sees: a train engine and a rollout engine.

The workflow (``rlrecipes/workflow``) talks to engines only through this module and
``engines/registry.py``; it never imports a backend. A backend (``native``, ``vllm``,
``megatron``) lives in ``engines/<name>/`` and declares its :class:`Capabilities` in that
package's ``__init__`` without importing its heavy dependencies, so ``rlrecipes plan`` can check a
layout against an engine on a laptop that does not have the engine installed.

Data contract (engine-neutral). Samples travel as unpadded token sequences (:class:`SeqBatch`);
each engine forms its own micro-batches (padding, packing, pipeline micro-batches). Per-token
columns (``old_log_probs``, ``ref_log_probs``, ``values``, ``returns``, token-level
``advantages``) are 1-D tensors aligned with each response; per-sample columns (outcome
``advantages``) are one number per sample and are broadcast over the response by the engine.

Devices. A batch's tensors live where its producer left them: columns from the dock are on the host,
columns a forward pass left in the TensorCache are on the worker's device, so one :class:`SeqBatch`
may hold both. An engine moves them in one place: the function that lays a batch out into
micro-batches (``engines/native/batching.py``, which every engine here uses) brings the batch to the
host (:meth:`SeqBatch.to`), builds each micro-batch there (index arithmetic, padding and packing are
host work) and hands back every micro-batch on the engine's device (:func:`micro_batch_to`), one copy
per tensor. From there on everything the engine and the loss closure touch is on the engine's device,
and a buffer built inside the engine is built there (``device=``). An engine entry that takes
prebuilt micro-batches (the native ``train_micro_batches``, ``log_probs``) moves them with the same
function. What an engine returns to the workflow (``forward``'s per-sample rows, ``train_step``'s
numbers) is on the host. ``rlrecipes.device_strict`` runs a whole step on the host with the engine's
tensors on a device that is not the host, so a CPU test fails where a GPU would.

Loss contract. ``train_step(batch, loss_fn)`` calls ``loss_fn(out, entropy, mb)`` once per
micro-batch, where ``out`` is the per-token log-prob (actor) or value (critic) of the response
tokens, ``entropy`` is the per-token entropy or None, and ``mb`` maps ``response_mask`` and
every column of the batch to tensors of ``out``'s shape (a padded ``[b, R]`` block or a packed
``[1, tokens]`` row: the loss must only rely on the shapes agreeing). The closure returns this
micro-batch's share of the *global* loss (normalised with global token/sequence counts); the
engine back-propagates it as returned and then *averages* gradients over the data-parallel ranks
(FSDP2 and megatron DDP both average), so a closure that wants a global sum multiplies by the DP
size. Every DP rank runs the same number of micro-batches (the engine pads a short rank with
zero-weight micro-batches), so collectives stay in step.
"""
from __future__ import annotations

import abc
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Sequence

import torch

from .capabilities import Capabilities  # noqa: F401 (part of this interface: engines and plan import it here)
from ..core.parallel import ParallelLayout  # noqa: F401 (EngineSpec.layout; part of this interface)

LossFn = Callable[[torch.Tensor, Optional[torch.Tensor], Mapping[str, Any]], "tuple[torch.Tensor, dict]"]


# ---------------------------------------------------------------------------------------------
# engine-neutral data
# ---------------------------------------------------------------------------------------------
@dataclass
class SeqBatch:
    """Samples as unpadded sequences: prompt ids ``[P_i]`` and response ids ``[R_i]`` per sample.

    ``per_token[c][i]`` has shape ``[R_i]``; ``per_sample[c]`` has shape ``[n]``;
    ``routed_experts[i]`` (MoE routing replay, optional) has shape ``[P_i + R_i, moe_layers, k]``
    with ``-1`` where a token's routing was not recorded. ``images[i]`` (vision-language models,
    optional) is sample ``i``'s :class:`~rlrecipes.models.vision.VisionInput` or None: host tensors
    the workflow resolves from the sample's prompt (one object per prompt, shared by its samples and
    by every stage, never copied into the dock); the engine moves the pixels to its device.
    """

    prompts: list[torch.Tensor]
    responses: list[torch.Tensor]
    per_token: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)
    routed_experts: Optional[list[torch.Tensor]] = None
    images: Optional[list] = None

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, idx: Sequence[int]) -> "SeqBatch":
        sel = torch.tensor(list(idx), dtype=torch.long)
        return SeqBatch([self.prompts[i] for i in idx], [self.responses[i] for i in idx],
                        {c: [v[i] for i in idx] for c, v in self.per_token.items()},
                        {c: v[sel] for c, v in self.per_sample.items()},
                        [self.routed_experts[i] for i in idx] if self.routed_experts is not None else None,
                        [self.images[i] for i in idx] if self.images is not None else None)

    def to(self, device: torch.device | str) -> "SeqBatch":
        """Every tensor of the batch on ``device`` (``self`` when all are there already). A column whose
        rows all sit on one other device moves as one copy: concatenated there, split where it lands."""
        device = torch.device(device)
        if all(t.device == device for t in self._tensors()):
            return self
        return SeqBatch(_rows_to(self.prompts, device), _rows_to(self.responses, device),
                        {c: _rows_to(v, device) for c, v in self.per_token.items()},
                        {c: v.to(device) for c, v in self.per_sample.items()},
                        _rows_to(self.routed_experts, device) if self.routed_experts is not None else None,
                        self.images)  # pixels stay on the host until the engine's forward

    def _tensors(self):
        yield from self.prompts
        yield from self.responses
        for rows in self.per_token.values():
            yield from rows
        yield from self.per_sample.values()
        yield from self.routed_experts or ()

    def response_tokens(self) -> int:
        """Response tokens that count (the model's own: ``response_mask`` leaves out tool observations)."""
        mask = self.per_token.get("response_mask")
        if mask is not None:
            return sum(int(m.sum()) for m in mask)
        return sum(int(r.numel()) for r in self.responses)

    def prompt_tokens(self) -> int:
        return sum(int(p.numel()) for p in self.prompts)


def _rows_to(rows: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Rows (any shapes sharing their trailing dims) on ``device``: one concatenated copy when they all
    sit on one other device, else one copy per row that is elsewhere."""
    rows = list(rows)
    where = {t.device for t in rows}
    if where == {device} or not rows:
        return rows
    if len(where) > 1:
        return [t.to(device) for t in rows]
    flat = torch.cat([t.reshape(-1, *t.shape[1:]) if t.dim() else t.reshape(1) for t in rows]).to(device)
    return [piece.reshape(t.shape) for piece, t in
            zip(torch.split(flat, [t.shape[0] if t.dim() else 1 for t in rows]), rows)]


def micro_batch_to(mb: Mapping[str, Any], device: torch.device) -> dict:
    """A micro-batch with every tensor on ``device`` (other entries, such as ``sample_index``, as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}


@dataclass
class SamplingParams:
    """What one ``generate`` call samples with (from ``rollout.sampling`` and the tokenizer)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 or negative: no top-k restriction."""
    eos_token_id: Optional[int] = None
    pad_token_id: int = 0
    stop_token_ids: tuple[int, ...] = ()
    """More tokens that end a sequence (kept in the response, like EOS): the multi-turn agent loop
    pauses a sample at a tool-call token of formats that call without an end-of-turn token."""

    def ending_ids(self) -> list[int]:
        """EOS and the stop tokens, sorted: every token that ends a sequence (kept in the response)."""
        ids = {int(self.eos_token_id)} if self.eos_token_id is not None else set()
        return sorted(ids | {int(t) for t in self.stop_token_ids})


@dataclass
class RolloutOutput:
    """Per sample: response ids (1-D, unpadded, EOS included when emitted) and their log-probs."""

    responses: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    metrics: dict = field(default_factory=dict)
    routed_experts: Optional[list[torch.Tensor]] = None
    """MoE routing replay: per sample ``[P_i + R_i, moe_layers, k]`` experts the rollout used."""


@dataclass
class EngineSpec:
    """Everything a backend needs to build one role on one worker (from the resolved recipe)."""

    model: Any
    """``ModelDims`` (smoke: built from config, seeded) or a local HF folder path."""
    role: str
    """``actor``, ``ref``, ``critic`` (train engines) or ``rollout``."""
    layout: ParallelLayout = field(default_factory=lambda: ParallelLayout(world=0))
    """The role's parallel layout (``rlrecipes.recipe.roles.role_layout``: TP, PP, EP, SP, the layer
    split); the engine takes its world (and so DP) from its process group (``ParallelLayout.on``)."""
    device: Optional[torch.device] = None
    dtype: str = "auto"
    seed: int = 0
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 4
    """Samples per forward/backward (a token budget may replace it in engines that pack)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Token budget per micro-batch for engines that pack sequences (None: use micro_batch_size)."""
    recompute: bool = False
    """Train engines: recompute each layer's activations in backward (``actor.recompute``)."""
    offload_optimizer: bool = False
    """Train engines: keep the optimizer state in host memory between steps (``actor.offload_optimizer``)."""
    pad_token_id: int = 0
    """Token id written at padded positions (masked out; the tokenizer's pad id, else its EOS)."""
    routing_replay: bool = False
    """MoE routing replay (``algorithm.routing_replay``): a rollout engine records every token's
    experts, the actor's train engine routes each token to them (``Capabilities.routing_replay``)."""
    expert_tensor_parallel: Optional[int] = None
    """Train engines that split experts over TP as well (``Capabilities.expert_tensor_parallel``):
    the expert-TP size; None: the engine's default (TP)."""
    lora: Any = None
    """``actor.lora`` when enabled (actor: adapters trained, base frozen; rollout: the same adapters,
    loaded from the trainer each step); None: no adapters."""
    inference: Any = None
    """Rollout engines: the recipe's ``rollout.inference`` settings, for engines that render them
    (``Capabilities.inference_settings``); None: the engine's defaults."""
    max_model_len: Optional[int] = None
    """Rollout engines: the longest sequence (prompt + response) served; None: the engine's default
    (vLLM: the model's context length)."""
    freeze_vision_tower: bool = True
    """Vision-language actors: keep the vision tower (patch embedding and blocks) frozen; the merger
    trains (``actor.freeze_vision_tower``)."""
    vision: Any = None
    """Vision-language models: the processor settings every stage shares
    (:class:`~rlrecipes.models.vision.VisionSettings`, ``data.min_pixels`` / ``data.max_pixels``): a
    rollout engine that budgets its image tokens up front (vLLM's encoder cache) reads the pixel
    budget here; None: the model's defaults."""


class _Parallel(abc.ABC):
    """Where this rank sits in its engine's data-parallel layout."""

    @property
    @abc.abstractmethod
    def dp_rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def dp_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def is_data_leader(self) -> bool:
        """True on the one rank of each DP group that reads/writes the dock for the group."""

    @abc.abstractmethod
    def model_parallel_group(self) -> tuple[Any, int]:
        """``(process group, global rank of the data leader)`` of the ranks that must see the same
        batch (TP x PP peers), or ``(None, this rank's global rank)`` when the group is this rank alone."""


# ---------------------------------------------------------------------------------------------
# the interfaces
# ---------------------------------------------------------------------------------------------
class TrainEngine(_Parallel):
    """A trainable (actor, critic) or frozen (ref) model in the TRAIN layout."""

    capabilities: ClassVar[Capabilities]

    @classmethod
    @abc.abstractmethod
    def create(cls, spec: EngineSpec) -> "TrainEngine":
        """The engine for ``spec.role`` (``actor``, ``ref``, or ``critic`` for the class a package
        names in ``CRITIC``) on this worker; the registry builds engines only through this."""

    @abc.abstractmethod
    def forward(self, batch: SeqBatch, *, with_entropy: bool = False
                ) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
        """Per sample ``[R_i]`` log-probs of the response tokens (values for a critic), fp32 on the
        host, and the entropy likewise (or None). No gradient. Collective over model-parallel peers."""

    def base_forward(self, batch: SeqBatch, *, with_entropy: bool = False
                     ) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
        """:meth:`forward` of the frozen base with the LoRA adapters off: the reference policy of a
        LoRA actor (:class:`AdaptersOff`). Engines that declare ``Capabilities.lora`` implement it."""
        raise NotImplementedError(f"{type(self).__name__} trains no LoRA adapters (Capabilities.lora is False)")

    @abc.abstractmethod
    def train_step(self, batch: SeqBatch, loss_fn: LossFn, *, with_entropy: bool = False) -> dict:
        """Forward/backward over micro-batches of ``batch``, clip, one optimizer step.

        Returns ``<role>/loss``, ``<role>/grad_norm``, ``<role>/lr``, ``<role>/skipped_step`` (1.0
        when a non-finite loss or gradient skipped the update on every rank),
        ``<role>/micro_batches`` (how many ran on every rank) and the closure's metrics reduced by :func:`reduce_closure_metric`
        over those micro-batches. Collective on every rank, even one with no samples."""

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None: ...

    # ---- weights for the resharder
    @abc.abstractmethod
    def param_specs(self) -> list:
        """``core.resharder`` ParamSpecs of the weights :meth:`local_shards` yields (train layout)."""

    @abc.abstractmethod
    def local_shards(self) -> Mapping[str, torch.Tensor]:
        """This rank's shard of every weight in the TRAIN layout, named as in :meth:`param_specs`."""

    def reshard_group(self) -> Any:
        """The process group the resharder runs its collectives in (None: the default world)."""
        return None

    def weights_finite(self) -> bool:
        """True when every weight this rank holds is finite (the caller reduces over ranks).
        Checked before a checkpoint or an HF export, which never store nan/inf weights."""
        return all(bool(torch.isfinite(t).all()) for t in self.local_shards().values())

    # ---- memory, persistence, export
    @abc.abstractmethod
    def offload(self) -> None:
        """Move weights, grads and optimizer state to host memory (a no-op where host is the device)."""

    @abc.abstractmethod
    def onload(self) -> None: ...

    @abc.abstractmethod
    def save(self, path: str | os.PathLike) -> None:
        """Sharded checkpoint of weights and optimizer state (every rank writes its part)."""

    @abc.abstractmethod
    def load(self, path: str | os.PathLike) -> None: ...

    @abc.abstractmethod
    def export_hf(self, folder: str | os.PathLike) -> Path:
        """Write the model as an HF folder (safetensors + config) that transformers loads. Collective."""

    def export_adapter(self, folder: str | os.PathLike) -> Optional[Path]:
        """LoRA: write the adapters as a PEFT adapter folder (``adapter_config.json`` +
        ``adapter_model.safetensors``); None for an engine that trains the whole model. Collective."""
        return None


class RolloutEngine(_Parallel):
    """Generates responses in the ROLLOUT layout; its weights arrive from the resharder."""

    capabilities: ClassVar[Capabilities]

    @classmethod
    @abc.abstractmethod
    def create(cls, spec: EngineSpec) -> "RolloutEngine":
        """The rollout engine for ``spec`` on this worker; the registry builds engines only through this."""

    @property
    @abc.abstractmethod
    def weight_dtype(self) -> torch.dtype:
        """The dtype its weights are held in (the resharder sends this dtype)."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[torch.Tensor], params: SamplingParams, *, seed: int,
                 images: Optional[Sequence[Any]] = None) -> RolloutOutput:
        """Sample one response per prompt (1-D token tensors in, any lengths). The same ``seed``
        on the same weights gives the same responses. Collective over the rollout TP group.
        ``images[i]``: prompt ``i``'s :class:`~rlrecipes.models.vision.VisionInput` (or None) for a
        vision-language model; an engine that cannot take images raises."""

    def open_session(self, prompts: Sequence[torch.Tensor], params: SamplingParams, *, seed: int,
                     images: Optional[Sequence[Any]] = None) -> "TurnSession":
        """A multi-turn session over ``prompts``: the agent loop continues each conversation turn by
        turn (:class:`TurnSession`). The default re-sends every conversation whole at each turn
        (:class:`ReprefillSession`; vLLM's prefix cache makes that a cache hit); an engine that can
        keep each sample's KV cache across turns overrides this."""
        return ReprefillSession(self, prompts, params, seed=seed, images=images)

    @abc.abstractmethod
    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> None:
        """Load ``(name, tensor in ROLLOUT layout)`` buckets in place, one bucket at a time (never
        a second full copy); caches that depend on the weights (prefix cache) are invalidated."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Free the KV cache (and whatever the platform can release) until :meth:`wake`."""

    @abc.abstractmethod
    def wake(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# multi-turn sessions (the agent loop's view of a rollout engine)
# ---------------------------------------------------------------------------------------------
class TurnSession(abc.ABC):
    """A batch of conversations that a rollout engine continues turn by turn.

    Row ``i`` starts as ``prompts[i]``. Each :meth:`generate` call appends, for each row it names,
    the tokens given (the tool observation of the previous turn; empty for the first turn) and then
    samples that row's next segment, until EOS, a stop token or the row's token limit. Rows not
    named wait (their tool calls are still running). Log-probs are those of the temperature-scaled
    distribution, as in :meth:`RolloutEngine.generate`, each computed on the whole conversation so
    far (so the trainer, given prompt + every segment and observation, recomputes the same).
    """

    @abc.abstractmethod
    def generate(self, rows: Sequence[int], appended: Sequence[torch.Tensor],
                 max_new_tokens: Sequence[int]) -> RolloutOutput:
        """The next segment of each of ``rows`` (in that order), after appending ``appended[k]`` to
        row ``rows[k]``; at most ``max_new_tokens[k]`` tokens each."""

    def close(self) -> None:
        """Release what the session holds (KV cache)."""


class ReprefillSession(TurnSession):
    """Every turn re-sends each named conversation whole through ``engine.generate`` (one call per
    turn; a prefix-caching engine such as vLLM serves the repeated prefix from its cache). Each call
    is seeded from the session seed and the call's index, so a session is reproducible given the
    same order of calls."""

    def __init__(self, engine: RolloutEngine, prompts: Sequence[torch.Tensor], params: SamplingParams, *, seed: int,
                 images: Optional[Sequence[Any]] = None):
        self.engine, self.params, self.seed = engine, params, int(seed)
        self.images = list(images) if images is not None else None
        """Row ``i``'s images (a VL prompt's first turn): sent with the row's whole conversation each turn."""
        self.context = [p.reshape(-1).long() for p in prompts]
        self.calls = 0

    def generate(self, rows, appended, max_new_tokens) -> RolloutOutput:
        import dataclasses

        rows = list(rows)
        if not rows:
            return RolloutOutput([], [])
        for r, a in zip(rows, appended):
            if a is not None and a.numel():
                self.context[r] = torch.cat([self.context[r], a.reshape(-1).long()])
        limit = max(int(n) for n in max_new_tokens)
        params = dataclasses.replace(self.params, max_new_tokens=limit)
        # a hashed seed per call: the engine seeds request i with seed + i, so consecutive seeds
        # would hand request i of one call the seed of request i - 1 of the next
        digest = hashlib.sha256(f"{self.seed}/{self.calls}".encode()).digest()
        extra = {"images": [self.images[r] for r in rows]} if self.images is not None else {}
        out = self.engine.generate([self.context[r] for r in rows], params,
                                   seed=int.from_bytes(digest[:6], "little"), **extra)
        self.calls += 1
        responses, logps = [], []
        for r, n, resp, lp in zip(rows, max_new_tokens, out.responses, out.log_probs):
            resp, lp = resp[:int(n)], lp[:int(n)]  # each row's own limit (the call ran to the largest)
            self.context[r] = torch.cat([self.context[r], resp.long()])
            responses.append(resp)
            logps.append(lp)
        return RolloutOutput(responses, logps, out.metrics)


class AdaptersOff:
    """A LoRA actor seen as the reference model: every call goes to the actor, except ``forward``,
    which runs its base (``base_forward``: adapters off). No second model is built or held."""

    def __init__(self, actor: TrainEngine):
        self._actor = actor

    def __getattr__(self, name: str):
        return getattr(self._actor, name)

    def forward(self, batch: SeqBatch, *, with_entropy: bool = False):
        return self._actor.base_forward(batch, with_entropy=with_entropy)

    def offload(self) -> None:  # the actor's memory is the actor's to move
        pass

    def onload(self) -> None:
        pass


def reduce_closure_metric(key: str, values: Sequence[float]) -> float:
    """How a train engine reduces a loss closure's metric over its micro-batches: keys ending in
    ``_sum`` are summed, ``_max`` maxed, anything else averaged. (Across DP ranks the workflow
    reduces them the same way.)"""
    if key.endswith("_sum"):
        return float(sum(values))
    if key.endswith("_max"):
        return float(max(values))
    return float(sum(values) / len(values))


def step_metrics(prefix: str, *, loss: float, grad_norm: float, lr: float, skipped: bool, micro_batches: int,
                 closure: Mapping[str, Sequence[float]]) -> dict:
    """The metrics a train engine's ``train_step`` returns (see :meth:`TrainEngine.train_step`): its own
    under ``<prefix>/``, and the closure's reduced over micro-batches by :func:`reduce_closure_metric`."""
    out = {f"{prefix}/loss": float(loss), f"{prefix}/grad_norm": float(grad_norm), f"{prefix}/lr": lr,
           f"{prefix}/skipped_step": float(skipped), f"{prefix}/micro_batches": micro_batches}
    out.update({k: reduce_closure_metric(k, v) for k, v in closure.items()})
    return out


__all__ = ["micro_batch_to", "reduce_closure_metric", "step_metrics", "Capabilities", "EngineSpec", "LossFn", "RolloutEngine", "RolloutOutput", "SamplingParams", "SeqBatch",
           "TrainEngine", "TurnSession", "ReprefillSession"]
