"""LoRA adapters in the native engines, through PEFT (``peft``, the ``lora`` extra).

``inject`` puts PEFT's LoRA layers into an HF model in place (``peft.inject_adapter_in_model``:
no ``PeftModel`` wrapper, so the model keeps its class and its ``model.layers`` structure, which
the engines' parallel plans and the fast decoder walk). The base weights are frozen; only the
``lora_A`` / ``lora_B`` tensors train, sync and checkpoint. ``adapters_off`` runs the base model
(the reference policy) on the same weights.

What PEFT gives us over our own adapters: the LoRA layer types for Linear (and the others it
knows), their scaling / dropout / merge / unmerge arithmetic, adapter enable/disable, and the
adapter folder format (``adapter_config.json`` + ``adapter_model.safetensors``) that PEFT and vLLM
load.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

from rlrecipes.models.lora_shapes import ADAPTER  # the name PEFT gives the one adapter ``inject`` adds

LORA_MARK = ".lora_"
PEFT_PREFIX = "base_model.model."
"""What ``PeftModel`` puts before the wrapped model's parameter names in an adapter folder."""


def is_lora_name(name: str) -> bool:
    return LORA_MARK in name


def peft_config(lora: Any):
    from peft import LoraConfig

    return LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                      target_modules=list(lora.target_modules), bias="none")


def inject(model: nn.Module, lora: Any) -> nn.Module:
    """Adapters into ``model`` in place (B = 0: the model's function is unchanged); base frozen."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(peft_config(lora), model)
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_name(name))
    return model


def _tuner_layers(model: nn.Module):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model inside the block (every LoRA layer skips its adapter)."""
    layers = _tuner_layers(model)
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


@contextlib.contextmanager
def merged(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """The adapters folded into the base weights inside the block (an HF export), undone after."""
    layers = _tuner_layers(model) if enabled else []
    for m in layers:
        m.merge()
    try:
        yield
    finally:
        for m in layers:
            m.unmerge()


def peft_key(name: str) -> str:
    """The adapter-folder name of an injected LoRA tensor, the one PEFT's ``PeftModel`` and vLLM's
    LoRA loader read (``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.{ADAPTER}.", f".{part}.")
    return PEFT_PREFIX + name


def adapter_config(lora: Any, base_model: str | None) -> dict:
    """``adapter_config.json`` of the adapters (PEFT's own serialisation of its ``LoraConfig``)."""
    cfg = peft_config(lora)
    cfg.base_model_name_or_path = base_model
    return cfg.to_dict()


def write_adapter_folder(folder: str | os.PathLike, tensors: Mapping[str, torch.Tensor], lora: Any,
                         base_model: str | None) -> Path:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) from the
    injected names' tensors; ``PeftModel.from_pretrained(base, folder)`` and vLLM load it."""
    import json

    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = adapter_config(lora, base_model)
    cfg["peft_type"] = str(getattr(cfg["peft_type"], "value", cfg["peft_type"]))
    cfg["task_type"] = "CAUSAL_LM"
    cfg["target_modules"] = sorted(cfg["target_modules"])
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2, default=str))
    save_file({peft_key(n): t.detach().contiguous().cpu() for n, t in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    return folder


def init_adapter(name: str, shape: tuple[int, ...], *, seed: int) -> torch.Tensor:
    """The initial value of one adapter tensor where PEFT could not set it (a model built on the meta
    device, then filled from a checkpoint): ``lora_B`` zeros (the model starts as its base),
    ``lora_A`` PEFT's default (Kaiming-uniform, ``a = sqrt(5)``) from a generator seeded by ``seed``
    and the name, so every rank draws the same tensor."""
    import math
    import zlib

    if ".lora_B." in name:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 63)
    bound = 1.0 / math.sqrt(shape[-1])  # kaiming_uniform_(a=sqrt(5)) on [rank, in]: U(-1/sqrt(in), 1/sqrt(in))
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


def base_name(name: str) -> str:
    """The HF checkpoint name of a base weight inside a LoRA layer (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


__all__ = ["adapter_config", "adapters_off", "base_name", "init_adapter", "inject", "is_lora_name", "merged", "peft_config", "peft_key",
           "write_adapter_folder"]
