"""Recipe loading: YAML with ``defaults:`` inheritance, typed ``a.b=value`` overrides, the recipe
registry (built-in ``recipes/`` and ``$RLRECIPES_PATH``), and error messages that name the file and key."""
from __future__ import annotations

import difflib
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .schema import Recipe, RecipeError

# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _key_lines(node, prefix: str, path: Path, out: dict[str, str]) -> None:
    """Record ``dotted.key -> file:line`` for every mapping key; a key given twice is an error."""
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for k, v in node.value:
        if not isinstance(k, yaml.ScalarNode):
            continue
        key, line = str(k.value), k.start_mark.line + 1
        dotted = f"{prefix}{key}"
        if key in seen:
            raise RecipeError(f"{path}:{line}: duplicate key `{dotted}` (first given on line {seen[key]}); YAML keeps "
                              "only the last one, which would silently replace the first: merge them into one")
        seen[key] = line
        out[dotted] = f"{path}:{line}"
        _key_lines(v, dotted + ".", path, out)


def load_yaml_tree(path: Path, _seen: tuple = (), origins: dict[str, str] | None = None) -> dict:
    """Load a YAML file and the files it names in ``defaults:`` (merged first, in order).

    ``origins`` (if given) receives ``dotted.key -> file:line`` of the file that set each key last.
    Duplicate keys in one mapping are an error naming both lines.
    """
    path = path.resolve()
    if path in _seen:
        raise RecipeError(f"{path}: `defaults` forms a cycle ({' -> '.join(p.name for p in _seen + (path,))})")
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file" + (" (it is a folder)" if path.is_dir() else ""))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text (byte {e.start}); is this a recipe YAML?") from None
    lines: dict[str, str] = {}
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                _key_lines(node, "", path, lines)
            data = loader.construct_document(node) if node is not None else {}
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise RecipeError(f"{path}{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: top level must be a mapping of sections (model:, data:, ...), "
                          f"not a {type(data).__name__}")
    defaults = data.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    merged: dict = {}
    for d in defaults:
        merged = _deep_merge(merged, load_yaml_tree(path.parent / d, _seen + (path,), origins))
    if origins is not None:
        origins.update({k: v for k, v in lines.items() if k != "defaults"})
    return _deep_merge(merged, data)


def _fields_at(loc: tuple) -> list[str]:
    """Valid field names at a location of the Recipe model tree (for 'did you mean')."""
    model: Any = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        for cand in getattr(ann, "__args__", ()) or (ann,):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                ann = cand
                break
        model = ann
    return list(getattr(model, "model_fields", {}))


def _origin(key: str, origins: dict[str, str], source: str) -> str:
    """Where ``key`` was set: an override, or the file:line that set it (or the deepest key under it)."""
    if key in origins:
        return origins[key]
    below = [k for k in origins if k.startswith(key + ".")]
    over = [k for k in below if origins[k].startswith("override")]
    if over or below:
        return origins[(over or below)[0]]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:n])
        if parent in origins:
            return origins[parent]
    return source


#: a dotted recipe key named in a validator's message (``trainer.global_batch=33 is not ...``)
_KEY_IN_TEXT = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)")


