"""Build a megatron-core ``GPTModel`` for a model's dims (imports megatron-core; the pure translation is
in convert.py, the config keywords in layout.py). Parallel state must be initialised first
(``megatron.core.parallel_state.initialize_model_parallel``).

The layer specs are megatron's own decoder block spec (``get_gpt_decoder_block_spec``, no
TransformerEngine, RMSNorm): it places dense and MoE layers by ``moe_layer_freq`` (DeepSeek's dense
first layers) and keeps the pipeline stage's layers. Two module classes in it are replaced
(:func:`decoder_block_spec`):

* megatron's torch norm (``WrappedTorchNorm``, which refuses sequence parallelism) and apex's
  ``FusedLayerNorm`` (LayerNorm only) become :class:`RMSNorm`: ``torch.nn.RMSNorm`` whose weight is
  tagged ``sequence_parallel`` so megatron sums its gradient over TP under sequence parallelism.
  Norms MindSpeed patched in (on Ascend) are left alone: they handle sequence parallelism themselves;
* MLA's core attention: megatron's ``MultiLatentAttention`` passes ``k_channels`` / ``v_channels``
  to it, which the local ``DotProductAttention`` does not take; :func:`mla_local_attention` is that
  class taking them (q/k and v head sizes differ; its output per head is ``kv_channels`` =
  ``v_head_dim``, set by the config), or TransformerEngine's attention where ``core_attention="te"``;
* with context parallelism (``context_parallel_size > 1``) and ``core_attention="te"``, every layer's
  core attention: TransformerEngine's ``DotProductAttention``, megatron-core's only CP attention (the
  local one asserts CP 1). Only that slot changes: the rest of the spec, hence every weight name, stays
  the local spec's (megatron's full TE spec would fuse the norms into the linears and rename them). On
  Ascend the slot keeps the spec's class, into which MindSpeed patches its CP attention;
* MLA's q / kv down projections: megatron's duplicated ``Linear`` instead of ``ColumnParallelLinear``
  (:func:`mla_down_projection`: the column-parallel path loses part of the RoPE key gradient with
  TP > 1); their weights are then whole on every TP rank, as in the HF sharding table.

:func:`megatron_compat` sets three module flags megatron-core gets wrong without TransformerEngine.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any, Mapping, Optional

import torch

from ...models import ModelDims
from .convert import block_spec_kwargs, gpt_model_kwargs, hf_to_megatron, rope_theta
from .layout import engine_config_kwargs
from .shard import Ranks, padded_vocab


class RMSNorm(torch.nn.RMSNorm):
    """megatron's norm slot for RMSNorm models, usable with sequence parallelism: under it each TP
    rank normalises a slice of the sequence, and megatron's ``finalize_model_grads`` sums the
    gradients of parameters tagged ``sequence_parallel`` over TP. Built as megatron builds its torch
    norm: ``(config, hidden_size, eps)``, fp32 weight on the default device."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"rlrecipes' megatron RMSNorm built for normalization={config.normalization!r}")
        super().__init__(int(hidden_size), eps=eps)
        self.weight.sequence_parallel = bool(getattr(config, "sequence_parallel", False))


@functools.lru_cache(maxsize=None)
def mla_local_attention():
    """megatron's local ``DotProductAttention`` taking the ``k_channels`` / ``v_channels`` keywords
    ``MultiLatentAttention`` passes (its attention reads the head sizes off the tensors; the output
    width per head is the config's ``kv_channels``, which must be ``v_channels``)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, **kwargs):
            if v_channels is not None and int(v_channels) != int(config.kv_channels):
                raise ValueError(f"MLA value head size {v_channels} != kv_channels {config.kv_channels}: the "
                                 "config must set kv_channels = v_head_dim")
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale, **kwargs)

    return MLADotProductAttention


def _megatron_norms() -> list[type]:
    """megatron's own norm classes that may sit in a local spec (not ones MindSpeed patched in)."""
    out = []
    from megatron.core.transformer import torch_norm

    out.append(torch_norm.WrappedTorchNorm)
    try:
        from megatron.core.fusions import fused_layer_norm

        out.append(fused_layer_norm.FusedLayerNorm)
    except ImportError:  # pragma: no cover - the module imports without apex
        pass
    from megatron.core.models.gpt import gpt_layer_specs

    out.append(getattr(gpt_layer_specs, "LNImpl", None))
    return [c for c in out if isinstance(c, type) and c.__module__.startswith("megatron.")]


def _replace_classes(obj: Any, table: dict, fields: dict) -> Any:
    """``obj`` (a spec tree: dataclasses, lists, classes) with the classes in ``table`` replaced and,
    in dataclasses of a type in ``fields``, the named fields set; the same objects where nothing changes."""
    if isinstance(obj, type):
        return table.get(obj, obj)
    if isinstance(obj, (list, tuple)):
        new = [_replace_classes(x, table, fields) for x in obj]
        return obj if all(a is b for a, b in zip(new, obj)) else type(obj)(new)
    if dataclasses.is_dataclass(obj):
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init or f.name == "params":
                continue
            v = getattr(obj, f.name)
            nv = _replace_classes(v, table, fields)
            if nv is not v:
                changes[f.name] = nv
        for name, value in fields.get(type(obj), {}).items():
            if getattr(obj, name) is not value:
                changes[name] = value
        return dataclasses.replace(obj, **changes) if changes else obj
    return obj


