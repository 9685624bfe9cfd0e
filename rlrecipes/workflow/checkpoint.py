"""Checkpoints: engine state (sharded, every rank), data position, RNG and KL state.

``checkpoints/latest`` names the newest complete checkpoint and is written last (atomically), so
a run killed mid-save still resumes from the previous one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .. import device as dev
from .context import Context

CKPT_LATEST = "latest"


def save(ctx: Context, step: int) -> None:
    ckpt = ctx.run_dir / "checkpoints" / f"step_{step + 1:06d}"
    ctx.actor.save(ckpt / "actor")
    if ctx.critic is not None:
        ctx.critic.save(ckpt / "critic")
    torch.save(dev.rng_state(), ckpt / f"rng_rank{ctx.rank}.pt")
    dist.barrier()
    if ctx.rank == 0:
        state = {"next_step": step + 1, "sampler": ctx.sampler.state_dict(),
                 "kl_coef": getattr(ctx.kl_ctl, "value", None)}
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
        tmp = ctx.run_dir / "checkpoints" / f".{CKPT_LATEST}.tmp"
        tmp.write_text(ckpt.name)
        os.replace(tmp, ctx.run_dir / "checkpoints" / CKPT_LATEST)
    dist.barrier()


def load(ctx: Context, ckpt: Path) -> int:
    """Restore engines, sampler, KL and RNG state; returns the next step to run."""
    ctx.actor.load(ckpt / "actor")
    if ctx.critic is not None:
        ctx.critic.load(ckpt / "critic")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    ctx.sampler.load_state_dict(state["sampler"])
    if state.get("kl_coef") is not None and hasattr(ctx.kl_ctl, "value"):
        ctx.kl_ctl.value = state["kl_coef"]
    rng = ckpt / f"rng_rank{ctx.rank}.pt"
    if rng.is_file():
        dev.set_rng_state(torch.load(rng, weights_only=True))
    return int(state["next_step"])


def latest(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint of a run folder, or None."""
    marker = run_dir / "checkpoints" / CKPT_LATEST
    if not marker.is_file():
        return None
    ckpt = run_dir / "checkpoints" / marker.read_text().strip()
    return ckpt if ckpt.is_dir() else None
