"""Moving and persisting a megatron engine's state: offload / onload of the DDP buffers and the
distributed optimizer's state, and per-rank checkpoints with a manifest.

Checkpoints are one file per rank (``rank-00000.pt``: the rank's model tensors, its shard of the
distributed optimizer's fp32 main parameters and Adam state, the step) and ``manifest.json`` (the
layout, the model, the files). A checkpoint loads onto the same layout only; ``load`` says which
sizes differ otherwise. Files are read with ``torch.load(weights_only=True)``. (megatron's
``dist_checkpointing`` reshards across layouts, but its sharded-state-dict API differs between the
releases this project runs, 0.16 and 0.19, and needs the engine's real modules to test; see
docs/megatron.md.)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...core.swap import SwappedStorages

MANIFEST = "manifest.json"


def optimizers(opt) -> list:
    """The megatron optimizers behind ``opt`` (a ``ChainedOptimizer`` holds one per parameter kind)."""
    return [] if opt is None else list(getattr(opt, "chained_optimizers", [opt]))


def _main_params(opt) -> list[list[torch.Tensor]]:
    """The distributed optimizer's fp32 main-parameter shards kept apart from the model (bf16/fp16
    models; an fp32 model's shards are views of its own parameters)."""
    return [list(g) for g in (getattr(opt, "shard_fp32_from_float16_groups", None) or [])]


def _inner_state(opt) -> list[torch.Tensor]:
    inner = getattr(opt, "optimizer", None)
    return [v for st in getattr(inner, "state", {}).values() for v in st.values() if torch.is_tensor(v)]


def device_tensors(model, opt, device: torch.device) -> list[torch.Tensor]:
    """What offload moves: DDP parameter and gradient buffers (or the parameters of an engine
    without DDP), fp32 main parameters and optimizer state, the ones on ``device``."""
    out: list = []
    ddp = getattr(model, "buffers", None)  # megatron DDP: a list of buffers (nn.Module's is a method)
    if isinstance(ddp, list):
        for b in ddp + list(getattr(model, "expert_parallel_buffers", None) or []):
            out += [getattr(b, "param_data", None), getattr(b, "grad_data", None)]
    else:
        for p in model.parameters():
            out += [p.data, p.grad]
    for o in optimizers(opt):
        out += [t for g in _main_params(o) for t in g] + _inner_state(o)
    return [t for t in out if t is not None and t.device.type == device.type and t.numel()]


def offload(model, opt, device: torch.device) -> SwappedStorages | None:
    """Swap the device tensors to host (storage level, every view stays valid); None when none."""
    ts = device_tensors(model, opt, device)
    return SwappedStorages(ts, device) if ts else None


# ------------------------------------------------------------------------------------- checkpoints
def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def save(path: str | os.PathLike, module, opt, *, layout: dict, step: int) -> None:
    """Every rank writes its file; rank 0 writes the manifest once all files are there. Collective."""
    path = Path(path)
    rank = dist.get_rank()
    path.mkdir(parents=True, exist_ok=True)
    model_sd = {k: v.detach().cpu() for k, v in module.state_dict().items()
                if torch.is_tensor(v) and not k.endswith("_extra_state")}
    optim = []
    for o in optimizers(opt):
        inner = getattr(o, "optimizer", None)
        sd = inner.state_dict() if inner is not None else {"state": {}, "param_groups": []}
        optim.append({"state": {int(i): {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
                                for i, st in sd["state"].items()},
                      "lr": [float(g["lr"]) for g in sd["param_groups"]],
                      "main": [[t.detach().cpu() for t in g] for g in _main_params(o)]})
    tmp = path / (_rank_file(rank) + ".tmp")
    torch.save({"model": model_sd, "optim": optim, "step": int(step)}, tmp)
    os.replace(tmp, path / _rank_file(rank))
    dist.barrier()
    if rank == 0:
        manifest = {"format": "rlrecipes-megatron-per-rank-v1", "layout": layout, "step": int(step),
                    "world": dist.get_world_size(), "files": [_rank_file(r) for r in range(dist.get_world_size())]}
        (path / MANIFEST).write_text(json.dumps(manifest, indent=1))
    dist.barrier()


def read_manifest(path: str | os.PathLike, layout: dict) -> dict:
    """The manifest, checked against this engine's layout (a clear error naming what differs)."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a megatron engine checkpoint: it has no {MANIFEST}")
    m = json.loads(f.read_text())
    diff = {k: (m["layout"].get(k), v) for k, v in layout.items() if m["layout"].get(k) != v}
    if diff:
        raise ValueError(f"{f}: saved with another layout; " + ", ".join(f"{k} {a} here {b}" for k, (a, b) in diff.items())
                         + " (per-rank checkpoints load onto the layout they were saved with)")
    return m


def load(path: str | os.PathLike, module, opt, *, layout: dict) -> int:
    """Load this rank's file into the model and optimizer; returns the saved step."""
    read_manifest(path, layout)
    data: dict[str, Any] = torch.load(Path(path) / _rank_file(dist.get_rank()), map_location="cpu", weights_only=True)
    missing, unexpected = module.load_state_dict(data["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"checkpoint {str(path)!r} and the model disagree: missing {missing[:5]}, "
                       f"unexpected {list(unexpected)[:5]}")
    opts = optimizers(opt)
    if len(opts) != len(data["optim"]):
        raise ValueError(f"checkpoint {str(path)!r} holds {len(data['optim'])} optimizers, the engine has {len(opts)}")
    with torch.no_grad():
        for o, saved in zip(opts, data["optim"]):
            for g, sg in zip(_main_params(o), saved["main"]):
                for t, s in zip(g, sg):
                    t.copy_(s)
            inner = getattr(o, "optimizer", None)
            if inner is not None:
                sd = inner.state_dict()
                sd["state"] = saved["state"]
                for grp, lr in zip(sd["param_groups"], saved["lr"]):
                    grp["lr"] = lr
                inner.load_state_dict(sd)
    return int(data["step"])
