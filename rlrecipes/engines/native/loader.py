"""Build HF causal LMs from smoke dimensions or local HF folders, and export HF folders.

Only local folders with ``config.json`` and ``*.safetensors`` are loaded (never a hub download,
never a pickle): ``from_pretrained(folder, local_files_only=True, use_safetensors=True)``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Union

import torch
import torch.nn as nn

from rlrecipes.models import ModelDims, dims_from_hf_config, hf_config

ModelSource = Union[ModelDims, str, os.PathLike]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                    "generation_config.json")


def check_hf_folder(folder: str | os.PathLike) -> Path:
    """A local HF folder with config.json and safetensors weights, or a clear error."""
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist (native engines never download "
                                f"from a hub: pass a local HF folder or ModelDims)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'}: missing; not an HF model folder")
    if not any(path.glob("*.safetensors")):
        bins = [p.name for p in path.glob("*.bin")]
        hint = f" (found {bins}: pickled weights are refused; convert to safetensors)" if bins else ""
        raise FileNotFoundError(f"{path}: no *.safetensors weights{hint}")
    return path


def build_model(source: ModelSource, *, dtype: torch.dtype = torch.float32, seed: int | None = 0,
                attn_implementation: str = "sdpa") -> tuple[nn.Module, ModelDims]:
    """An HF causal LM on CPU, full (unsharded): from ``ModelDims`` (random init, seeded) or a folder.

    Returns ``(model, dims)``. Every rank builds the same full model (same seed) before sharding;
    fine for smoke and small models, a meta-device init is the way for very large ones.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(source, ModelDims):
        cfg = hf_config(source)
        cfg._attn_implementation = attn_implementation
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
        return model, source
    path = check_hf_folder(source)
    AutoConfig.from_pretrained(path, local_files_only=True)  # clear error on a bad config.json first
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True,
                                                 attn_implementation=attn_implementation)
    return model, dims_from_hf_config(model.config)


def source_folder(source: ModelSource) -> Path | None:
    return None if isinstance(source, ModelDims) else Path(source)


def load_tokenizer(folder: str | os.PathLike):
    """The tokenizer of a local HF folder (None when the folder has none)."""
    path = Path(folder)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def save_hf_folder(state_dict: dict[str, torch.Tensor], config, folder: str | os.PathLike, *,
                   tokenizer_from: str | os.PathLike | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (+ tokenizer files copied from ``tokenizer_from``).

    ``state_dict`` holds full tensors with HF (transformers v5) names; a tied ``lm_head.weight`` is
    dropped, as ``save_pretrained`` does. Fused MoE experts are written with per-expert keys
    (``mlp.experts.<e>.gate_proj.weight`` ...), the format of published checkpoints that transformers,
    vLLM and other converters read. The result loads with ``AutoModelForCausalLM.from_pretrained``.
    """
    from safetensors.torch import save_file

    from rlrecipes.models.sharding import checkpoint_items

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    tensors = {}
    for name, t in state_dict.items():
        if tied and name == "lm_head.weight":
            continue
        t = t.detach().cpu()
        if dtype is not None and t.is_floating_point() and "e_score_correction_bias" not in name:
            t = t.to(dtype)
        for key, part in checkpoint_items(name, t):
            tensors[key] = part.contiguous()
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")  # never leave a half-written weights file
    config = config.__class__.from_dict(config.to_dict())
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(out)
    if tokenizer_from is not None:
        for f in _TOKENIZER_FILES:
            src = Path(tokenizer_from) / f
            if src.is_file():
                shutil.copyfile(src, out / f)
    return out


def read_config_json(folder: str | os.PathLike) -> dict:
    with open(Path(folder) / "config.json") as f:
        return json.load(f)


__all__ = ["ModelSource", "build_model", "check_hf_folder", "load_tokenizer", "read_config_json",
           "save_hf_folder", "source_folder"]