def _set_at(key: str, origins: dict[str, str]) -> str | None:
    """Where ``key`` itself (or the section above it, given as a whole) was set; None: a default."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        got = origins.get(".".join(parts[:n]))
        if got is not None:
            return got
    return None


def _named_origin(message: str, origins: dict[str, str]) -> str | None:
    """A cross-field validator's error belongs to the keys its message names: the overrides among
    them (the input the user just typed), else the file:line of the first one set in a file."""
    found = [o for o in (_set_at(k, origins) for k in dict.fromkeys(_KEY_IN_TEXT.findall(message))) if o]
    overrides = list(dict.fromkeys(o for o in found if o.startswith("override")))
    if overrides:
        return ", ".join(overrides)
    return found[0] if found else None


def _format_errors(err: ValidationError, source: str, origins: dict[str, str]) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-after")))
        key = ".".join(str(p) for p in loc) or "(top level)"
        named = _named_origin(e["msg"], origins) if e["type"] == "value_error" else None
        src = named or _origin(key, origins, source)
        if e["type"] == "value_error" and (named or not loc):  # a validator's sentence names its own keys
            lines.append(f"{src}: {e['msg'].removeprefix('Value error, ')}")
            continue
        if e["type"] == "extra_forbidden":
            choices = _fields_at(loc)
            close = difflib.get_close_matches(str(loc[-1]), choices, n=1)
            hint = f"; did you mean `{'.'.join(map(str, loc[:-1] + (close[0],)))}`?" if close else (
                f"; valid keys here: {', '.join(choices)}" if choices else "")
            lines.append(f"{src}: unknown key `{key}`{hint}")
        elif e["type"] == "missing":
            lines.append(f"{src}: missing required key `{key}`")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{src}: `{key}`: {e['msg']}{got_s}")
    return "\n".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is YAML-typed (1 -> int, true -> bool, [1,2] -> list)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected KEY=VALUE, e.g. trainer.steps=20")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise RecipeError(f"override {text!r}: empty key part; write dotted keys like actor.layout.tp=2")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str], origins: dict[str, str]) -> dict:
    data = _deep_merge({}, data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, p in enumerate(path[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            elif not isinstance(nxt, dict):
                raise RecipeError(f"override {text!r}: `{'.'.join(path[:i + 1])}` is a value, not a section")
            node = nxt
        node[path[-1]] = value
        key = ".".join(path)
        for stale in [k for k in origins if k.startswith(key + ".")]:  # replaced with the section
            del origins[stale]
        origins[key] = f"override `{text}`"
    return data


def recipe_roots() -> list[Path]:
    """Where registered recipes live: $RLRECIPES_PATH, the source checkout's recipes/, the wheel's copy."""
    roots: list[Path] = []
    for p in filter(None, os.environ.get("RLRECIPES_PATH", "").split(os.pathsep)):
        roots.append(Path(p))
    src = Path(__file__).resolve().parents[2] / "recipes"
    if src.is_dir():
        roots.append(src)
    try:
        packaged = Path(str(resources.files("rlrecipes") / "_recipes"))
        if packaged.is_dir():
            roots.append(packaged)
    except (ModuleNotFoundError, TypeError):  # pragma: no cover
        pass
    return roots


def registry() -> dict[str, Path]:
    """Registered recipe name -> folder (first root wins)."""
    found: dict[str, Path] = {}
    for root in recipe_roots():
        for d in sorted(root.iterdir()):
            if (d / "recipe.yaml").is_file() and d.name not in found:
                found[d.name] = d
    return found


def fresh_folder(near: Path, name: str = "my_recipe") -> Path:
    """A folder under ``near`` (a folder that exists) that does not exist yet: ``cp``'s destination."""
    for i in range(1, 1000):
        cand = near / (name if i == 1 else f"{name}_{i}")
        if not cand.exists():
            return cand
    return near / f"{name}_{os.getpid()}"


def _example(reg: dict[str, Path]) -> str:
    """The recipe named in examples: the small dense one when it is registered."""
    return "qwen25_7b" if "qwen25_7b" in reg or not reg else next(iter(reg))


def copy_hint(folder: Path) -> str:
    """The ``rlrecipes cp`` command that makes a runnable recipe for an existing folder that has none:
    ``cp`` refuses a destination that exists, so the hint names a new folder inside it."""
    dest = fresh_folder(folder)
    return (f"Copy a recipe into a new folder with `rlrecipes cp {_example(registry())} {dest}`, "
            f"then `rlrecipes run {dest} --smoke`")


