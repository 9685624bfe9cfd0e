"""Bad input through every subcommand: a non-zero exit, no traceback, a message that names the
culprit, and nothing already written changed.

Each case builds what it needs under ``tmp_path`` (a ``work`` folder snapshot before and after),
runs the CLI in-process with typer's CliRunner and checks all four. Cases that would need a
cluster or a started run stop in validation, before anything is placed.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlrecipes.cli import app
from rlrecipes.recipe import find_recipe

runner = CliRunner()
SMOKE = ["--smoke"]


def snapshot(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else "dir"
    return out


# ------------------------------------------------------------------------------------ fixtures
def recipe_copy(work: Path, name: str = "qwen25_7b") -> Path:
    dst = work / "recipe"
    shutil.copytree(find_recipe(name), dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def fake_run(work: Path, rows: str | bytes | None = None, config: str | None = None,
             latest: str | None = None) -> Path:
    run = work / "run"
    run.mkdir()
    if config is not None:
        (run / "config.yaml").write_text(config)
    if rows is not None:
        (run / "metrics.jsonl").write_bytes(rows.encode() if isinstance(rows, str) else rows)
    if latest is not None:
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "latest").write_text(latest)
    return run


def good_rows(n: int = 4) -> str:
    return "".join(json.dumps({"step": i, "perf/tps_per_card": 100.0 + i, "reward/mean": 0.1 * i,
                               "timing_s/step": 1.0}) + "\n" for i in range(n))


def baseline(work: Path, text: str | bytes) -> Path:
    p = work / "baseline.json"
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


GOOD_BASELINE = json.dumps({"recipe": "x", "hardware": {"cpu": {"tps_per_card": 100, "tolerance": 0.5,
                                                                "steps": [1, 3]}}})


def hf_folder(work: Path, tokenizer: bool) -> Path:
    from rlrecipes.models import SMOKE as DIMS
    from rlrecipes.models import hf_config

    p = work / "hf"
    p.mkdir()
    hf_config(DIMS["qwen2"]).save_pretrained(p)
    if tokenizer:
        from rlrecipes.data import build_smoke_tokenizer

        build_smoke_tokenizer(p)
    return p


# ------------------------------------------------------------------------------------ the cases
# (id, setup(work) -> argv, culprit substrings that must appear in the message)
def C(id, setup, *culprits):
    return pytest.param(setup, culprits, id=id)


def _resume_config(work):
    return fake_run(work, rows=good_rows(), config="model: [unclosed\n", latest="step_000002")


CASES = [
    # ---- show / list
    C("show-unknown-recipe", lambda w: ["show", "no_such_recipe"], "no_such_recipe"),
    C("show-recipe-path-is-file", lambda w: (w / "f.yaml").write_text("x: 1") and ["show", str(w / "f.yaml")], "f.yaml"),
    C("show-override-typo", lambda w: ["show", "qwen25_7b", "trainer.stpes=3"], "trainer.stpes", "override"),
    C("show-override-no-equals", lambda w: ["show", "qwen25_7b", "trainer.steps"], "trainer.steps", "KEY=VALUE"),
    C("show-override-empty-key", lambda w: ["show", "qwen25_7b", "=3"], "=3"),
    C("show-override-value-not-section", lambda w: ["show", "qwen25_7b", "trainer.steps.x=1"], "trainer.steps"),
    # ---- cp
    C("cp-dest-exists", lambda w: (w / "d").mkdir() or ["cp", "qwen25_7b", str(w / "d")], "already exists"),
    C("cp-dest-is-file", lambda w: (w / "d").write_text("x") and ["cp", "qwen25_7b", str(w / "d")], str("d")),
    C("cp-dest-under-file", lambda w: (w / "f").write_text("x") and ["cp", "qwen25_7b", str(w / "f" / "sub")], "is a file"),
    C("cp-unknown-recipe", lambda w: ["cp", "nope_recipe", str(w / "new")], "nope_recipe"),
    # ---- plan: recipe values
    C("plan-unknown-recipe", lambda w: ["plan", "nope"], "nope"),
    C("plan-override-unknown-key-names-override", lambda w: ["plan", "qwen25_7b", *SMOKE, "trainer.bogus=1"],
      "trainer.bogus", "override"),
    C("plan-lr-inf", lambda w: ["plan", "qwen25_7b", *SMOKE, "trainer.lr=inf"], "trainer.lr"),
    C("plan-lr-nan", lambda w: ["plan", "qwen25_7b", *SMOKE, "trainer.lr=nan"], "trainer.lr"),
    C("plan-lr-negative", lambda w: ["plan", "qwen25_7b", *SMOKE, "trainer.lr=-1e-3"], "trainer.lr"),
    C("plan-lr-zero", lambda w: ["plan", "qwen25_7b", *SMOKE, "trainer.lr=0"], "trainer.lr"),
    C("plan-critic-lr-inf", lambda w: ["plan", "qwen25_7b", *SMOKE, "critic.lr=inf"], "critic.lr"),
    C("plan-kl-coef-nan", lambda w: ["plan", "qwen25_7b", *SMOKE, "algorithm.kl_coef=nan"], "algorithm.kl_coef"),
    C("plan-grad-clip-negative", lambda w: ["plan", "qwen25_7b", *SMOKE, "actor.grad_clip=-1"], "actor.grad_clip"),
    C("plan-gamma-above-one", lambda w: ["plan", "qwen25_7b", *SMOKE, "algorithm.gamma=1.5"], "algorithm.gamma"),
    C("plan-top-p-zero", lambda w: ["plan", "qwen25_7b", *SMOKE, "rollout.sampling.top_p=0"], "top_p"),
    C("plan-temperature-negative", lambda w: ["plan", "qwen25_7b", *SMOKE, "rollout.sampling.temperature=-1"],
      "temperature"),
    C("plan-grpo-one-sample", lambda w: ["plan", "qwen25_7b", *SMOKE, "trainer.n_samples_per_prompt=1"],
      "n_samples_per_prompt"),
    C("plan-global-batch-zero", lambda w: ["plan", "qwen25_7b", *SMOKE, "trainer.global_batch=0"], "global_batch"),
    C("plan-steps-not-int", lambda w: ["plan", "qwen25_7b", *SMOKE, "trainer.steps=abc"], "trainer.steps"),
    C("plan-section-replaced-by-value", lambda w: ["plan", "qwen25_7b", *SMOKE, "trainer=3"], "trainer"),
    C("plan-unknown-kl-estimator", lambda w: ["plan", "qwen25_7b", *SMOKE, "algorithm.kl_estimator=k9"],
      "kl_estimator", "k9"),
    C("plan-unknown-adv-estimator", lambda w: ["plan", "qwen25_7b", *SMOKE, "algorithm.adv_estimator=gea"],
      "adv_estimator", "gae"),
    C("plan-dual-clip-too-small", lambda w: ["plan", "qwen25_7b", *SMOKE, "algorithm.dual_clip_c=0.5"], "dual_clip_c"),
    C("plan-tp-does-not-divide-heads", lambda w: ["plan", "qwen25_7b", *SMOKE, "actor.layout.tp=3"], "TP"),
    C("plan-unknown-engine", lambda w: ["plan", "qwen25_7b", *SMOKE, "rollout.engine=sglang"], "rollout.engine"),
    C("plan-synthetic-and-train-files", lambda w: ["plan", "qwen25_7b", *SMOKE, "data.train_files=[a.jsonl]"],
      "data.synthetic", "data.train_files"),
    C("plan-unknown-loss-agg", lambda w: ["plan", "qwen25_7b", *SMOKE, "algorithm.loss_agg_mode=mean"],
      "loss_agg_mode"),
    C("plan-rollout-correction-cap", lambda w: ["plan", "qwen25_7b", *SMOKE, "algorithm.rollout_correction_cap=1"],
      "rollout_correction_cap"),
    C("plan-model-path-missing-no-preset", lambda w: ["plan", "qwen25_7b", "model.preset=null", f"model.path={w}/nope"],
      "model.path", "does not exist"),
    C("plan-model-path-is-file", lambda w: (w / "m").write_text("x") and
      ["plan", "qwen25_7b", "model.preset=null", f"model.path={w}/m"], "model.path", "is a file"),
    # ---- plan: recipe files
    C("plan-yaml-duplicate-top-key", lambda w: _dup(w, top=True), "recipe.yaml", "trainer", "line"),
    C("plan-yaml-duplicate-nested-key", lambda w: _dup(w, top=False), "recipe.yaml", "steps"),
    C("plan-yaml-invalid", lambda w: _bad_yaml(w, "trainer: [unclosed\n"), "recipe.yaml", "invalid YAML"),
    C("plan-yaml-top-level-list", lambda w: _bad_yaml(w, "- a\n- b\n"), "recipe.yaml", "mapping"),
    C("plan-yaml-unknown-key-in-file", lambda w: _bad_yaml(w, None, extra="trainer:\n  stepz: 3\n"), "stepz",
      "recipe.yaml"),
    C("plan-recipe-folder-without-yaml", lambda w: (w / "empty").mkdir() or ["plan", str(w / "empty")], "recipe.yaml"),
    # ---- run: paths (all fail in validation, before Ray)
    C("run-out-is-file", lambda w: (w / "o").write_text("x") and ["run", "qwen25_7b", *SMOKE, "--out", str(w / "o")],
      "--out", "is a file"),
    C("run-out-under-file", lambda w: (w / "o").write_text("x") and
      ["run", "qwen25_7b", *SMOKE, "--out", str(w / "o" / "run")], "--out", "is a file"),
    C("run-out-not-writable", lambda w: ["run", "qwen25_7b", *SMOKE, "--out", "/proc/rlrecipes-run"], "--out",
      "/proc"),
    C("run-out-holds-a-run", lambda w: fake_run(w, rows=good_rows()) and
      ["run", "qwen25_7b", *SMOKE, "--out", str(w / "run")], "already holds a run"),
    C("run-model-path-missing", lambda w: ["run", "qwen25_7b", *SMOKE, "model.smoke=null", "resources.device_memory_gb=4096",
                                           f"model.path={w}/nope", "--out", str(w / "o")], "model.path", "nope"),
    C("run-model-path-is-file", lambda w: (w / "m").write_text("x") and
      ["run", "qwen25_7b", *SMOKE, "model.smoke=null", "resources.device_memory_gb=4096", f"model.path={w}/m", "--out", str(w / "o")],
      "model.path", "is a file"),
    C("run-model-folder-no-config", lambda w: (w / "m").mkdir() or
      ["run", "qwen25_7b", *SMOKE, "model.smoke=null", "resources.device_memory_gb=4096", f"model.path={w}/m", "--out", str(w / "o")],
      "model.path", "config.json"),
    C("run-model-folder-no-tokenizer", lambda w: ["run", "qwen25_7b", *SMOKE, "model.smoke=null", "resources.device_memory_gb=4096",
                                                  f"model.path={hf_folder(w, False)}", "--out", str(w / "o")],
      "model.tokenizer", "no tokenizer"),
    C("run-tokenizer-missing", lambda w: ["run", "qwen25_7b", *SMOKE, f"model.tokenizer={w}/tok",
                                          "--out", str(w / "o")], "model.tokenizer", "tok"),
    C("run-tokenizer-is-file", lambda w: (w / "tok").write_text("x") and
      ["run", "qwen25_7b", *SMOKE, f"model.tokenizer={w}/tok", "--out", str(w / "o")], "model.tokenizer", "is a file"),
    C("run-data-file-missing", lambda w: ["run", "qwen25_7b", *SMOKE, "data.synthetic=null",
                                          f"data.train_files=[{w}/nope.jsonl]", "--out", str(w / "o")],
      "data.train_files[0]", "does not exist"),
    C("run-data-file-is-folder", lambda w: (w / "data").mkdir() or
      ["run", "qwen25_7b", *SMOKE, "data.synthetic=null", f"data.train_files=[{w}/data]", "--out", str(w / "o")],
      "data.train_files[0]", "is a folder"),
    C("run-data-file-empty", lambda w: (w / "d.jsonl").write_text("") or
      ["run", "qwen25_7b", *SMOKE, "data.synthetic=null", f"data.train_files=[{w}/d.jsonl]", "--out", str(w / "o")],
      "d.jsonl", "empty"),
    C("run-data-file-unknown-format", lambda w: (w / "d.csv").write_text("a,b") and
      ["run", "qwen25_7b", *SMOKE, "data.synthetic=null", f"data.train_files=[{w}/d.csv]", "--out", str(w / "o")],
      "d.csv", "format"),
    C("run-reward-module-missing", lambda w: ["run", "qwen25_7b", *SMOKE, "reward.fn=no_such_mod:score",
                                              "--out", str(w / "o")], "reward.fn", "no_such_mod"),
    C("run-reward-unknown-name", lambda w: ["run", "qwen25_7b", *SMOKE, "reward.fn=mathh", "--out", str(w / "o")],
      "reward.fn", "mathh"),
    C("run-logger-unknown", lambda w: ["run", "qwen25_7b", *SMOKE, "trainer.loggers=[jsonl,mlflow]",
                                       "--out", str(w / "o")], "trainer.loggers", "mlflow"),
    # ---- run --resume
    C("resume-not-a-run", lambda w: (w / "r").mkdir() or ["run", "qwen25_7b", *SMOKE, "--resume", str(w / "r")],
      "not a run folder"),
    C("resume-missing-folder", lambda w: ["run", "qwen25_7b", *SMOKE, "--resume", str(w / "nope")], "nope"),
    C("resume-damaged-config", lambda w: ["run", "qwen25_7b", *SMOKE, "--resume", str(_resume_config(w))],
      "config.yaml"),
    C("resume-config-wrong-schema", lambda w: ["run", "qwen25_7b", *SMOKE, "--resume",
                                               str(fake_run(w, rows=good_rows(), config="model: 3\n",
                                                            latest="step_000002"))], "config.yaml", "model"),
    C("resume-latest-points-nowhere", lambda w: ["run", "qwen25_7b", *SMOKE, "--resume",
                                                 str(_saved_run(w, latest="step_000009"))], "step_000009",
      "does not exist"),
    C("resume-no-checkpoint", lambda w: ["run", "qwen25_7b", *SMOKE, "--resume", str(_saved_run(w, latest=None))],
      "no complete checkpoint"),
    C("resume-refuses-other-overrides", lambda w: ["run", "qwen25_7b", *SMOKE, "--resume",
                                                   str(_saved_run(w, latest="step_000002")), "trainer.lr=1"],
      "trainer.lr", "--resume"),
    # ---- check
    C("check-run-missing", lambda w: ["check", str(w / "nope"), "--baseline", str(baseline(w, GOOD_BASELINE))],
      "nope"),
    C("check-no-metrics", lambda w: (w / "r").mkdir() or
      ["check", str(w / "r"), "--baseline", str(baseline(w, GOOD_BASELINE))], "metrics.jsonl"),
    C("check-baseline-missing", lambda w: ["check", str(fake_run(w, good_rows())), "--baseline", str(w / "b.json")],
      "b.json"),
    C("check-baseline-invalid-json", lambda w: ["check", str(fake_run(w, good_rows())), "--baseline",
                                                str(baseline(w, "{oops"))], "baseline.json", "invalid JSON"),
    C("check-baseline-not-utf8", lambda w: ["check", str(fake_run(w, good_rows())), "--baseline",
                                            str(baseline(w, b"\xff\xfe\x00garbage"))], "baseline.json", "UTF-8"),
    C("check-baseline-top-list", lambda w: ["check", str(fake_run(w, good_rows())), "--baseline",
                                            str(baseline(w, "[1, 2]"))], "baseline.json", "object"),
    C("check-baseline-hardware-list", lambda w: ["check", str(fake_run(w, good_rows())), "--baseline",
                                                 str(baseline(w, '{"hardware": []}'))], "hardware"),
    C("check-baseline-tps-string", lambda w: ["check", str(fake_run(w, good_rows())), "--baseline",
                                              str(baseline(w, '{"hardware": {"cpu": {"tps_per_card": "fast", '
                                                              '"tolerance": 0.1, "steps": [1, 3]}}}'))],
      "tps_per_card"),
    C("check-baseline-steps-not-pair", lambda w: ["check", str(fake_run(w, good_rows())), "--baseline",
                                                  str(baseline(w, '{"hardware": {"cpu": {"tps_per_card": 1, '
                                                                  '"tolerance": 0.1, "steps": 3}}}'))], "steps"),
    C("check-baseline-no-hardware-entry", lambda w: ["check", str(fake_run(w, good_rows())), "--baseline",
                                                     str(baseline(w, GOOD_BASELINE)), "--hardware", "atlas-a3"],
      "atlas-a3"),
    C("check-metrics-not-utf8", lambda w: ["check", str(fake_run(w, b"\xff\xfe{}\n")), "--baseline",
                                           str(baseline(w, GOOD_BASELINE))], "metrics.jsonl", "UTF-8"),
    C("check-metrics-invalid-line", lambda w: ["check", str(fake_run(w, good_rows() + "{oops\n")), "--baseline",
                                               str(baseline(w, GOOD_BASELINE))], "metrics.jsonl:5"),
    C("check-metrics-row-without-step", lambda w: ["check", str(fake_run(w, '{"perf/tps_per_card": 3}\n')),
                                                   "--baseline", str(baseline(w, GOOD_BASELINE))],
      "metrics.jsonl:1", "step"),
    C("check-metrics-row-not-object", lambda w: ["check", str(fake_run(w, "[1, 2]\n")), "--baseline",
                                                 str(baseline(w, GOOD_BASELINE))], "metrics.jsonl:1"),
    C("check-metrics-all-null-tps", lambda w: ["check", str(fake_run(w, "".join(
        json.dumps({"step": i, "perf/tps_per_card": None}) + "\n" for i in range(4)))),
        "--baseline", str(baseline(w, GOOD_BASELINE))], "perf/tps_per_card"),
    C("check-no-recipe-dir", lambda w: ["check", str(fake_run(w, good_rows()))], "--baseline"),
    # ---- report
    C("report-run-missing", lambda w: ["report", str(w / "nope")], "nope"),
    C("report-metrics-empty", lambda w: ["report", str(fake_run(w, ""))], "empty"),
    C("report-metrics-not-utf8", lambda w: ["report", str(fake_run(w, b"\x80\x81\n"))], "UTF-8"),
    C("report-rows-without-step", lambda w: ["report", str(fake_run(w, '{"reward/mean": 1}\n'))], "step"),
    C("report-step-not-int", lambda w: ["report", str(fake_run(w, '{"step": "one"}\n'))], "step"),
    C("report-out-is-folder", lambda w: (w / "png").mkdir() or ["report", str(fake_run(w, good_rows())), "--out",
                                                                  str(w / "png")], "is a folder"),
    C("report-out-not-writable", lambda w: ["report", str(fake_run(w, good_rows())), "--out",
                                            "/proc/rlrecipes/report.png"], "/proc"),
]


def _dup(work: Path, top: bool) -> list[str]:
    rec = recipe_copy(work)
    y = rec / "recipe.yaml"
    if top:
        y.write_text(y.read_text() + "\ntrainer:\n  steps: 3\n")
    else:
        y.write_text(y.read_text().replace("trainer:\n", "trainer:\n  steps: 4\n  steps: 5\n", 1))
    return ["plan", str(rec), "--smoke"]


def _bad_yaml(work: Path, text: str | None, extra: str = "") -> list[str]:
    rec = recipe_copy(work)
    y = rec / "recipe.yaml"
    y.write_text(text if text is not None else y.read_text().replace("trainer:\n", extra, 1) + "")
    return ["plan", str(rec)]


def _saved_run(work: Path, latest: str | None) -> Path:
    """A run folder as `run` writes it (config.yaml from the real recipe), with or without a checkpoint."""
    from rlrecipes.recipe import dump_yaml, load_recipe

    r = load_recipe("qwen25_7b", smoke=True)
    run = fake_run(work, rows=good_rows(2), config=dump_yaml(r), latest=latest)
    return run


@pytest.mark.parametrize("setup,culprits", CASES)
def test_bad_input(tmp_path: Path, setup, culprits):
    work = tmp_path / "work"
    work.mkdir()
    argv = setup(work)
    before = snapshot(work)
    res = runner.invoke(app, argv)
    text = res.output + (res.stderr if res.stderr_bytes is not None else "")
    assert res.exit_code != 0, f"{argv}: exit 0\n{text}"
    assert "Traceback" not in text and not isinstance(res.exception, (AssertionError, TypeError, KeyError,
                                                                      AttributeError, IndexError)), text
    flat = " ".join(text.split())
    for c in culprits:
        assert c in flat, f"{argv}: message does not name {c!r}:\n{text}"
    assert snapshot(work) == before, f"{argv}: changed files under {work}"


def test_there_are_at_least_60_cases():
    assert len(CASES) >= 60


def test_report_and_check_accept_the_nulls_run_writes(tmp_path):
    """``null`` is what metrics.jsonl holds for NaN (e.g. reward/mean of a step with no samples)."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "perf/tps_per_card": None if i == 0 else 100.0, "reward/mean": None if i == 1 else 0.5,
             "timing_s/step": 1.0, "timing_s/rollout": None, "perf/overhead_share": None} for i in range(4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(app, ["report", str(run)])
    assert res.exit_code == 0 and (run / "report.png").is_file(), res.output
    b = tmp_path / "baseline.json"
    b.write_text(GOOD_BASELINE)
    res = runner.invoke(app, ["check", str(run), "--baseline", str(b)])
    assert res.exit_code == 0 and "OK" in res.output, res.output


def test_logger_not_installed_is_refused_with_the_extra_to_install(tmp_path, monkeypatch):
    from rlrecipes import loggers

    monkeypatch.setitem(loggers.REQUIRES, "tensorboard", ("no_such_module_for_this_test", "tensorboard"))
    res = runner.invoke(app, ["run", "qwen25_7b", "--smoke", "trainer.loggers=[tensorboard]", "--out",
                              str(tmp_path / "o")])
    flat = " ".join(res.output.split())
    assert res.exit_code == 2 and 'pip install -e ".[tensorboard]"' in flat, res.output
    assert not (tmp_path / "o").exists()
