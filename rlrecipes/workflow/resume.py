"""Continuing a run (``--resume``): which keys may change, the run's own ``config.yaml`` read
back, its ``metrics.jsonl`` reconciled with the checkpoint it continues from, and the one line a
Ctrl-C ends a run with."""
from __future__ import annotations

from pathlib import Path

import yaml

from ..recipe import Recipe
from . import checkpoint
from .events import RunError


#: what may change when a run continues (--resume): its length and its bookkeeping, not what it trains
RESUMABLE_KEYS = ("trainer.steps", "trainer.checkpoint_interval", "trainer.export_hf", "trainer.dock_timeout_s",
                  "trainer.loggers")


def resumed_recipe(run_dir: Path, overrides: list[str]) -> Recipe:
    """The run's own config.yaml plus the overrides a resume may change; anything else is refused."""
    from ..recipe import RecipeError, apply_overrides, parse_override, recipe_from_dict

    if not (run_dir / "config.yaml").is_file():
        raise RunError(f"--resume {run_dir}: not a run folder (no config.yaml); pass the folder a previous "
                       "`rlrecipes run` printed")
    refused = []
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if key not in RESUMABLE_KEYS:
            refused.append(text)
    if refused:
        raise RunError(f"--resume continues the run as its config.yaml says; it cannot change "
                       f"{', '.join(f'`{t}`' for t in refused)}. It takes only {', '.join(RESUMABLE_KEYS)}; "
                       "start a new run (with --out) to change anything else")
    cfg = run_dir / "config.yaml"
    try:
        saved = yaml.safe_load(cfg.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        raise RunError(f"{cfg}{f':{mark.line + 1}' if mark else ''}: damaged, not valid YAML "
                       f"({getattr(e, 'problem', e)}); restore it from a copy, or start a new run") from None
    if not isinstance(saved, dict):
        raise RunError(f"{cfg}: damaged (top level is not a mapping); restore it, or start a new run")
    origins: dict[str, str] = {}
    try:
        return recipe_from_dict(apply_overrides(saved, overrides, origins), str(cfg), origins)
    except RecipeError as e:
        raise RunError(f"--resume {run_dir}: its config.yaml does not validate:\n{e}") from None


def reconcile_rows(run_dir: Path, ckpt: Path, start: int) -> tuple[list[dict], list[str]]:
    """metrics.jsonl as the checkpoint says it should be: rows before ``start`` (from the file, or
    re-emitted from the checkpoint's own copy), nothing from ``start`` on. Returns the rows and notes."""
    from ..baseline import BaselineError, read_metrics

    f = run_dir / "metrics.jsonl"
    notes: list[str] = []
    have: list[dict] = []
    if f.is_file():
        try:
            have = read_metrics(run_dir, allow_partial_last=True)
        except BaselineError as e:
            raise RunError(f"{e}; fix or remove that line, then --resume again") from None
        text = f.read_bytes()
        if text and not text.endswith(b"\n"):
            notes.append("dropped a half-written last line (the run was stopped mid-write)")
    covered = {r["step"]: r for r in checkpoint.covered_rows(ckpt)}
    kept = {r["step"]: r for r in have if r["step"] < start}
    missing = sorted(s for s in covered if s not in kept and s < start)
    extra = sorted(r["step"] for r in have if r["step"] >= start)
    for s in missing:
        kept[s] = covered[s]
    if missing:
        notes.append(f"re-emitted rows of steps {_span(missing)} from checkpoint {ckpt.name}")
    if extra:
        notes.append(f"dropped rows of steps {_span(extra)}, which come after checkpoint {ckpt.name} and run again")
    return [kept[s] for s in sorted(kept)], notes


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def interrupted_message(run_dir: Path, resume: str) -> str:
    """The one line Ctrl-C ends a run with: where to continue from, when a checkpoint exists."""
    last = checkpoint.latest(run_dir)
    if last is None:
        return f"interrupted; {run_dir} has no checkpoint to continue from (trainer.checkpoint_interval)"
    return f"interrupted; continue from its last checkpoint ({last.name}) with: {resume}"
