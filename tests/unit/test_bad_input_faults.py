"""Bad input and faults from the second new-user trial (issue 45, item 6): each answer names the
file, key or line, and the fix it suggests is itself valid input (run here through the real CLI,
override parser or planner), or the input is refused. Part of the bad-input suite with
test_bad_input.py and test_unclear_errors.py."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlrecipes.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def invoke(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res, " ".join(res.output.split())  # stdout and stderr together


def commands(message: str) -> list[list[str]]:
    """The `rlrecipes ...` commands a message suggests, in backticks."""
    return [shlex.split(c)[1:] for c in re.findall(r"`(rlrecipes [^`]+)`", message)]


# ================================================================================ 1. not a recipe folder
@pytest.mark.parametrize("given", ["", ".", "here", "here/mine"], ids=["empty", "dot", "folder", "nested"])
def test_a_not_a_recipe_folder_answer_suggests_commands_that_work(tmp_path, monkeypatch, given):
    """`rlrecipes run ''` used to suggest `rlrecipes cp <recipe> .`, refused because `.` exists."""
    monkeypatch.chdir(tmp_path)
    for d in ("here/mine", "here/my_recipe"):  # the obvious destination is taken: the hint picks another
        (tmp_path / d).mkdir(parents=True)
    res, out = invoke("run", given, "--smoke")
    assert res.exit_code == 2 and "Traceback" not in out, out
    cmds = commands(out)
    assert cmds, f"no command suggested: {out}"
    for argv in cmds:
        if argv[0] == "run":  # check the recipe it names without running it
            argv = ["plan", *argv[1:]]
        res2, out2 = invoke(*argv)
        assert res2.exit_code == 0, f"the suggested `rlrecipes {' '.join(argv)}` fails: {out2}\n(from: {out})"


# ================================================================================ 2. a smoke run's model.path
@pytest.mark.parametrize("cmd", ["run", "plan"])
@pytest.mark.parametrize("what", ["missing", "no-config"])
def test_a_smoke_run_with_a_model_path_that_is_not_there_names_the_path(tmp_path, cmd, what):
    """It used to be planned as the recipe's real preset and refused for memory (104.7 GiB > 4 GiB)."""
    path = tmp_path / "nope"
    if what == "no-config":
        path.mkdir()
    res, out = invoke(cmd, "qwen25_7b", "--smoke", f"model.path={path}", "--out", tmp_path / "o") if cmd == "run" \
        else invoke(cmd, "qwen25_7b", "--smoke", f"model.path={path}")
    assert res.exit_code != 0 and "Traceback" not in out, out
    assert f"model.path: {path}" in out and "GiB" not in out, out
    assert "model.path=null" in out, out  # the fix, itself valid: the smoke model then plans OK
    res2, out2 = invoke("plan", "qwen25_7b", "--smoke", f"model.path={path}", "model.path=null")
    assert res2.exit_code == 0 and "plan OK" in out2, out2


# ================================================================================ 3. a folder as a train file
def test_a_folder_given_as_a_train_file_suggests_the_files_in_it_as_a_valid_override(tmp_path):
    """It used to suggest `data.train_files[0]=[<folder>/train.parquet]`: an unknown key, and a file that
    is not there."""
    from rlrecipes.inputs import run_inputs
    from rlrecipes.recipe import load_recipe

    folder = tmp_path / "my data"  # a space: the suggestion must quote what YAML would split
    folder.mkdir()
    for name in ("b.jsonl", "a.jsonl"):
        (folder / name).write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (folder / "notes.txt").write_text("not data")
    other = tmp_path / "more.jsonl"
    other.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    given = f"data.train_files=[{other},'{folder}']"
    res, out = invoke("run", "qwen25_7b", "--smoke", "data.synthetic=null", given, "--out", tmp_path / "o")
    assert res.exit_code == 2 and "data.train_files[1]" in out and "is a folder" in out, out
    fix = re.search(r"(data\.train_files=\[.*?\])(?:\s|$)", res.output)
    assert fix, out
    r = load_recipe("qwen25_7b", smoke=True, overrides=["data.synthetic=null", given, fix[1]])  # valid syntax
    assert [Path(f) for f in r.data.train_files] == [other, folder / "a.jsonl", folder / "b.jsonl"]
    assert run_inputs(r, run_dir=tmp_path / "o", resume=None) == []


