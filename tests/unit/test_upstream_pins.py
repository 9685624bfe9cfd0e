"""The pins in pyproject.toml stay within the upstream versions docs/upstream_contracts.md was checked
against: moving a pin past them means reading the new source and updating that document first."""
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "upstream_contracts.md"


def read_lines() -> dict[str, str]:
    """package -> newest release line read (``major.minor``), from the doc's pin table."""
    text = DOC.read_text()
    table = text.split("<!-- pins:", 1)[1]
    out = {}
    for line in table.splitlines()[1:]:
        if not line.startswith("|"):
            if out:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("package", "---") or set(cells[0]) <= {"-"}:
            continue
        out[cells[0]] = cells[1]
    return out


def requirements() -> list[tuple[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra, items in project.get("optional-dependencies", {}).items():
        reqs += [(f"extra {extra!r}", Requirement(r)) for r in items]
    return reqs


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_table_is_read():
    lines = read_lines()
    assert {"ray", "vllm", "vllm-ascend", "megatron-core", "torch-npu"} <= set(lines), lines
    for line in lines.values():
        assert re.fullmatch(r"\d+\.\d+", line), line


@pytest.mark.parametrize("where, req", requirements(), ids=lambda x: str(x))
def test_no_pin_admits_a_release_line_past_what_was_read(where, req):
    lines = {canon(k): v for k, v in read_lines().items()}
    line = lines.get(canon(req.name))
    if line is None:
        return  # not an upstream the contracts cover
    major, minor = (int(x) for x in line.split("."))
    nxt = Version(f"{major}.{minor + 1}.0")
    assert not req.specifier.contains(nxt, prereleases=True), (
        f"pyproject.toml {where}: `{req}` admits {req.name} {nxt}, past {line}, the newest release line "
        f"docs/upstream_contracts.md was checked against; read the new source and update the document, "
        f"or bound the pin (<{nxt})")


def test_the_check_catches_an_unbounded_pin():
    req = Requirement("megatron-core>=0.16")
    assert req.specifier.contains(Version("0.20.0"))
