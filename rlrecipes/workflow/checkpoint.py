"""Checkpoints: engine state (sharded, every rank), data position, RNG and KL state.

A checkpoint is written into ``step_N.partial`` and renamed to ``step_N`` once every rank has
finished; ``checkpoints/latest`` names the newest complete one and is written last (atomically),
so a run killed or failing mid-save leaves no half-written step folder and resumes from the
previous checkpoint. Rank 0 also stores the metrics rows the checkpoint covers
(``metrics.jsonl`` inside it), from which ``--resume`` reconciles the run's metrics file.

Integrity: the last file written before the rename is ``manifest.json``, which holds every other
file of the folder (engine shards, ``base_model.json`` of a LoRA checkpoint, RNG states, trainer
state, metrics rows) with its size and SHA-256. The ranks hash the files between them (rank 0
lists them, each rank hashes its share, rank 0 writes the manifest). ``--resume`` checks the
manifest before anything is loaded (:func:`resume_problem`): a missing, truncated, altered or
unexpected file refuses the resume by name, with the command that resumes from the previous
checkpoint instead. A checkpoint written before manifests existed resumes with a notice that it
cannot be verified (its DCP shards are still checked against their own index for truncation); one
whose trainer state records a manifest (every save writes ``"manifest"`` there) and has none was
tampered with, and is refused like a damaged one.
A load that fails anyway names the damaged file (:func:`load`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import device as dev
from ..core.collectives import all_gather_objects, broadcast_object
from ..disk import no_space, no_space_message
from ..models.files import FileLoadError, reading, reason
from .context import Context

CKPT_LATEST = "latest"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "rlrecipes-checkpoint-manifest-v1"
HASH = "sha256"  # hashlib's fastest here with SHA-NI (1.1 GB/s per core); see docs/workflow.md
_CHUNK = 8 << 20


# ------------------------------------------------------------------------------------------- save
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
        if ctx.rank == 0:
            state = {"next_step": step + 1, "sampler": ctx.sampler.state_dict(), "kl_coef": ctx.kl_ctl.value,
                     "manifest": MANIFEST_FORMAT}  # a deleted manifest must not pass for an old checkpoint
            (part / "trainer_state.json").write_text(json.dumps(state))
            (part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows or [] if r["step"] <= step))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - e.g. DCP's CheckpointException: every rank stops, none hangs
        ok[0], error = 0.0, _save_error(e, part, step)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 0:
        _failed(ctx, part, step, error)
    error = _write_manifest(ctx, part, step + 1)  # collective: every file is complete (the all_reduce above)
    ok[0] = 0.0 if error else 1.0
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 0:
        _failed(ctx, part, step, error)
    if ctx.rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(part, final)
        tmp = root / f".{CKPT_LATEST}.tmp"
        tmp.write_text(final.name)
        os.replace(tmp, root / CKPT_LATEST)
    dist.barrier()


def _save_error(e: BaseException, part: Path, step: int) -> str:
    """What went wrong writing ``part``: a full disk said as one (torch's "unexpected pos" included)."""
    if no_space(e):
        return no_space_message(getattr(e, "filename", None) or part, f"the checkpoint of step {step}")
    if isinstance(e, OSError):
        return f"{e.filename or part}: {e.strerror}"
    return f"{part}: {reason(e)}"


def _failed(ctx: Context, part: Path, step: int, error: str) -> None:
    if ctx.rank == 0:
        shutil.rmtree(part, ignore_errors=True)
    raise RuntimeError(f"checkpoint of step {step} failed ({error or 'on another rank'}); the previous "
                       f"checkpoint is intact (checkpoints/{CKPT_LATEST})")


def _write_manifest(ctx: Context, part: Path, next_step: int) -> str:
    """Collective: rank 0 lists the folder's files, every rank hashes its share of them (the files
    it can see; on a shared file system, all), rank 0 hashes what no rank could and writes
    ``manifest.json``. Returns this rank's error ('' when none)."""
    names = broadcast_object(files_of(part) if ctx.rank == 0 else None, src=0, device=ctx.device)
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine: dict = {}
    error = ""
    try:
        mine = digests(part, [n for i, n in enumerate(names) if i % world == ctx.rank and (part / n).is_file()],
                       threads=1 if world > 1 else 4)
    except OSError as e:
        error = f"{e.filename or part}: {e.strerror}"
    every = all_gather_objects(mine, device=ctx.device)
    if ctx.rank != 0:
        return error
    try:
        entries = {k: v for d in every for k, v in d.items()}
        entries.update(digests(part, [n for n in names if n not in entries]))
        manifest = {"format": MANIFEST_FORMAT, "next_step": next_step, "hash": HASH,
                    "files": {n: entries[n] for n in names}}
        (part / MANIFEST).write_text(json.dumps(manifest, indent=1))
    except OSError as e:
        error = _save_error(e, part, next_step - 1)
    return error


def files_of(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative POSIX paths, sorted) except its own ``manifest.json``."""
    out = []
    for dirpath, _, files in os.walk(folder):
        for f in files:
            rel = (Path(dirpath) / f).relative_to(folder).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def file_digest(path: Path) -> str:
    """SHA-256 of a file, streamed in 8 MiB chunks (hashlib releases the GIL: threads hash in parallel)."""
    h = hashlib.new(HASH)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def digests(folder: Path, names: list[str], threads: int = 0) -> dict[str, dict]:
    """``name -> {"bytes": size, "sha256": digest}`` of files under ``folder`` (``threads``: 0 picks)."""
    def one(name: str) -> tuple[str, dict]:
        p = folder / name
        return name, {"bytes": p.stat().st_size, HASH: file_digest(p)}

    if not names:
        return {}
    threads = threads or max(1, min(8, os.cpu_count() or 1))
    if threads == 1 or len(names) == 1:
        return dict(map(one, names))
    with ThreadPoolExecutor(min(threads, len(names))) as pool:
        return dict(pool.map(one, names))


# ------------------------------------------------------------------------------------------- verify
def verify(ckpt: Path) -> Optional[list[str]]:
    """What is wrong with a checkpoint folder's files, one line per file naming it (empty: intact).
    None when it has no manifest (written before manifests existed): it cannot be verified."""
    f = ckpt / MANIFEST
    if not f.is_file():
        return None
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
        listed = {str(k): (int(v["bytes"]), str(v[HASH])) for k, v in m["files"].items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{MANIFEST}: damaged, it cannot say what the checkpoint holds ({reason(e)})"]
    problems: list[str] = []
    to_hash = []
    for name, (size, _) in listed.items():
        p = ckpt / name
        if not p.is_file():
            problems.append(f"{name}: missing (the manifest lists it, {size} bytes)")
            continue
        have = p.stat().st_size
        if have < size:
            problems.append(f"{name}: truncated ({have} of {size} bytes)")
        elif have > size:
            problems.append(f"{name}: changed after the save ({have} bytes, written with {size})")
        else:
            to_hash.append(name)
    for name, d in digests(ckpt, to_hash).items():
        if d[HASH] != listed[name][1]:
            problems.append(f"{name}: altered after the save (same size, its {HASH} differs from the manifest's)")
    for name in files_of(ckpt):
        if name not in listed:
            problems.append(f"{name}: not part of the checkpoint (the manifest does not list it); move it out "
                            "of the folder")
    return sorted(problems)


def truncated_shards(folder: Path) -> list[str]:
    """A DCP folder's shards that are missing or shorter than its ``.metadata`` index says (names
    relative to ``folder``); the check for checkpoints without a manifest. Empty when it is no DCP
    folder or its index cannot be read (the load itself then reports it)."""
    meta = folder / ".metadata"
    if not meta.is_file():
        return []
    try:
        from torch.distributed.checkpoint import FileSystemReader

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            storage = FileSystemReader(str(folder)).read_metadata().storage_data
        need: dict[str, int] = {}
        for info in storage.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception:  # noqa: BLE001 - an unreadable index is the load's to report
        return [".metadata: unreadable (the index of the shards)"]
    out = []
    for name, end in sorted(need.items()):
        p = folder / name
        if not p.is_file():
            out.append(f"{name}: missing")
        elif p.stat().st_size < end:
            out.append(f"{name}: truncated ({p.stat().st_size} of at least {end} bytes)")
    return out


def _legacy_problems(ckpt: Path) -> list[str]:
    """Truncated or missing DCP shards of a checkpoint without a manifest (names relative to ``ckpt``)."""
    out = []
    for sub in sorted(p for p in ckpt.iterdir() if p.is_dir()):
        out += [f"{sub.name}/{x}" for x in truncated_shards(sub)]
    return out


def older_fix(ckpt: Path) -> str:
    """What to do about a damaged checkpoint: resume from the newest older step folder (the
    command that does it), or, without one, restore the files or start again."""
    root = ckpt.parent
    older = sorted(p.name for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".partial")
                   and p.name < ckpt.name)
    if older:
        return (f"resume from the previous checkpoint instead: `echo {older[-1]} > {root / CKPT_LATEST}`, then "
                f"--resume again (the steps after it run again); or restore the files from a copy")
    return "restore the files from a copy; there is no older checkpoint, so otherwise start a new run"


def resume_problem(run_dir: Path, notice: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """Why ``run_dir`` cannot resume from a checkpoint (None when it can). Reads the checkpoint's
    files against its manifest; loads nothing and writes nothing. ``notice`` receives what the
    user should know without a refusal (a checkpoint that cannot be verified); None: a warning."""
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
    problems = verify(ckpt)
    if problems is None and _wrote_manifest(ckpt):
        problems = [f"{MANIFEST}: missing, but this checkpoint was written with one (its trainer_state.json says "
                    "so): its files cannot be verified, so it is not trusted"]
    if problems is None:
        problems = _legacy_problems(ckpt)
        if not problems:
            text = (f"checkpoint {ckpt} has no {MANIFEST} (written before checkpoints carried one): its files "
                    "cannot be verified, resuming from it as it is")
            if notice is not None:
                notice(text)
            else:
                warnings.warn(text, stacklevel=2)
            return None
    if not problems:
        return None
    lines = "\n".join(f"  - {ckpt / p}" for p in problems)
    fix = older_fix(ckpt)
    return (f"--resume {run_dir}: checkpoint {ckpt.name} is damaged; nothing was loaded or changed:\n{lines}\n"
            f"{fix[0].upper()}{fix[1:]}")


def _wrote_manifest(ckpt: Path) -> bool:
    """The checkpoint's trainer state records that its save wrote a manifest (every save since v1 does)."""
    try:
        return "manifest" in json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


