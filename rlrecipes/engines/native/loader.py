"""Build HF causal LMs from smoke dimensions or local HF folders, and export HF folders.

Only local folders with ``config.json`` and ``*.safetensors`` are loaded (never a hub download,
never a pickle). Two ways in:

* :func:`build_model` - the whole model on CPU (smoke dimensions, random init; tests and the
  rollout engine's small models);
* :func:`build_empty` + :func:`materialize` - the train engines' way at real size: the model is
  built on the meta device, sharded (TP/EP/FSDP2) while still empty, then every rank allocates only
  its shards and reads exactly those boxes from the safetensors files
  (:class:`rlrecipes.models.safetensors_io.SafetensorsFolder`). No rank ever holds the whole model.

:func:`export_hf_sharded` writes an HF folder from a sharded model one file-sized group of
parameters at a time, so the writer never holds more than one file.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Union

from typing import Callable, Iterable

import torch
import torch.nn as nn

from rlrecipes.models import ModelDims, dims_from_hf_config, hf_config
from rlrecipes.models.safetensors_io import CheckpointError, SafetensorsFolder

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

    Returns ``(model, dims)``. Every rank that calls it holds the full model: fine for smoke and
    small models; the train engines load folders with :func:`build_empty` + :func:`materialize`.
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


def build_empty(folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                attn_implementation: str = "sdpa") -> tuple[nn.Module, ModelDims]:
    """The HF model of a local folder on the meta device (no storage), and its dimensions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = check_hf_folder(folder)
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    cfg._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    return model, dims_from_hf_config(cfg)


def _fresh_buffers(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Non-persistent buffers (rotary ``inv_freq``) are not in any checkpoint: rebuild the modules that
    own them on CPU from their config (they are tiny) and keep the values."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, mod in model.named_modules():
        names = [n for n in mod._non_persistent_buffers_set if mod._buffers.get(n) is not None]
        if not names:
            continue
        cfg = getattr(mod, "config", None)
        if cfg is None:
            raise NotImplementedError(f"{fqn} ({type(mod).__name__}) has non-persistent buffers {names} and no config "
                                      "to rebuild them from after a meta-device build")
        with torch.device("cpu"):
            fresh = type(mod)(cfg)
        out[fqn] = {n: fresh._buffers[n].detach().clone() for n in names}
    return out


def materialize(model: nn.Module, device: torch.device, folder: str | os.PathLike, *,
                local_box: Callable[[torch.Tensor], list[tuple[int, int]]],
                named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                init_missing: Callable[[str, tuple[int, ...]], torch.Tensor | None] | None = None) -> None:
    """Allocate a meta-built (and already sharded) model on ``device`` and fill every rank's shards.

    ``local_box(t)`` gives the ``(start, stop)`` per dimension of ``t``'s local shard in global
    coordinates; each box is read straight from the safetensors files. ``init_missing(name, shape)``
    returns the full initial value of a parameter the checkpoint does not hold (a critic's value head)
    or None. A tied LM head reads the embedding.
    """
    reader = SafetensorsFolder(check_hf_folder(folder))
    buffers = _fresh_buffers(model)
    tied_to = "model.embed_tokens.weight" if getattr(model.config, "tie_word_embeddings", False) else None
    model.to_empty(device=device)
    with torch.no_grad():
        for fqn, values in buffers.items():
            mod = model.get_submodule(fqn)
            for n, v in values.items():
                mod._buffers[n] = v.to(device)
        seen: set[int] = set()
        for name, t in (named_tensors if named_tensors is not None else model.named_parameters()):
            if id(t) in seen:  # a tied parameter, already filled under its first name
                continue
            seen.add(id(t))
            local = t.to_local() if hasattr(t, "to_local") else t
            box = local_box(t)
            if not math.prod(b - a for a, b in box):
                continue
            full = init_missing(name, tuple(t.shape)) if init_missing is not None else None
            if full is not None:
                value = full[tuple(slice(a, b) for a, b in box)]
            else:
                try:
                    value = reader.read_param(name, tuple(t.shape), box, dtype=local.dtype, tied_to=tied_to)
                except CheckpointError as e:
                    raise CheckpointError(f"loading {name}: {e}") from None
            local.copy_(value)


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


__all__ = ["ModelSource", "build_empty", "build_model", "check_hf_folder", "materialize", "load_tokenizer", "read_config_json",
           "save_hf_folder", "source_folder"]