def test_a_folder_without_data_files_is_refused_without_a_made_up_file(tmp_path):
    (tmp_path / "d").mkdir()
    res, out = invoke("run", "qwen25_7b", "--smoke", "data.synthetic=null", f"data.train_files=[{tmp_path / 'd'}]",
                      "--out", tmp_path / "o")
    assert res.exit_code == 2 and "no data files" in out and "train.parquet" not in out, out


# ================================================================================ 4. a tool format the smoke tokenizer cannot render
def test_plan_refuses_a_tool_format_the_smoke_tokenizer_cannot_render():
    """`plan` said OK ("tokenizer folder None is not on this machine") and the run failed at worker setup.
    (test_unclear_errors.py checks that the suggested fix resolves it.)"""
    args = ("qwen25_7b", "--smoke", "rollout.multi_turn.enabled=true", "rollout.multi_turn.tool_format=qwen")
    res, out = invoke("plan", *args)
    assert res.exit_code == 1 and "plan OK" not in out and "not on this machine" not in out, out
    assert "rollout.multi_turn.tool_format=qwen" in out and "set rollout.multi_turn.tool_format=smoke" in out, out
    res, out = invoke("run", *args, "--out", "/nonexistent-never-created")
    assert res.exit_code != 0 and "rollout.multi_turn.tool_format=qwen" in out, out


# ================================================================================ 5. LoRA settings PEFT lets pass
def test_lora_rank_0_beside_alpha_and_targets_is_refused_naming_the_keys():
    """It trained every parameter and said nothing. (The suggested rank is checked in test_unclear_errors.)"""
    res, out = invoke("plan", "qwen25_7b", "--smoke", "actor.lora.rank=0", "actor.lora.alpha=32",
                      "actor.lora.target_modules=[q_proj]")
    assert res.exit_code == 2 and "Traceback" not in out, out
    for key in ("actor.lora.rank=0", "actor.lora.alpha", "actor.lora.target_modules", "set actor.lora.rank=8"):
        assert key in out, (key, out)
    # the smoke recipes list target_modules for `actor.lora.rank=8`: rank 0 left alone beside them stays valid
    assert invoke("plan", "qwen25_7b", "--smoke")[0].exit_code == 0


def test_a_misspelled_lora_target_is_refused_with_the_familys_names_and_a_fix_that_plans():
    """`qproj` was kept silently and only the other targets got adapters."""
    res, out = invoke("plan", "qwen25_7b", "--smoke", "actor.lora.rank=8", "actor.lora.target_modules=[qproj,v_proj]")
    assert res.exit_code == 1 and "'qproj'" in out and "did you mean 'q_proj'" in out, out
    assert "q_proj, up_proj, v_proj" in out, out  # the family's names
    fix = re.search(r"actor\.lora\.target_modules=\[[^\]]*\]", out)
    assert fix and fix[0] == "actor.lora.target_modules=[q_proj,v_proj]", out
    res2, out2 = invoke("plan", "qwen25_7b", "--smoke", "actor.lora.rank=8", fix[0])
    assert res2.exit_code == 0 and "plan OK" in out2, out2
    # names of another family (the smoke recipes share one list) are said, not refused
    res3, out3 = invoke("plan", "deepseek_r1_671b", "--smoke", "actor.lora.rank=8", "rollout.layout.tp=1",
                        "rollout.layout.ep=1")
    assert res3.exit_code == 0 and "no such module in deepseek_v3" in out3, out3


def test_a_lora_rank_above_a_targeted_weights_dimension_is_refused():
    """`rank=4096` on a hidden size of 64 was accepted."""
    res, out = invoke("plan", "qwen25_7b", "--smoke", "actor.lora.rank=4096")
    assert res.exit_code == 1 and "actor.lora.rank=4096" in out, out
    n = int(re.search(r"lower actor\.lora\.rank to (\d+)", out)[1])
    assert invoke("plan", "qwen25_7b", "--smoke", f"actor.lora.rank={n}")[0].exit_code == 0
    assert invoke("plan", "qwen25_7b", "--smoke", f"actor.lora.rank={n + 1}")[0].exit_code == 1


