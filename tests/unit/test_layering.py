"""Dependencies flow one way: cli -> workflow -> engines / core / algos / models -> device.

Every import in the package (module level or inside a function, absolute or relative) is
resolved to the top-level piece it names and checked against the layer table below. A piece may
import its own layer or lower ones, except where ``FORBIDDEN`` says otherwise.
"""
import ast
from pathlib import Path

import rlrecipes

ROOT = Path(rlrecipes.__file__).parent

LAYERS = {
    "cli": 5, "__main__": 5,
    "workflow": 4,
    "plan": 3, "cluster": 3, "baseline": 3, "inputs": 3,
    "recipe": 2,
    "engines": 1, "core": 1, "algos": 1, "models": 1, "rewards": 1, "data": 1, "metrics": 1, "loggers": 1,
    "agent": 1,
    "device": 0, "device_strict": 0, "disk": 0, "interrupts": 0, "hardware": 0, "__init__": 0,
}
# same-layer imports that are still not allowed (docs/architecture.md, "Layers")
FORBIDDEN = {
    "core": {"engines", "models", "algos", "rewards", "data", "workflow"},
    "algos": {"engines", "core", "models", "rewards", "data"},
    "models": {"engines", "algos", "rewards", "data"},
    "rewards": {"engines", "core", "models", "algos", "data"},
    "data": {"engines", "core", "models", "algos"},
    "metrics": {"engines", "core", "models", "algos", "rewards", "data"},
}
# the workflow sees engines only through their interface and registry
WORKFLOW_ENGINE_MODULES = {"rlrecipes.engines", "rlrecipes.engines.base", "rlrecipes.engines.registry"}


def _piece(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every rlrecipes import in ``path``."""
    pkg = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    if path.name == "__init__.py":
        pkg = pkg.rsplit(".", 1)[0] + ".__init__"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "rlrecipes"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:-node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "rlrecipes":
                out.append((node.lineno, mod))
                if len(mod.split(".")) <= 2:  # `from rlrecipes.engines import base`: the names are modules too
                    out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def violations() -> list[str]:
    bad = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        me = rel.parts[0].removesuffix(".py")
        for line, mod in _imports(f):
            them = _piece(mod)
            if them not in LAYERS:
                continue  # `from rlrecipes.engines import base` adds names that are not pieces
            where = f"rlrecipes/{rel}:{line} imports {mod}"
            if them == me:
                continue
            if LAYERS[them] > LAYERS[me]:
                bad.append(f"{where}: {me} (layer {LAYERS[me]}) may not import {them} (layer {LAYERS[them]})")
            elif them in FORBIDDEN.get(me, ()):
                bad.append(f"{where}: {me} may not import {them}")
        if me == "workflow":
            for line, mod in _imports(f):
                if _piece(mod) == "engines" and ".".join(mod.split(".")[:3]) not in WORKFLOW_ENGINE_MODULES:
                    bad.append(f"rlrecipes/{rel}:{line} imports {mod}: the workflow uses engines only through "
                               "engines.base and engines.registry")
    return bad


def test_dependencies_flow_one_way():
    bad = violations()
    assert not bad, "\n".join(bad)


def test_every_piece_has_a_layer():
    pieces = {p.name.removesuffix(".py") for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert pieces <= set(LAYERS), f"add these to LAYERS: {sorted(pieces - set(LAYERS))}"


def test_checker_catches_upward_and_backend_imports(tmp_path, monkeypatch):
    fake = tmp_path / "rlrecipes"
    (fake / "core").mkdir(parents=True)
    (fake / "workflow").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "core" / "__init__.py").write_text("")
    (fake / "core" / "x.py").write_text("from ..models import ModelDims\nfrom ..workflow import driver\n")
    (fake / "workflow" / "__init__.py").write_text("")
    (fake / "workflow" / "y.py").write_text("def f():\n    from ..engines.native.train import NativeTrainEngine\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    bad = violations()
    assert any("core may not import models" in b for b in bad)
    assert any("may not import workflow" in b for b in bad)
    assert any("only through engines.base" in b for b in bad)
