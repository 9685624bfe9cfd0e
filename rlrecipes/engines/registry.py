"""Engine names used in recipes (``actor.engine``, ``rollout.engine``) -> backends, loaded lazily.

Each backend package (``engines/<name>/__init__.py``) declares, without importing its heavy
dependencies:

* ``CAPABILITIES`` — a :class:`~rlrecipes.engines.base.Capabilities`;
* ``TRAIN`` / ``ROLLOUT`` — ``"module:Class"`` of its train / rollout engine, or None;
* ``CRITIC`` — ``"module:Class"`` of the train engine it builds for the ``critic`` role (PPO's
  value model), or None when it trains no critic (``Capabilities.critic`` says the same to ``plan``).

Every engine is built by its class's ``create(spec)`` (``engines/base.py``), the critic too.

``problems(name, role, device)`` is what ``plan`` reports before anything is placed: an unknown
name, a backend that is declared but not complete, a role or device it does not serve, or a
package that is not installed (with the command that installs it). ``plan`` on a laptop still
prints the layout; ``run`` refuses while any problem remains.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
from types import ModuleType
from typing import Callable, Optional

from .base import Capabilities, EngineSpec, RolloutEngine, TrainEngine

BACKENDS: dict[str, str] = {
    "native": "rlrecipes.engines.native",
    "vllm": "rlrecipes.engines.vllm",
    "megatron": "rlrecipes.engines.megatron",
}


class EngineError(ValueError):
    """An engine cannot serve a role here (not registered, not written, not installed, wrong device)."""


def _package(name: str) -> ModuleType:
    if name not in BACKENDS:
        close = difflib.get_close_matches(name, BACKENDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise EngineError(f"unknown engine {name!r}: choose one of {', '.join(BACKENDS)}{hint}")
    return importlib.import_module(BACKENDS[name])


def capabilities(name: str) -> Capabilities:
    return _package(name).CAPABILITIES


def engines_that(predicate: Callable[[Capabilities], bool]) -> list[str]:
    """Names of the complete backends whose capabilities satisfy ``predicate`` (for messages that
    name the engines that would do: ``plan`` never hard-codes an engine name)."""
    return [name for name in BACKENDS if capabilities(name).implemented and predicate(capabilities(name))]


def _hook(spec: str) -> Callable:
    module, fn = spec.split(":")
    return getattr(importlib.import_module(module), fn)


def missing_modules(name: str, device: str) -> list[str]:
    """Modules the backend needs on ``device`` that do not import here (checked without importing)."""
    caps = capabilities(name)
    need = list(caps.requires) + [m for d, mods in caps.requires_by_device if d == device for m in mods]
    return [m for m in need if not _importable(m)]


def _importable(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (a dotted name whose parent package is
    missing counts as missing: find_spec raises there instead of answering None)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def problems(name: str, role: str, device: str | None = None, *, installed: bool = True) -> list[str]:
    """Why ``name`` cannot serve ``role`` ("train" or "rollout") on ``device``; empty when it can.

    ``installed=False`` skips the installed-package check (``plan`` for another machine)."""
    try:
        caps = capabilities(name)
    except EngineError as e:
        return [str(e)]
    out = []
    if not caps.implemented:
        what = f" ({caps.status})" if caps.status else ""
        out.append(f"engine {name!r} is not complete in this release{what}; use the native engine")
    if role not in caps.roles:
        out.append(f"engine {name!r} has no {role} engine (it serves: {', '.join(sorted(caps.roles))})")
    if device is not None and device != "auto" and device not in caps.devices:
        out.append(f"engine {name!r} does not run on {device} (it runs on: {', '.join(caps.devices)})")
    if installed and caps.implemented and device is not None:
        miss = missing_modules(name, device)
        if miss:
            out.append(f"engine {name!r} needs {', '.join(miss)}, not installed here: {caps.install}")
    return out


def layout_problems(name: str, *, layout, dims, etp: int | None = None, device: str, installed: bool = False,
                    recipe=None) -> list[str]:
    """The engine's own rules for one role's layout (``Capabilities.layout_rules``); empty when it
    declares none. ``layout``: the role's :class:`~rlrecipes.core.parallel.ParallelLayout` (its sizes,
    layer split and the devices of its group); ``installed``: whether to judge with what is installed
    here (``plan`` for another machine passes False); ``recipe``: the recipe, for the role's other
    settings an engine's rules read (offload, inference settings)."""
    rules = capabilities(name).layout_rules
    if not rules:
        return []
    return list(_hook(rules)(layout=layout, dims=dims, etp=int(etp) if etp else None, device=device,
                             installed=installed, recipe=recipe))


def inference_settings(name: str, *, inference, dims) -> tuple[Optional[dict], list[str]]:
    """The engine's rendering of ``rollout.inference`` (``Capabilities.inference_settings``) and the
    settings its target cannot serve; ``(None, [])`` when it declares no renderer."""
    hook = capabilities(name).inference_settings
    if not hook:
        return None, []
    rendered, found = _hook(hook)(inference=inference, dims=dims)
    return rendered, list(found)


_CLASS_OF = {"train": "TRAIN", "critic": "CRITIC", "rollout": "ROLLOUT"}


def engine_class(name: str, role: str) -> type:
    """The class backend ``name`` builds for ``role``: ``"train"`` (actor, ref), ``"critic"`` or
    ``"rollout"``. Raises :class:`EngineError` naming what is missing."""
    pkg = _package(name)
    path = getattr(pkg, _CLASS_OF[role], None)
    found = problems(name, "rollout" if role == "rollout" else "train", None, installed=False)
    if path is None or found:
        what = "trains no critic (value model)" if role == "critic" else f"has no {role} engine"
        raise EngineError("; ".join(found) or f"engine {name!r} {what}")
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def build_train_engine(name: str, spec: EngineSpec) -> TrainEngine:
    """The backend's train engine for ``spec.role``: its ``TRAIN`` class for actor and ref, its
    ``CRITIC`` class for the critic."""
    return engine_class(name, "critic" if spec.role == "critic" else "train").create(spec)


def build_rollout_engine(name: str, spec: EngineSpec) -> RolloutEngine:
    return engine_class(name, "rollout").create(spec)


__all__ = ["BACKENDS", "EngineError", "build_rollout_engine", "build_train_engine", "capabilities", "engine_class",
           "engines_that", "inference_settings", "layout_problems", "missing_modules", "problems"]
