"""Build a megatron-core ``GPTModel`` for a model's dims (imports megatron-core; see convert.py for
the pure translation). Parallel state must be initialised first
(``megatron.core.parallel_state.initialize_model_parallel``)."""
from __future__ import annotations

from typing import Mapping

import torch

from ...models import ModelDims
from .convert import gpt_model_kwargs, hf_to_megatron, layer_spec_kwargs, rope_theta, transformer_config


def build_gpt(dims: ModelDims, *, hf_config=None, params_dtype: torch.dtype = torch.float32,
              cpu_init: bool = False, pre_process: bool = True, post_process: bool = True,
              vocab_size: int | None = None, **parallel):
    """``GPTModel`` with megatron's local (no TransformerEngine) layer spec. ``hf_config``: the HF
    config (object or ``config.json`` dict) for RoPE, norm epsilon and routing. ``parallel``: extra
    ``TransformerConfig`` fields (tensor_model_parallel_size, pipeline_model_parallel_size,
    expert_model_parallel_size, recompute_granularity, ...). ``cpu_init``: build on the host
    (``use_cpu_initialization``), else on the current accelerator. ``vocab_size``: the (TP-padded)
    vocabulary of the embedding and output layers (``shard.padded_vocab``; the model's by default)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    hf = dict(hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config or {})
    theta = rope_theta(hf)
    kw = transformer_config(dims, rope_theta=theta, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), hf_config=hf)
    kw.update(params_dtype=params_dtype, use_cpu_initialization=cpu_init, bf16=params_dtype == torch.bfloat16,
              **parallel)
    config = (MLATransformerConfig if dims.is_mla else TransformerConfig)(**kw)
    spec = get_gpt_layer_local_spec(**layer_spec_kwargs(dims))
    kwargs = gpt_model_kwargs(dims, rope_theta=theta)
    if vocab_size is not None:
        kwargs["vocab_size"] = int(vocab_size)
    return GPTModel(config, spec, pre_process=pre_process, post_process=post_process, **kwargs)


def load_hf_state(model, hf: Mapping[str, torch.Tensor], dims: ModelDims) -> None:
    """Load full HF tensors into a TP1/PP1 megatron model (every key placed, every parameter filled)."""
    load_megatron_state(model, hf_to_megatron(hf, dims))


def load_megatron_state(model, mg: Mapping[str, torch.Tensor]) -> None:
    """Load converted (megatron-named, this rank's) tensors: every key placed, every parameter filled."""
    missing, unexpected = model.load_state_dict(mg, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"megatron model and converted checkpoint disagree: missing {missing[:5]}, "
                       f"unexpected {list(unexpected)[:5]}")
