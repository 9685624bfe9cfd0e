"""Checkpoints: engine state (sharded, every rank), data position, RNG and KL state.

A checkpoint is written into ``step_N.partial`` and renamed to ``step_N`` once every rank has
finished; ``checkpoints/latest`` names the newest complete one and is written last (atomically),
so a run killed or failing mid-save leaves no half-written step folder and resumes from the
previous checkpoint. Rank 0 also stores the metrics rows the checkpoint covers
(``metrics.jsonl`` inside it), from which ``--resume`` reconciles the run's metrics file.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .. import device as dev
from .context import Context

CKPT_LATEST = "latest"


def save(ctx: Context, step: int, rows: list[dict] | None = None) -> None:
    """Collective: every rank writes its shards. ``rows`` (rank 0): the metrics rows up to ``step``."""
    root = ctx.run_dir / "checkpoints"
    final = root / f"step_{step + 1:06d}"
    part = root / f"step_{step + 1:06d}.partial"
    ok = torch.tensor([1.0])
    error = ""
    try:
        if ctx.rank == 0 and part.exists():
            shutil.rmtree(part)
        dist.barrier()
        ctx.actor.save(part / "actor")
        if ctx.critic is not None:
            ctx.critic.save(part / "critic")
        torch.save(dev.rng_state(), part / f"rng_rank{ctx.rank}.pt")
    except OSError as e:
        ok[0], error = 0.0, f"{e.filename or part}: {e.strerror}"
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 0:
        if ctx.rank == 0:
            shutil.rmtree(part, ignore_errors=True)
        raise RuntimeError(f"checkpoint of step {step} failed ({error or 'on another rank'}); the previous "
                           f"checkpoint is intact (checkpoints/{CKPT_LATEST})")
    if ctx.rank == 0:
        state = {"next_step": step + 1, "sampler": ctx.sampler.state_dict(),
                 "kl_coef": ctx.kl_ctl.value}
        (part / "trainer_state.json").write_text(json.dumps(state))
        (part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows or [] if r["step"] <= step))
        if final.exists():
            shutil.rmtree(final)
        os.replace(part, final)
        tmp = root / f".{CKPT_LATEST}.tmp"
        tmp.write_text(final.name)
        os.replace(tmp, root / CKPT_LATEST)
    dist.barrier()


def load(ctx: Context, ckpt: Path) -> int:
    """Restore engines, sampler, KL and RNG state; returns the next step to run."""
    ctx.actor.load(ckpt / "actor")
    if ctx.critic is not None:
        ctx.critic.load(ckpt / "critic")
    state = trainer_state(ckpt)
    ctx.sampler.load_state_dict(state["sampler"])
    if state.get("kl_coef") is not None:
        ctx.kl_ctl.value = state["kl_coef"]
    rng = ckpt / f"rng_rank{ctx.rank}.pt"
    if rng.is_file():
        dev.set_rng_state(torch.load(rng, weights_only=True))
    return int(state["next_step"])


def trainer_state(ckpt: Path) -> dict:
    """``next_step``, the prompt sampler's position and the KL coefficient of a checkpoint."""
    return json.loads((ckpt / "trainer_state.json").read_text())


def latest(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint of a run folder, or None."""
    marker = run_dir / "checkpoints" / CKPT_LATEST
    if not marker.is_file():
        return None
    ckpt = run_dir / "checkpoints" / marker.read_text().strip()
    return ckpt if ckpt.is_dir() else None


def resume_problem(run_dir: Path) -> Optional[str]:
    """Why ``run_dir`` cannot resume from a checkpoint (None when it can)."""
    marker = run_dir / "checkpoints" / CKPT_LATEST
    if not marker.is_file():
        return (f"--resume {run_dir}: no complete checkpoint (checkpoints/{CKPT_LATEST} missing); set "
                "trainer.checkpoint_interval and run again")
    try:
        name = marker.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        return f"--resume {run_dir}: cannot read {marker} ({e})"
    ckpt = run_dir / "checkpoints" / name
    if not name or not ckpt.is_dir():
        return (f"--resume {run_dir}: {marker} points to {name or '(nothing)'}, which does not exist in "
                f"{run_dir / 'checkpoints'}; write the name of an existing step_N folder into it")
    if not (ckpt / "trainer_state.json").is_file():
        return f"--resume {run_dir}: {ckpt} has no trainer_state.json; it is not a complete checkpoint"
    return None


def covered_rows(ckpt: Path) -> list[dict]:
    """The metrics rows a checkpoint covers (empty for checkpoints written before rows were stored)."""
    f = ckpt / "metrics.jsonl"
    if not f.is_file():
        return []
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