# ------------------------------------------------------------------------------------------- load
def load(ctx: Context, ckpt: Path) -> int:
    """Restore engines, sampler, KL and RNG state; returns the next step to run. A file that fails
    to load is named (with what is wrong with it, when the manifest or the DCP index can tell)."""
    for role, engine in (("actor", ctx.actor), ("critic", ctx.critic)):
        if engine is None:
            continue
        try:
            engine.load(ckpt / role)
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException: re-raised
            # as an Exception naming the damaged file
            err = _load_error(ckpt, role, e)
            if err is e:
                raise
            raise err from e
    state = trainer_state(ckpt)
    ctx.sampler.load_state_dict(state["sampler"])
    if state.get("kl_coef") is not None:
        ctx.kl_ctl.value = state["kl_coef"]
    rng = ckpt / f"rng_rank{ctx.rank}.pt"
    if rng.is_file():
        with reading(rng, "checkpoint RNG state", older_fix(ckpt)):
            dev.set_rng_state(torch.load(rng, weights_only=True))
    return int(state["next_step"])


def _load_error(ckpt: Path, role: str, e: BaseException) -> BaseException:
    """The engine's load of ``ckpt/role`` raised ``e``: an error naming the damaged file (one line)."""
    folder = ckpt / role
    if str(folder) in str(e) and not _library_error(e):
        return e  # the engine's own message, already naming its file (e.g. base_model.json)
    problems = verify(ckpt)
    if problems is None:
        problems = [f"{role}/{x}" for x in truncated_shards(folder)]
    if problems:
        return FileLoadError(ckpt / problems[0].split(":", 1)[0], "checkpoint file",
                             f"{problems[0].split(': ', 1)[-1]} ({reason(e)})", older_fix(ckpt))
    return FileLoadError(folder, "checkpoint folder", reason(e), older_fix(ckpt))


def _library_error(e: BaseException) -> bool:
    return type(e).__module__.split(".")[0] in ("torch", "safetensors", "pickle", "zipfile")


def trainer_state(ckpt: Path) -> dict:
    """``next_step``, the prompt sampler's position and the KL coefficient of a checkpoint."""
    f = ckpt / "trainer_state.json"
    with reading(f, "checkpoint trainer state", older_fix(ckpt)):
        return json.loads(f.read_text(encoding="utf-8"))


def latest(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint of a run folder, or None."""
    marker = run_dir / "checkpoints" / CKPT_LATEST
    if not marker.is_file():
        return None
    ckpt = run_dir / "checkpoints" / marker.read_text().strip()
    return ckpt if ckpt.is_dir() else None


def covered_rows(ckpt: Path) -> list[dict]:
    """The metrics rows a checkpoint covers (empty for checkpoints written before rows were stored)."""
    f = ckpt / "metrics.jsonl"
    if not f.is_file():
        return []
    with reading(f, "checkpoint metrics rows", older_fix(ckpt)):
        return [json.loads(x) for x in f.read_text(encoding="utf-8").splitlines() if x.strip()]
