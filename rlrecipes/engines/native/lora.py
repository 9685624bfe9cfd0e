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
from typing import Any, Iterator

import torch.nn as nn

LORA_MARK = ".lora_"


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


def base_name(name: str) -> str:
    """The HF checkpoint name of a base weight inside a LoRA layer (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


__all__ = ["adapters_off", "base_name", "inject", "is_lora_name", "merged", "peft_config"]