def core_attention_class(kind: str):
    """MLA's core attention: ``"local"`` (:func:`mla_local_attention`) or ``"te"`` (TransformerEngine)."""
    if kind == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    if kind == "local":
        return mla_local_attention()
    raise ValueError(f"core attention {kind!r}: expected 'local' or 'te'")


def decoder_block_spec(config, *, pp_rank: Optional[int] = None, core_attention: Any = "local"):
    """The stage's decoder block spec (megatron's ``get_gpt_decoder_block_spec``, local modules, RMSNorm)
    with the engine's norm and, for MLA, its core attention and duplicated down projections; with
    context parallelism in ``config`` and a non-local ``core_attention``, that core attention in every
    layer (module docstring). ``pp_rank``: the pipeline stage (megatron's parallel state by default);
    ``core_attention``: ``"local"``, ``"te"`` or a class."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

    spec = get_gpt_decoder_block_spec(config, pp_rank=pp_rank, **block_spec_kwargs())
    table: dict = {c: RMSNorm for c in _megatron_norms()}
    fields: dict = {}
    mla = bool(getattr(config, "multi_latent_attention", False))
    if mla or (int(getattr(config, "context_parallel_size", 1) or 1) > 1 and core_attention != "local"):
        table[DotProductAttention] = core_attention if isinstance(core_attention, type) else \
            core_attention_class(core_attention)
    if mla:
        linear = mla_down_projection()
        fields[MLASelfAttentionSubmodules] = dict(linear_q_down_proj=linear, linear_kv_down_proj=linear)
    return _replace_classes(spec, table, fields)


def mla_down_projection():
    """MLA's q / kv down projections: megatron's duplicated ``Linear`` (the whole weight on every TP
    rank, input and output sequence-parallel, weight tagged for the TP gradient sum). megatron's local
    spec makes them ``ColumnParallelLinear``, with which ``MultiLatentAttention`` gathers the output
    over TP and keeps the RoPE key part (``k_pos_emb``) replicated with no reduction of its gradient:
    with TP > 1 each rank's gradient of it holds its own heads only (multi_latent_attention.py, the
    ``gather_from_tensor_model_parallel_region(kv_combined)`` branch, 0.16.1 and 0.19)."""
    from megatron.core.post_training.modelopt.layers import Linear

    return Linear


def megatron_compat() -> None:
    """Two megatron-core 0.16.x flags that are wrong without TransformerEngine (0.19 has them right),
    set the way 0.19 sets them:

    * ``moe_utils`` binds ``te_general_gemm`` only when TE imports, and the MoE router's gating reads
      it unconditionally (a NameError at the first MoE forward): bound to None;
    * ``multi_latent_attention.HAVE_TE`` is True whenever megatron's TE extension module imports,
      which it does without TE (it stands a MagicMock in for ``transformer_engine``), and MLA's
      constructor then calls ``isinstance`` with that mock (a TypeError): set to whether TE imports.

    And one for 0.19 without TE: ``multi_latent_attention.Linear`` (megatron's duplicated ``Linear``,
    which MLA accepts for its down projections) is bound only when TE imports: bound to that class.
    """
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if getattr(multi_latent_attention, "HAVE_TE", False) and importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
    if getattr(multi_latent_attention, "Linear", None) is None:  # 0.19 without TE: MLA accepts Linear for the
        multi_latent_attention.Linear = mla_down_projection()  # down projections only where TE imports


def transformer_config(dims: ModelDims, config_kwargs: Mapping[str, Any], *, cpu_init: bool = False):
    """megatron's ``TransformerConfig`` (``MLATransformerConfig`` for MLA) from the engine's keywords."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return (MLATransformerConfig if dims.is_mla else TransformerConfig)(
        **dict(config_kwargs), use_cpu_initialization=cpu_init)


def build_gpt(dims: ModelDims, *, hf_config=None, ranks: Optional[Ranks] = None, dtype: torch.dtype = torch.float32,
              recompute: bool = False, training: bool = True, cpu_init: bool = False,
              pre_process: bool = True, post_process: bool = True, overrides: Optional[Mapping[str, Any]] = None,
              core_attention: Any = "local", pp_rank: Optional[int] = None, pg_collection: Any = None):
    """``GPTModel`` of one pipeline stage, configured exactly as the engine configures it
    (:func:`layout.engine_config_kwargs`, then ``overrides``), with :func:`decoder_block_spec`.
    ``hf_config``: the HF config (object or ``config.json`` dict); ``ranks``: the layout (TP1 PP1 EP1
    by default); ``cpu_init``: build on the host (``use_cpu_initialization``). The vocabulary is
    padded to a multiple of TP (``shard.padded_vocab``); ``pg_collection``: megatron's process groups
    for the model (its parallel state's by default)."""
    from megatron.core.models.gpt import GPTModel

    megatron_compat()
    hf = dict(hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config or {})
    r = ranks or Ranks()
    kw = engine_config_kwargs(dims, hf, r, dtype, recompute=recompute, training=training)
    kw.update(overrides or {})
    config = transformer_config(dims, kw, cpu_init=cpu_init)
    spec = decoder_block_spec(config, pp_rank=pp_rank, core_attention=core_attention)
    model_kw = gpt_model_kwargs(dims, rope_theta=rope_theta(hf))
    model_kw["vocab_size"] = padded_vocab(dims.vocab_size, r.tp)
    if pg_collection is not None:
        model_kw["pg_collection"] = pg_collection
    return GPTModel(config, spec, pre_process=pre_process, post_process=post_process, **model_kw)


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
