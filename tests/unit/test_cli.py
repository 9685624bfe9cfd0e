"""The CLI through typer's CliRunner (in-process) and as the installed console script."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlrecipes.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args))


def test_list_shows_recipes_and_baselines():
    res = invoke("list", "--json")
    assert res.exit_code == 0, res.output
    rows = {r["recipe"]: r for r in json.loads(res.output)}
    assert set(rows) >= {"qwen25_7b", "qwen3_moe_30b", "deepseek_r1_671b"}
    assert rows["qwen25_7b"]["tps_per_card"]["atlas-a3"] == 440
    assert rows["deepseek_r1_671b"]["algorithm"] == "grpo"


def test_show_resolved_with_override():
    res = invoke("show", "qwen25_7b", "--smoke", "--resolved", "trainer.steps=3")
    assert res.exit_code == 0, res.output
    assert "steps: 3" in res.output and "family: qwen2" in res.output


def test_plan_json_and_exit_codes():
    res = invoke("plan", "deepseek_r1_671b", "--nodes", "48", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["ok"] and data["roles"]["actor"]["dp"] == 24
    res = invoke("plan", "deepseek_r1_671b", "--nodes", "3")
    assert res.exit_code == 1
    assert "TP*PP divides the world" in res.output and "nearest valid node counts: 16" in res.output


def test_bad_input_is_a_message_not_a_traceback():
    for args in (["plan", "qwen25_7b", "trainer.steps=abc"], ["show", "nope"], ["plan", "qwen25_7b", "x.y=1"]):
        res = invoke(*args)
        assert res.exit_code == 2, res.output
        assert "Traceback" not in res.output


def test_cp_refuses_overwrite_and_copy_runs(tmp_path: Path):
    dest = tmp_path / "my_recipe"
    res = invoke("cp", "qwen3_moe_30b", str(dest))
    assert res.exit_code == 0, res.output
    assert (dest / "recipe.yaml").is_file() and (dest / "launch.sh").is_file()
    res = invoke("cp", "qwen3_moe_30b", str(dest))
    assert res.exit_code == 2 and "refusing to overwrite" in res.output
    # edit the copy, then dry-run it: the copy is what runs
    text = (dest / "recipe.yaml").read_text().replace("steps: 100", "steps: 7")
    (dest / "recipe.yaml").write_text(text)
    res = invoke("run", str(dest), "--dry-run", "--nodes", "2")
    assert res.exit_code == 0, res.output
    assert "launch commands" in res.output and str(dest / "launch.sh") in res.output.replace("\n", "")
    res = invoke("show", str(dest), "--resolved")
    assert "steps: 7" in res.output


def test_run_dry_run_impossible_layout_fails_before_anything():
    res = invoke("run", "deepseek_r1_671b", "--nodes", "3", "--dry-run")
    assert res.exit_code == 1 and "rule(s) violated" in res.output  # the exit code `plan` gives it


@pytest.mark.skipif(shutil.which("rlrecipes") is None, reason="console script not installed")
def test_console_script_subprocess():
    out = subprocess.run(["rlrecipes", "plan", "qwen25_7b", "--smoke", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"]
    out = subprocess.run([sys.executable, "-m", "rlrecipes", "list"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "deepseek_r1_671b" in out.stdout
    bad = subprocess.run(["rlrecipes", "run", "qwen25_7b", "--smoke", "trainer.steps=-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "trainer.steps" in bad.stderr and "Traceback" not in bad.stderr


def test_run_without_cluster_says_how_to_start_one():
    res = runner.invoke(app, ["run", "qwen25_7b", "--smoke", "--address", "127.0.0.1:9"])
    assert res.exit_code == 2, res.output
    assert "no Ray cluster" in res.output and "launch.sh" in res.output and "NNODES=1" in res.output


def test_run_refuses_engines_that_cannot_run_here_before_connecting():
    res = runner.invoke(app, ["run", "qwen25_7b"], env={"RAY_ADDRESS": "127.0.0.1:9"})
    assert res.exit_code == 2 and "cannot run here" in res.output and "no Ray cluster" not in res.output
