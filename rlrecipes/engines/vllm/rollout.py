"""The vLLM rollout engine: ``vllm.LLM`` inside each workflow worker (vllm-ascend on Ascend).

One engine per worker process, built in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the
``external_launcher`` executor when the workflow's ``torch.distributed`` world is up: vLLM then
builds its TP groups out of that world (TP ranks are contiguous, ``dp_rank = rank // tp``), so
rollout TP > 1 runs across workers with no extra processes. Every rank of a TP group passes the
same seed and the same prompts; TP rank 0 is the data leader.

Weights: the engine starts from ``load_format="dummy"`` for a smoke model (the workflow reshards
before the first rollout) or the HF folder's safetensors. :meth:`update_weights` streams the
resharder's buckets (ROLLOUT layout) into ``model.load_weights`` through vLLM's in-place reload,
one bucket at a time; TP-sharded tensors of a bucket are gathered over the rollout TP group into
the checkpoint shape vLLM's weight loaders slice (peak extra: one bucket x tp). The prefix cache
is reset after every update.

Sleep/wake: ``LLM.sleep(level=1)`` frees the KV cache and offloads weights where the platform has
sleep mode (CUDA, the Ascend plugin); on CPU vLLM has none, so both are no-ops (logged once).
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from ... import device as devmod
from .. import base
from rlrecipes.models.sharding import TP_DIM_OF_KIND, checkpoint_items, kind_of

from . import CAPABILITIES

log = logging.getLogger(__name__)

def _write_smoke_folder(dims, dtype: str, rank: int) -> str:
    """A config-only HF folder for a smoke model (vLLM builds it with dummy weights)."""
    from rlrecipes.models import hf_config

    folder = Path(tempfile.mkdtemp(prefix=f"rlrecipes-vllm-r{rank}-"))
    cfg = hf_config(dims)
    cfg.torch_dtype = dtype
    cfg.save_pretrained(folder)
    return str(folder)


class VllmRolloutEngine(base.RolloutEngine):
    """``vllm.LLM`` behind the rollout interface; see the module docstring."""

    capabilities = CAPABILITIES

    def __init__(self, model, *, tp: int = 1, ep: int = 1, device: torch.device | None = None, seed: int = 0,
                 dtype: str = "auto", inference=None, max_model_len: int | None = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's per-request INFO lines drown the run's
        self.device = device or devmod.torch_device(devmod.resolve("auto"), int(os.environ.get("LOCAL_RANK", 0)))
        self.platform = devmod.inference_platform(self.device)
        if self.platform == "cpu":
            # KV cache space on CPU, GiB (vLLM's knob); the recipe's gpu_memory_utilization is for accelerators
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.tp, self.ep = int(tp), int(ep)
        if self.ep > 1 and self.ep != self.tp:
            raise ValueError(f"rollout ep={self.ep}: vLLM's expert parallelism spans its TP group, so ep must be 1 "
                             f"or equal tp ({self.tp})")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if self.world % self.tp:
            raise ValueError(f"rollout tp={self.tp} does not divide the world of {self.world} workers")
        self._dtype = devmod.train_dtype(self.device, dtype)
        torch_name = str(self._dtype).removeprefix("torch.")
        if isinstance(model, (str, os.PathLike)):
            folder, load_format = str(model), "auto"
            from transformers import AutoConfig

            hf_cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
        else:  # ModelDims of a smoke model
            folder, load_format = _write_smoke_folder(model, torch_name, self.rank), "dummy"
            hf_cfg = None
        if hf_cfg is None:
            self.dims = model
        else:
            from rlrecipes.models import dims_from_hf_config

            self.dims = dims_from_hf_config(hf_cfg)  # is_mla decides the vllm-ascend settings
        kwargs = dict(model=folder, dtype=torch_name, seed=int(seed), load_format=load_format,
                      skip_tokenizer_init=True, tensor_parallel_size=self.tp, enable_prefix_caching=True)
        if self.ep > 1:
            kwargs["enable_expert_parallel"] = True
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        if dist.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(self._engine_kwargs(inference))
        self.sleep_supported = bool(kwargs.get("enable_sleep_mode"))
        if not self.sleep_supported and self.rank == 0:
            log.info("vLLM on %s has no sleep mode: the rollout keeps its KV cache between steps", self.platform)
        self.llm = LLM(**kwargs)
        self._tp_group = self._make_tp_groups() if self.tp > 1 else None
        self._asleep = self._weights_awake = False

    def _engine_kwargs(self, inference) -> dict:
        """Engine arguments from ``rollout.inference`` (vllm-ascend's additional_config on NPU)."""
        if inference is None:
            return {"enforce_eager": True}
        kw: dict = {"enforce_eager": bool(inference.enforce_eager or not inference.graph_mode),
                    "max_num_seqs": int(inference.max_num_seqs)}
        if inference.max_num_batched_tokens:
            kw["max_num_batched_tokens"] = int(inference.max_num_batched_tokens)
        if self.platform == "cpu":
            kw["enforce_eager"] = True  # no graphs on the CPU backend
            return kw
        kw["gpu_memory_utilization"] = float(inference.gpu_memory_utilization)
        kw["enable_sleep_mode"] = True
        if self.platform == "ascend":
            from .settings import installed_vllm_ascend_version, render

            version = inference.vllm_ascend_version or installed_vllm_ascend_version()
            if version:
                rendered = render(inference, version, is_mla=self.dims.is_mla)
                kw.update(rendered.engine_kwargs)
                kw["additional_config"] = rendered.additional_config
                os.environ.update(rendered.env)
        return kw

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
        opts = spec.options or {}
        return cls(spec.model, tp=spec.tp, ep=spec.ep, device=spec.device, seed=spec.seed, dtype=spec.dtype,
                   inference=opts.get("inference"), max_model_len=opts.get("max_model_len"))

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

    @property
    def weight_dtype(self) -> torch.dtype:
        return self._dtype

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[torch.Tensor], params: base.SamplingParams, *, seed: int) -> base.RolloutOutput:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        if not prompts:
            return base.RolloutOutput([], [])
        group_seed = int(seed) + 1_000_003 * self.dp_rank  # TP peers share it; DP groups differ
        stop = [int(params.eos_token_id)] if params.eos_token_id is not None else None
        sp = [VSP(max_tokens=int(params.max_new_tokens), temperature=float(params.temperature),
                  top_p=float(params.top_p), top_k=int(params.top_k) if params.top_k and params.top_k > 0 else -1,
                  logprobs=0, seed=group_seed + i, stop_token_ids=stop, ignore_eos=False, detokenize=False)
              for i in range(len(prompts))]
        reqs = [TokensPrompt(prompt_token_ids=[int(t) for t in p.tolist()]) for p in prompts]
        outs = self.llm.generate(reqs, sp, use_tqdm=False)
        responses, log_probs = [], []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs or [])]
            responses.append(torch.tensor(ids, dtype=torch.long))
            log_probs.append(torch.tensor(lps, dtype=torch.float32))
        return base.RolloutOutput(responses, log_probs)

    # ------------------------------------------------------------------ weights
    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's ROLLOUT-layout shard -> the checkpoint-shaped tensor vLLM's loaders slice."""
        if self._tp_group is None:
            return t
        kind = kind_of(name)  # a row-parallel bias is "replicated"
        dim = 0 if kind == "expert" and self.ep > 1 else TP_DIM_OF_KIND.get(kind)
        if dim is None:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.tp)]
        dist.all_gather(parts, t, group=self._tp_group)
        return torch.cat(parts, dim=dim)

    def _stream(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in buckets:
            for name, t in bucket:
                # fused v5 experts -> per-expert checkpoint names, which every vLLM MoE loader reads
                yield from checkpoint_items(name, self._full(name, t).to(self._dtype))

    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> None:
        if self._asleep and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])  # weights back on device; the KV cache stays freed
            self._weights_awake = True
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._stream(buckets),
                                                          "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

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
