"""Build HF causal LMs from smoke dimensions or local HF folders, and export HF folders.

Only local folders with ``config.json`` and ``*.safetensors`` are loaded (never a hub download,
never a pickle). Two ways in:

* :func:`build_model` - the whole model on CPU (smoke dimensions, random init; tests and the
  rollout engine's small models);
* :func:`build_empty` + :func:`materialize` - the train engines' way at real size: the model is
  built on the meta device, sharded (TP/EP/FSDP2) while still empty, then every rank allocates only
  its shards and reads exactly those boxes from the safetensors files
  (:class:`rlrecipes.models.safetensors_io.SafetensorsFolder`). No rank ever holds the whole model.

:class:`HFFolderWriter` writes an HF folder tensor by tensor, one file-sized group at a time, so
an export never holds more than one file's worth of tensors.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Union

import torch
import torch.nn as nn

from rlrecipes.models import ModelDims, dims_from_hf_config, hf_config
from rlrecipes.models.files import FIX_CONFIG, FIX_TOKENIZER, FIX_WEIGHTS, reading
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


def auto_class(cfg):
    """The transformers auto class of a config: image-text-to-text for a vision-language model (its
    config has a ``vision_config``), causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(cfg, "vision_config", None) is not None else AutoModelForCausalLM


def build_model(source: ModelSource, *, dtype: torch.dtype = torch.float32, seed: int | None = 0,
                attn_implementation: str = "sdpa") -> tuple[nn.Module, ModelDims]:
    """An HF causal LM on CPU, full (unsharded): from ``ModelDims`` (random init, seeded) or a folder.

    Returns ``(model, dims)``. Every rank that calls it holds the full model: fine for smoke and
    small models; the train engines load folders with :func:`build_empty` + :func:`materialize`.
    """

    if isinstance(source, ModelDims):
        cfg = hf_config(source)
        cfg._attn_implementation = attn_implementation
        if seed is not None:
            torch.manual_seed(seed)
        model = auto_class(cfg).from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
        return model, source
    path = check_hf_folder(source)
    cfg = _read_config(path)  # a clear error on a bad config.json first
    SafetensorsFolder(path)  # every weight file's header and length: a truncated file is named, not a library's
    with reading(path, "HF model folder", FIX_WEIGHTS):
        model = auto_class(cfg).from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True,
                                                     attn_implementation=attn_implementation)
    return model, dims_from_hf_config(model.config)


def _read_config(path: Path):
    """``AutoConfig`` of a local HF folder; a damaged config.json is named."""
    from transformers import AutoConfig

    with reading(path / "config.json", "model config", FIX_CONFIG):
        return AutoConfig.from_pretrained(path, local_files_only=True)


def build_empty(folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                attn_implementation: str = "sdpa") -> tuple[nn.Module, ModelDims]:
    """The HF model of a local folder on the meta device (no storage), and its dimensions."""

    path = check_hf_folder(folder)
    cfg = _read_config(path)
    cfg._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = auto_class(cfg).from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
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
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    for (mod, name), *others in shared:  # meta -> device gives every module its own tensor: re-tie
        for m, n in others:
            if m._parameters[n] is not mod._parameters[name]:
                m._parameters[n] = mod._parameters[name]
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
                local.copy_(full[tuple(slice(a, b) for a, b in box)])
                continue
            try:  # straight into the shard's storage, chunk by chunk
                reader.read_param(name, tuple(t.shape), box, tied_to=tied_to, out=local)
            except CheckpointError as e:
                raise CheckpointError(f"loading {name}: {e}") from None


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, name) slots that hold the same parameter object (a tied head), one list per object."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((mod, name))
    return [v for v in slots.values() if len(v) > 1]


def source_folder(source: ModelSource) -> Path | None:
    return None if isinstance(source, ModelDims) else Path(source)


def load_tokenizer(folder: str | os.PathLike):
    """The tokenizer of a local HF folder (None when the folder has none)."""
    path = Path(folder)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    with reading(path, "tokenizer folder", FIX_TOKENIZER):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)


class HFFolderWriter:
    """Writes an HF folder tensor by tensor: a group is flushed to its own safetensors file once it
    reaches ``max_shard_bytes``, so the writer holds at most one file's worth of tensors.

    Names are transformers v5 in-memory names; fused MoE experts are written with per-expert keys
    (``mlp.experts.<e>.gate_proj.weight`` ...), the format of published checkpoints that transformers,
    vLLM and other converters read, and a tied ``lm_head.weight`` is dropped as ``save_pretrained``
    does. One file is ``model.safetensors``; more are ``model-0000i-of-0000N.safetensors`` with a
    ``model.safetensors.index.json``. Files are written under temporary names and renamed at
    :meth:`close`, so a crash never leaves a folder that looks complete.
    """

    def __init__(self, folder: str | os.PathLike, config, *, dtype: torch.dtype | None = None,
                 max_shard_bytes: int = 4 << 30):
        self.out = Path(folder)
        self.out.mkdir(parents=True, exist_ok=True)
        self.config, self.dtype, self.max_bytes = config, dtype, int(max_shard_bytes)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        from rlrecipes.models.sharding import checkpoint_items

        if self.tied and name == "lm_head.weight":
            return
        t = t.detach().cpu()
        if self.dtype is not None and t.is_floating_point() and "e_score_correction_bias" not in name:
            t = t.to(self.dtype)
        for key, part in checkpoint_items(name, t):
            part = part.contiguous()
            self.pending[key] = part
            self.pending_bytes += part.numel() * part.element_size()
        if self.pending_bytes >= self.max_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        tmp = self.out / f".model-{len(self.files):05d}.safetensors.tmp"
        save_file(self.pending, str(tmp), metadata={"format": "pt"})
        self.files.append((tmp, list(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self, *, tokenizer_from: str | os.PathLike | None = None) -> Path:
        self._flush()
        for old in list(self.out.glob("model*.safetensors")) + list(self.out.glob("model.safetensors.index.json")):
            old.unlink()  # an earlier export in the same folder
        n = len(self.files)
        weight_map = {}
        for i, (tmp, keys) in enumerate(self.files):
            final = self.out / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            os.replace(tmp, final)
            weight_map.update({k: final.name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = self.config.__class__.from_dict(self.config.to_dict())
        if self.dtype is not None:
            config.dtype = self.dtype
        config.save_pretrained(self.out)
        if tokenizer_from is not None:
            for f in _TOKENIZER_FILES:
                src = Path(tokenizer_from) / f
                if src.is_file():
                    shutil.copyfile(src, self.out / f)
        return self.out


def save_hf_folder(state_dict: dict[str, torch.Tensor], config, folder: str | os.PathLike, *,
                   tokenizer_from: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
                   max_shard_bytes: int = 4 << 30) -> Path:
    """Write full tensors with HF (transformers v5) names as an HF folder (see :class:`HFFolderWriter`);
    the result loads with ``AutoModelForCausalLM.from_pretrained``."""
    w = HFFolderWriter(folder, config, dtype=dtype, max_shard_bytes=max_shard_bytes)
    for name, t in state_dict.items():
        w.add(name, t)
    return w.close(tokenizer_from=tokenizer_from)


def read_config_json(folder: str | os.PathLike) -> dict:
    f = Path(folder) / "config.json"
    with reading(f, "model config", FIX_CONFIG):
        return json.loads(f.read_text(encoding="utf-8"))


__all__ = ["HFFolderWriter", "ModelSource", "build_empty", "build_model", "check_hf_folder", "materialize", "load_tokenizer", "read_config_json",
           "save_hf_folder", "source_folder"]