# ================================================================================ 6. a deleted manifest
def test_a_checkpoint_whose_manifest_was_deleted_is_refused_not_taken_for_an_old_one(tmp_path):
    """It resumed with a notice that the checkpoint "predates manifests", and an altered shard passed.
    (tests/e2e/test_checkpoint_integrity.py does the same on a checkpoint a run wrote.)"""
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    from rlrecipes.workflow import checkpoint

    root = tmp_path / "run" / "checkpoints"
    ckpt = root / "step_000002"
    dcp.save({"model": {"w": torch.randn(64, 8)}}, checkpoint_id=str(ckpt / "actor"))
    (ckpt / "trainer_state.json").write_text(json.dumps({"next_step": 2, "sampler": {}, "kl_coef": None,
                                                         "manifest": checkpoint.MANIFEST_FORMAT}))
    (root / "step_000001").mkdir()
    (root / "latest").write_text(ckpt.name)
    said = []
    why = checkpoint.resume_problem(tmp_path / "run", notice=said.append)  # no manifest.json at all
    assert not said and why is not None, said
    assert f"{ckpt / checkpoint.MANIFEST}: missing" in why and "written with one" in why, why
    assert f"echo step_000001 > {root / 'latest'}" in why, why  # the way back


# ================================================================================ 7. a reward failing on 68 % of its calls
def test_a_step_whose_reward_calls_fail_above_the_limit_is_named_with_a_fix_that_loads(tmp_path):
    """It exited 0 and said nothing. (tests/e2e/test_faults.py runs it: the run stops at that step, the
    suggested value runs, and its summary counts the failures.)"""
    from rlrecipes.metrics import reward_failure
    from rlrecipes.recipe import load_recipe

    row = {"step": 3, "reward/samples": 128, "reward/errors": 87, "reward/failure_rate": 87 / 128,
           "reward/first_error": "sample 0: ValueError: cannot parse the answer (in reward score)"}
    limit = load_recipe("qwen25_7b", smoke=True).reward.max_failure_rate
    assert limit == 0.5  # the default, in every recipe
    why = reward_failure(row, limit, tmp_path / "metrics.jsonl")
    assert why and why.startswith("step 3: the reward function failed on 68% of the step's 128 calls"), why
    assert "reward.max_failure_rate=0.5" in why and "cannot parse the answer" in why, why
    fix = re.search(r"set (reward\.max_failure_rate=\d+(?:\.\d+)?)", why)[1]
    raised = load_recipe("qwen25_7b", smoke=True, overrides=[fix]).reward.max_failure_rate
    assert raised == 0.7 and reward_failure(row, raised, tmp_path / "metrics.jsonl") is None
    assert reward_failure({**row, "reward/failure_rate": 0.5}, limit, tmp_path) is None  # at the limit: on


def test_the_run_summary_says_how_many_reward_calls_failed(tmp_path, capsys):
    import json

    from rlrecipes.cli.run import RunView
    from rlrecipes.metrics import RunSummary
    from rlrecipes.workflow.events import RunFinished

    f = tmp_path / "metrics.jsonl"
    first = "sample 5: ValueError: reward returned a non-finite value nan (in reward score)"
    f.write_text("".join(json.dumps({"step": i, "reward/mean": 0.1, "timing_s/step": 1.0, "reward/samples": 128,
                                     "reward/errors": e, **({"reward/first_error": first} if e else {})}) + "\n"
                         for i, e in enumerate([0, 3, 1])))
    RunView(quiet=True)(RunFinished("qwen25_7b", tmp_path, RunSummary.from_file(f), 3.0))
    out = " ".join(capsys.readouterr().err.split())
    assert "failed on 4 of 384 calls (1.0%" in out and first in out and "Fix reward.fn" in out, out


# ================================================================================ 8. a full disk
def test_a_full_disk_under_a_checkpoint_or_the_metrics_file_says_no_space_with_the_path(tmp_path):
    """torch.save's short write read "unexpected pos 704 vs 598". /dev/full answers every write with
    ENOSPC (tests/e2e/test_faults.py fills a small tmpfs under a whole run's checkpoints)."""
    import torch

    from rlrecipes.metrics import MetricsError, MetricsWriter
    from rlrecipes.workflow import checkpoint

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this machine")
    with pytest.raises(RuntimeError, match="unexpected pos") as raised:
        torch.save({"w": torch.randn(1000)}, "/dev/full")
    why = checkpoint._save_error(raised.value, tmp_path / "step_000002.partial", 1)
    assert why.startswith(f"{tmp_path / 'step_000002.partial'}: no space left on the device while writing the "
                          "checkpoint of step 1 (") and " free of " in why and "unexpected pos" not in why, why
    w = MetricsWriter(Path("/dev/full"))
    try:
        with pytest.raises(MetricsError, match=r"^/dev/full: no space left on the device while writing the row of "
                                               r"step 4 \(.* free of .*\); free space there"):
            w.write({"step": 4, "reward/mean": 0.5})
    finally:
        w.close()


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP
