"""No import cycles anywhere in the package (next to ``test_layering.py``, which checks direction).

Every import statement of every module counts, at module level or inside a function, absolute or
relative: ``import a.b``, ``from . import x``, ``from .a import b``. ``from pkg import name`` imports
the module ``pkg.name`` when that is a module, and ``pkg`` itself when ``name`` is defined there (so a
package's ``__init__`` that imports its submodule, which imports a name back from the ``__init__``, is
a cycle). Importing ``pkg.sub`` is not counted as importing ``pkg``'s ``__init__``: Python runs it
first, but it finishes before ``pkg.sub`` starts unless ``pkg`` imports ``pkg.sub``, an edge this
graph already has. A cycle is a strongly connected component of more than one module, or a module
that imports itself.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import rlrecipes

ROOT = Path(rlrecipes.__file__).parent


def module_names(root: Path) -> dict[str, Path]:
    """``dotted name -> file`` of every module under the package folder ``root``."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = (root.name,) + f.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in modules:
            return ".".join(parts[:i])
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` of one of ``modules``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target:
                    out.append((node.lineno, target))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = package.split(".")
                if node.level - 1 >= len(up):
                    continue  # beyond the top-level package
                base = ".".join(up[: len(up) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            target = _known(base, modules)
            if target is None:
                continue
            names_a_module = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            out += [(node.lineno, m) for m in names_a_module]
            if target != base or len(names_a_module) < len(node.names):
                out.append((node.lineno, target))  # a name defined in `base` (or `base` is not a module itself)
    return out


def import_graph(root: Path) -> dict[str, dict[str, list[int]]]:
    """``importer -> imported -> [lines]`` between the modules of the package at ``root``."""
    modules = module_names(root)
    graph: dict[str, dict[str, list[int]]] = {m: defaultdict(list) for m in modules}
    for m, path in modules.items():
        for line, target in imports_of(m, path, modules):
            graph[m][target].append(line)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
    return comps


def cycles(root: Path) -> list[str]:
    """One message per cycle: its modules and the import lines that close it."""
    graph = import_graph(root)
    modules = module_names(root)
    out = []
    for comp in strongly_connected(graph):
        if len(comp) == 1 and comp[0] not in graph[comp[0]]:
            continue
        members = set(comp)
        edges = [f"    {modules[a].relative_to(root.parent)}:{','.join(map(str, sorted(lines)))} imports {b}"
                 for a in comp for b, lines in sorted(graph[a].items()) if b in members]
        out.append(f"cycle between {', '.join(comp)}:\n" + "\n".join(edges))
    return out


def test_no_import_cycles_in_the_package():
    found = cycles(ROOT)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(found)


def test_checker_finds_cycles_in_a_synthetic_package(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    # a package __init__ importing its submodule, which imports a name defined in the __init__
    (pkg / "sub" / "__init__.py").write_text("HELPER = 1\nfrom . import leaf  # noqa\n")
    (pkg / "sub" / "leaf.py").write_text("from . import HELPER\n")
    # two modules, one import inside a function, one absolute
    (pkg / "a.py").write_text("def f():\n    from .b import g\n    return g\n")
    (pkg / "b.py").write_text("import pkg.a\n\ndef g():\n    pass\n")
    # a module importing itself, and modules with no cycle
    (pkg / "selfish.py").write_text("from pkg import selfish\n")
    (pkg / "clean.py").write_text("from .sub import leaf\nfrom . import a\nimport os\n")
    found = cycles(pkg)
    assert len(found) == 3, found
    text = "\n".join(found)
    assert "cycle between pkg.sub, pkg.sub.leaf" in text
    assert "cycle between pkg.a, pkg.b" in text and "pkg/a.py:2 imports pkg.b" in text
    assert "cycle between pkg.selfish:" in text
    assert "clean" not in text


def test_a_package_importing_its_own_submodules_is_not_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\nfrom .b import B\n")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("class B: ...\n")
    assert cycles(pkg) == []
    assert dict(import_graph(pkg)["pkg"]) == {"pkg.a": [1], "pkg.b": [2]}
