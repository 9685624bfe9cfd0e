"""The wheel carries recipes/ as rlrecipes/_recipes, so an installed package finds them."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_wheel_ships_recipes_and_registry_finds_them(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info next to the sources it builds, and the
    # tree may be in use (CI installs the optional tiers from it while the tests run)
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "runs")
    for name in ("rlrecipes", "recipes"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "whl"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next((tmp_path / "whl").glob("rlrecipes-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    recipes = sorted(d.name for d in (ROOT / "recipes").iterdir() if (d / "recipe.yaml").is_file())
    assert {"qwen25_7b", "qwen3_moe_30b", "deepseek_r1_671b"} <= set(recipes)
    for recipe in recipes:
        for f in ("recipe.yaml", "smoke.yaml", "launch.sh", "baseline.json", "README.md"):
            assert f"rlrecipes/_recipes/{recipe}/{f}" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import rlrecipes.recipe as r; reg = r.registry(); "
            "print(sorted(reg)); print(all('_recipes' in str(p) for p in reg.values()))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines() == [str(recipes), "True"], res.stdout