def find_recipe(name_or_path: str) -> Path:
    """A recipe folder from a registered name or a path to a folder (or to a YAML file's folder)."""
    if not name_or_path.strip():
        reg = registry()
        raise RecipeError(f"no recipe given (the name is empty); pass a registered recipe "
                          f"({', '.join(reg) or 'none'}) or a path to a recipe folder, "
                          f"e.g. `rlrecipes run {_example(reg)} --smoke`")
    p = Path(name_or_path)
    if p.is_dir() and (p / "recipe.yaml").is_file():
        return p.resolve()
    if p.is_dir() and name_or_path not in registry():
        if not (p / "recipe.yaml").is_file():
            raise RecipeError(f"{p}: not a recipe folder (no recipe.yaml). {copy_hint(p)}")
        return p.resolve()
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p.resolve().parent
    reg = registry()
    if name_or_path in reg:
        return reg[name_or_path]
    close = difflib.get_close_matches(name_or_path, list(reg), n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    raise RecipeError(f"unknown recipe {name_or_path!r}: {hint}registered recipes: {', '.join(reg) or '(none)'}; "
                      "or pass a path to a recipe folder")


def load_recipe(name_or_path: str, *, smoke: bool = False, overrides: list[str] | None = None,
                file: str | None = None) -> Recipe:
    """Load, merge (defaults + overrides) and validate a recipe.

    ``file`` picks a YAML inside the folder; by default ``smoke.yaml`` with ``smoke=True``,
    otherwise ``recipe.yaml``. A path to a YAML file loads that file.
    """
    folder = find_recipe(name_or_path)
    p = Path(name_or_path)
    if file is None and p.suffix in (".yaml", ".yml") and p.is_file():
        yaml_path = p.resolve()
    else:
        yaml_path = folder / (file or ("smoke.yaml" if smoke else "recipe.yaml"))
    origins: dict[str, str] = {}
    data = load_yaml_tree(yaml_path, origins=origins)
    data = apply_overrides(data, list(overrides or []), origins)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, str(yaml_path), origins)) from None
    _lora_off_contradiction(data, origins, str(yaml_path))
    object.__setattr__(recipe, "_folder", folder)
    object.__setattr__(recipe, "_source", yaml_path)
    return recipe


def _lora_off_contradiction(data: dict, origins: dict[str, str], source: str) -> None:
    """``actor.lora.rank: 0`` given in so many words (LoRA off: every parameter trains) beside an explicit
    ``alpha`` or ``dropout`` is a contradiction, refused naming the keys. (``target_modules`` alone may
    stand beside rank 0: the smoke recipes list it for ``actor.lora.rank=8``, it does not imply rank.)"""
    lora = (data.get("actor") or {}).get("lora") if isinstance(data.get("actor"), dict) else None
    if not isinstance(lora, dict) or lora.get("rank", None) != 0:
        return
    given = [k for k in ("alpha", "dropout", "target_modules") if k in lora]
    if not [k for k in given if k != "target_modules"] and not _set_here("actor.lora.target_modules", origins):
        return
    where = ", ".join(dict.fromkeys(_origin(f"actor.lora.{k}", origins, source) for k in ["rank"] + given))
    keys = " and ".join(f"actor.lora.{k}" for k in given)
    raise RecipeError(f"{where}: actor.lora.rank=0 turns LoRA off (every parameter trains, {keys} unused), but "
                      f"{keys} {'is' if len(given) == 1 else 'are'} set; set actor.lora.rank=8 to train adapters, "
                      f"or drop {keys}")


def _set_here(key: str, origins: dict[str, str]) -> bool:
    """``key`` was given by an override (the input the user just typed), not by a recipe file."""
    return str(origins.get(key, "")).startswith("override")


def recipe_from_dict(data: dict, source: str, origins: dict[str, str] | None = None) -> Recipe:
    """Validate a merged recipe mapping (e.g. a run's config.yaml); errors name ``source`` and the key."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, source, origins or {})) from None


def resolve_path(recipe: Recipe, path: str) -> Path:
    """A path from a recipe, relative to its folder unless absolute."""
    p = Path(os.path.expanduser(path))
    if not p.is_absolute() and recipe.folder is not None:
        p = recipe.folder / p
    return p


def dump_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


