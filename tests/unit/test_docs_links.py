"""The project carries its own map: every relative link in README.md and docs/*.md points to a file
that exists, and no file cites a design document outside the project."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.M)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
# assembled here so that this file does not name it
OUTSIDE_DOC = re.compile("DESIGN" + r"(\.md|\s*§)")
SKIP_TOP = {".git", "runs", "build", "dist", "tmp"}
SKIP_ANY = {"__pycache__", ".pytest_cache", "node_modules"}


def relative_links(md: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every relative link or image (inline or reference style) outside code."""
    text = CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), md.read_text())
    out = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http:, mailto:, an anchor in the same page
        out.append((text.count("\n", 0, m.start()) + 1, target))
    return out


def broken_links(root: Path) -> list[str]:
    bad = []
    for md in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for line, target in relative_links(md):
            path = target.split("#", 1)[0]
            if path and not (md.parent / path).exists():
                bad.append(f"{md.relative_to(root)}:{line}: link to {target} (no such file)")
    return bad


def project_files(root: Path):
    for p in sorted(root.iterdir()):
        if p.name in SKIP_TOP or p.name.startswith((".venv", "venv")) or p.name.endswith(".egg-info"):
            continue
        yield from ([p] if p.is_file() else _walk(p))


def _walk(folder: Path):
    for p in sorted(folder.iterdir()):
        if p.is_dir():
            if p.name not in SKIP_ANY and not p.name.endswith(".egg-info"):
                yield from _walk(p)
        elif p.is_file() and p.stat().st_size < 2_000_000:
            yield p


def outside_citations(root: Path) -> list[str]:
    bad = []
    for f in project_files(root):
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for m in OUTSIDE_DOC.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{f.relative_to(root)}:{line}: cites {m.group(0)!r}, a document outside the project; "
                       "point to docs/architecture.md or the page in docs/ instead")
    return bad


def test_relative_links_in_readme_and_docs_resolve():
    bad = broken_links(REPO)
    assert not bad, "\n".join(bad)


def test_no_file_cites_a_document_outside_the_project():
    bad = outside_citations(REPO)
    assert not bad, "\n".join(bad)


def test_the_checks_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("[ok](docs/a.md) [gone](docs/missing.md#x) [web](https://x.org) "
                                        "`[no](code.md)`\n[ref]: docs/also_missing.md\n```\n[fenced](nope.md)\n```\n")
    (tmp_path / "docs" / "a.md").write_text("[back](../README.md) [anchor](#top) ![img](pic.png)\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text('"""See ' + "DESIGN" + '.md for why."""\n')
    (tmp_path / ".venv-x").mkdir()
    (tmp_path / ".venv-x" / "m.py").write_text("DESIGN" + ".md\n")
    assert broken_links(tmp_path) == ["README.md:1: link to docs/missing.md#x (no such file)",
                                      "README.md:2: link to docs/also_missing.md (no such file)",
                                      "docs/a.md:1: link to pic.png (no such file)"]
    found = outside_citations(tmp_path)
    assert len(found) == 1 and found[0].startswith("src/m.py:1: cites")
