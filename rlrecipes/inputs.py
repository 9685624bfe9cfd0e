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

import yaml

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


DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def _flow(items: list[str]) -> str:
    """A YAML flow list the override parser reads back as these strings (quoted where YAML would not)."""
    out = []
    for s in items:
        plain = yaml.safe_load(f"[{s}]") == [s] if s else False
        out.append(s if plain else json.dumps(s))
    return "[" + ",".join(out) + "]"


def data_file(path: Path, key: str, files: Optional[list[str]] = None, index: int = 0) -> list[str]:
    """Problems of one train file; ``files`` (all of data.train_files) lets a folder's answer suggest the
    whole list with the folder replaced by the data files inside it (an override the loader accepts)."""
    if not path.exists():
        return [f"{key}: {path} does not exist; fix the path (relative paths are relative to the recipe folder)"]
    if path.is_dir():
        inside = sorted(str(p) for p in path.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES)
        if not inside:
            return [f"{key}: {path} is a folder with no data files in it ({' / '.join(DATA_SUFFIXES)}); "
                    "list the JSONL / Parquet files to train on in data.train_files"]
        new = list(files or [str(path)])
        new[index:index + 1] = inside
        return [f"{key}: {path} is a folder; list the data files in it instead: data.train_files={_flow(new)}"]
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
        problems += data_file(resolve_path(recipe, f), f"data.train_files[{i}]", recipe.data.train_files, i)
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


# --------------------------------------------------------------------------------------------- dry runs
#: options of `rlrecipes run` that take a value (the rest are flags)
_RUN_VALUE_OPTIONS = {"--nodes", "-n", "--devices-per-node", "-d", "--steps", "--out", "--resume", "--address"}
#: recipe keys whose override values are paths: folders (model) or files (data, relative to the recipe folder)
_PATH_KEYS = {"model.path": "folder", "model.tokenizer": "folder", "data.train_files": "files"}


def executable_problem(name: str) -> list[str]:
    """``name`` (a command's first word) runs here: a path to an executable file, or a command on PATH."""
    import shutil

    if os.sep in name:
        p = Path(name)
        if not p.is_file():
            return [f"{p} does not exist"]
        if not os.access(p, os.X_OK):
            return [f"{p} is not executable (chmod +x {p})"]
        return []
    if shutil.which(name) is None:
        return [f"`{name}` is not on PATH here; install it in this environment or put it on PATH"]
    return []


def run_args_problems(recipe: Optional[str], args: list[str]) -> list[str]:
    """The paths in `rlrecipes run` arguments that must exist: the recipe, ``--resume``, path-valued
    overrides (model.path, model.tokenizer, data.train_files); ``--out`` must be creatable."""
    from .recipe import RecipeError, find_recipe, parse_override

    problems: list[str] = []
    folder: Optional[Path] = None
    if recipe is not None:
        try:
            folder = find_recipe(recipe)
        except RecipeError as e:
            problems.append(str(e))
    i = 0
    while i < len(args):
        a = args[i]
        opt, eq, inline = a.partition("=") if a.startswith("--") else (a, "", "")
        if opt in _RUN_VALUE_OPTIONS:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if eq else 2
            if opt == "--resume":
                p = Path(os.path.expanduser(value))
                if not (p / "config.yaml").is_file():
                    problems.append(f"--resume {p}: " + ("does not exist" if not p.exists() else
                                                          "not a run folder (no config.yaml)"))
            elif opt == "--out":
                problems += writable_dir(Path(os.path.expanduser(value)), "--out")
            continue
        i += 1
        if a.startswith("-") or "=" not in a:
            continue
        try:
            path, value = parse_override(a)
        except RecipeError:
            continue  # the run itself names a malformed override
        key = ".".join(path)
        kind = _PATH_KEYS.get(key)
        if kind is None or value in (None, ""):
            continue
        values = value if isinstance(value, list) else [value]
        for v in values:
            if kind == "folder":
                p = Path(os.path.expanduser(str(v)))
                if not p.is_dir():
                    why = "is a file, not a folder" if p.exists() else "does not exist"
                    problems.append(f"{key}={v}: {p} {why}")
            else:
                p = Path(os.path.expanduser(str(v)))
                if not p.is_absolute() and folder is not None:
                    p = folder / p
                if not p.is_file():
                    problems.append(f"{key}: {p} does not exist (relative paths are relative to the recipe folder)")
    return problems


def _launch_source() -> Path:
    """A registered recipe's launch.sh (the same few lines in every recipe), to copy into a folder."""
    from .recipe.loading import registry

    for folder in registry().values():
        if (folder / "launch.sh").is_file():
            return folder / "launch.sh"
    return Path("recipes/qwen25_7b/launch.sh")


def command_problems(argv: list[str]) -> list[str]:
    """What a printed command names that is not there (and that the command itself would not
    create): the executable, a script it runs, and the paths in `rlrecipes run` arguments (also
    those a recipe's launch.sh passes through). Empty when everything it names exists."""
    if not argv:
        return []
    problems = executable_problem(argv[0])
    rest = argv[1:]
    name = Path(argv[0]).name
    if name in ("bash", "sh") and rest and not rest[0].startswith("-"):
        script = Path(os.path.expanduser(rest[0]))
        if not script.is_file():
            problems.append(f"{script} does not exist" + (f" (a recipe folder made by hand has no launch.sh: copy a "
                                                           f"recipe's with `cp {_launch_source()} {script}`)"
                                                           if script.name == "launch.sh" else ""))
            return problems
        if script.name == "launch.sh":  # `rlrecipes launch <its folder> ARGS`: the ARGS go to `rlrecipes run`
            problems += run_args_problems(str(script.parent), rest[1:])
        return problems
    if name.startswith("python") and rest[:2] == ["-m", "rlrecipes"]:
        rest = rest[2:]
    elif name != "rlrecipes":
        return problems
    if rest[:1] == ["run"]:
        recipe = rest[1] if len(rest) > 1 and not rest[1].startswith("-") else None
        problems += run_args_problems(recipe, rest[2:] if recipe is not None else rest[1:])
    return problems
