"""A native train engine's state outside the step: DCP checkpoints of model + optimizer, and moving
params, grads and optimizer state to host memory and back (``offload`` / ``onload``, and
``actor.offload_optimizer``'s parking of the Adam state between steps). A mixin of
:class:`~rlrecipes.engines.native.train.NativeTrainEngine`: it uses the engine's ``model``,
``optimizer``, ``step``, ``device`` and ``_params()``."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from rlrecipes import device as devmod
from rlrecipes.core.swap import SwappedStorages


BASE_MODEL_FILE = "base_model.json"
_SAMPLE = 1 << 20


@functools.lru_cache(maxsize=8)
def _folder_digest(root: Path) -> str:
    """A fingerprint of an HF folder that tells fine-tunes of one architecture apart without reading
    every weight: ``config.json``, and per safetensors file its name, header (names, shapes, dtypes,
    offsets) and first MiB of tensor data."""
    digest = hashlib.sha256((root / "config.json").read_bytes() if (root / "config.json").is_file() else b"")
    for f in sorted(root.glob("*.safetensors")):
        with open(f, "rb") as fh:
            head = fh.read(8)
            digest.update(f.name.encode() + head + fh.read(int.from_bytes(head, "little")) + fh.read(_SAMPLE))
    return digest.hexdigest()


class EngineState:
    """Checkpoints and host offload of a native train engine (see the module docstring); the
    engine's ``__init__`` sets ``_offloaded``, ``_opt_parked`` and ``offload_optimizer``."""

    @property
    def host_is_device(self) -> bool:
        """True where host memory is the device's own (CPU): moving tensors to the host frees
        nothing there, so :meth:`offload` and the optimizer parking do nothing."""
        return not devmod.is_accelerator(self.device.type)

    # ----------------------------------------------------------------------------- checkpoints
    def _state_options(self):
        """LoRA: the frozen base stays out of checkpoints (the adapters and their optimizer state only;
        the base is the model source, named in ``base_model.json``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen_out = getattr(self, "lora", None) is not None
        return StateDictOptions(ignore_frozen_params=frozen_out, strict=not frozen_out)

    def state_dict(self) -> dict:
        """Model (+ optimizer) state for ``torch.distributed.checkpoint`` (DTensor-sharded)."""
        self._unpark_optimizer()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        opts = self._state_options()
        if self.optimizer is not None:
            msd, osd = get_state_dict(self.model, self.optimizer, options=opts)
            return {"model": msd, "optim": osd, "step": torch.tensor(self.step)}
        return {"model": get_model_state_dict(self.model, options=opts), "step": torch.tensor(self.step)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        opts = self._state_options()
        if self.optimizer is not None and "optim" in sd:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                           options=opts)
        else:
            set_model_state_dict(self.model, sd["model"], options=opts)
        self.step = int(sd.get("step", self.step))

    def base_model_ref(self) -> dict | None:
        """What a LoRA checkpoint's adapters sit on: the base model's source and the adapter config
        (None without LoRA: the checkpoint holds the whole model)."""
        lora = getattr(self, "lora", None)
        if lora is None:
            return None
        folder = getattr(self, "_source_folder", None)
        if folder is not None:  # the folder may move between machines; its config and weights may not change
            source = {"folder_sha256": _folder_digest(Path(folder))}
        else:
            source = {"smoke_dims": dataclasses.asdict(self.dims), "seed": int(self.seed)}
        return {"base_model": source, "base_model_path": str(folder) if folder is not None else None, "lora": {k: getattr(lora, k) for k in ("rank", "alpha", "dropout")}
                | {"target_modules": sorted(lora.target_modules)}}

    def save(self, path: str | os.PathLike) -> None:
        """DCP save of model + optimizer into a directory (every rank writes its shards); with LoRA the
        adapters and their optimizer state, plus ``base_model.json`` naming the base."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state_dict(), checkpoint_id=str(path))
        ref = self.base_model_ref()
        if ref is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            (Path(path) / BASE_MODEL_FILE).write_text(json.dumps(ref, indent=2))

    def _check_base_model(self, path: Path) -> None:
        """A LoRA checkpoint loads only onto the base and adapter shape it was trained with."""
        ref, f = self.base_model_ref(), path / BASE_MODEL_FILE
        if ref is None and f.is_file():
            raise ValueError(f"{f}: this checkpoint holds LoRA adapters only; resume it with the run's "
                             "actor.lora settings (actor.lora.rank > 0)")
        if ref is None:
            return
        if not f.is_file():
            raise ValueError(f"{path}: a full-model checkpoint (no {BASE_MODEL_FILE}) cannot resume a LoRA actor; "
                             "resume it with actor.lora.rank=0")
        saved = json.loads(f.read_text())
        for key in ("base_model", "lora"):
            if saved.get(key) != ref[key]:
                raise ValueError(f"{f}: {key} is {saved.get(key)}, this run has {ref[key]}; resume with the "
                                 "base model and actor.lora settings the checkpoint was trained with")

    def load(self, path: str | os.PathLike) -> None:
        import torch.distributed.checkpoint as dcp

        if not Path(path).is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
        self._check_base_model(Path(path))
        sd = self.state_dict()
        if self.optimizer is not None and not sd["optim"].get("state"):
            # AdamW state is created lazily; materialise it so DCP has somewhere to load into.
            self._init_optimizer_state()
            sd = self.state_dict()
        dcp.load(sd, checkpoint_id=str(path))
        self.load_state_dict(sd)

    def _init_optimizer_state(self) -> None:
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in self._params():
            p.grad = torch.zeros_like(p)
        wd = [g["weight_decay"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["weight_decay"] = 0.0
        self.optimizer.step()
        for g, lr, w in zip(self.optimizer.param_groups, lrs, wd):
            g["lr"], g["weight_decay"] = lr, w
        self.optimizer.zero_grad(set_to_none=True)

    # ----------------------------------------------------------------------------- memory
    def offload(self) -> None:
        """Move params, grads and optimizer state to host memory, freeing device memory.

        Storage level (:class:`rlrecipes.core.swap.SwappedStorages`): every view (FSDP2 shards, DTensor locals,
        optimizer references) stays valid and ``onload()`` restores it in place. A no-op where the
        host is the device (:attr:`host_is_device`).
        """
        if self._offloaded is not None or self.host_is_device:
            return
        tensors = []
        for p in self.model.parameters():
            tensors += [p.data, p.grad]
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                tensors += [v for v in state.values() if torch.is_tensor(v)]
        self._offloaded = SwappedStorages(tensors, self.device)

    def _park_optimizer(self) -> None:
        """``actor.offload_optimizer``: the Adam state lives in host memory between optimizer steps
        (storage-level swap, see :class:`SwappedStorages`); device memory holds it only during ``step``."""
        if not self.offload_optimizer or self._opt_parked is not None or self.optimizer is None:
            return
        if self.host_is_device:
            return
        state = [v for st in self.optimizer.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.device.type == self.device.type and v.dim() > 0]
        self._opt_parked = SwappedStorages(state, self.device)

    def _unpark_optimizer(self) -> None:
        if self._opt_parked is not None:
            self._opt_parked.restore()
            self._opt_parked = None

    def onload(self) -> None:
        """Bring back what ``offload()`` moved to host (no-op when nothing is offloaded)."""
        if self._offloaded is not None:
            self._offloaded.restore()
            self._offloaded = None
