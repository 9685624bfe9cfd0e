"""Every file and folder a run reads or writes, checked in one pass before anything starts.

Each check returns problems as strings that name the path (and the recipe key it came from) and
say how to fix it; :func:`run_inputs` collects them all, so a user fixes everything at once
instead of one error per attempt. Nothing here writes.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

from .recipe import Recipe, resolve_path

#: files any one of which makes a folder a tokenizer (transformers' AutoTokenizer reads them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def writable_dir(path: Path, what: str) -> list[str]:
    """``path`` can become (or already is) a folder this process writes into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return [f"{what} {path} is a file, not a folder; pass a folder path"]
    probe = path
    while not probe.exists():
        parent = probe.parent
        if parent == probe:
            break
        probe = parent
    if probe.exists() and not probe.is_dir():
        return [f"{what} {path}: {probe} is a file, so the folder cannot be created; pass another path"]
    try:  # os.access says yes to root everywhere; creating a file is the real test (removed at once)
        fd, name = tempfile.mkstemp(prefix=".rlrecipes-probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return [f"{what} {path}: cannot create files in {probe} ({e.strerror}); pass a folder you can write"]
    return []


def writable_file(path: Path, what: str) -> list[str]:
    path = Path(path)
    if path.is_dir():
        return [f"{what} {path} is a folder; pass a file path (e.g. {path / 'report.png'})"]
    return writable_dir(path.parent, what)


def model_folder(path: str, key: str) -> list[str]:
    p = Path(os.path.expanduser(path))
    if not p.exists():
        return [f"{key}: {p} does not exist; pass a local HF model folder (config.json + *.safetensors). "
                "rlrecipes never downloads at run time: fetch the model first (e.g. `huggingface-cli download`)"]
    if not p.is_dir():
        return [f"{key}: {p} is a file; pass the folder that holds config.json and the *.safetensors"]
    if not (p / "config.json").is_file():
        return [f"{key}: {p} has no config.json, so it is not an HF model folder"]
    return []


def tokenizer_folder(path: str, key: str, hint: str = "") -> list[str]:
    p = Path(os.path.expanduser(path))
    if not p.exists():
        return [f"{key}: {p} does not exist; pass a folder with the tokenizer files ({', '.join(TOKENIZER_FILES[:2])})"]
    if not p.is_dir():
        return [f"{key}: {p} is a file; pass the folder that holds the tokenizer files"]
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        return [f"{key}: {p} holds no tokenizer ({' / '.join(TOKENIZER_FILES)}){hint}"]
    return []


def data_file(path: Path, key: str) -> list[str]:
    if not path.exists():
        return [f"{key}: {path} does not exist; fix the path (relative paths are relative to the recipe folder)"]
    if path.is_dir():
        return [f"{key}: {path} is a folder; list the JSONL / Parquet files in it, "
                f"e.g. {key}=[{path}/train.parquet]"]
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        return [f"{key}: {path}: unknown format {path.suffix!r}; use .jsonl or .parquet"]
    if path.stat().st_size == 0:
        return [f"{key}: {path} is empty"]
    return []


def run_inputs(recipe: Recipe, *, run_dir: Path, resume: Optional[Path]) -> list[str]:
    """Model, tokenizer, data files and the run folder of a run that is about to start."""
    problems: list[str] = []
    m = recipe.model
    if m.smoke is None:
        if not m.path:
            problems.append("model.path is not set; pass a local HF model folder (or run with --smoke)")
        else:
            problems += model_folder(m.path, "model.path")
        tok = m.tokenizer or m.path
        if tok and not problems:
            hint = ("; set model.tokenizer to the folder of the model's tokenizer" if not m.tokenizer else "")
            problems += tokenizer_folder(tok, "model.tokenizer" if m.tokenizer else "model.path", hint)
    else:
        if m.path:
            problems += model_folder(m.path, "model.path")
        if m.tokenizer:
            problems += tokenizer_folder(m.tokenizer, "model.tokenizer")
    for i, f in enumerate(recipe.data.train_files):
        problems += data_file(resolve_path(recipe, f), f"data.train_files[{i}]")
    from .loggers import missing as missing_loggers

    problems += missing_loggers(recipe.trainer.loggers)
    try:
        from .rewards import resolve_reward

        resolve_reward(recipe.reward.fn)
    except ValueError as e:
        problems.append(f"reward.fn: {e}")
    if resume is None:
        problems += writable_dir(run_dir, "--out")
        if not problems and run_dir.is_dir() and any(run_dir.iterdir()):
            problems.append(f"--out {run_dir} already holds a run; pick a new folder or continue it with "
                            f"--resume {run_dir}")
    else:
        problems += writable_dir(run_dir, "--resume")
    return problems


def read_json_object(path: Path, what: str) -> dict:
    """A JSON file whose top level must be an object; errors name the file, line and the fix."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a folder; pass the {what} file") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); is this the {what}?") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a JSON object, not {type(data).__name__}")
    return data
