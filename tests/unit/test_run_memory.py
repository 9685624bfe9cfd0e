"""Nothing the driver, the progress actor, the CLI view or a worker keeps grows with the step count
(issue 36; `benchmarks/soak.py` measures the processes). No Ray here: the actor and the worker's
row bookkeeping are plain classes."""
import io
import json
import math
import statistics
from pathlib import Path

from rich.console import Console

from rlrecipes.cli import run as cli_run
from rlrecipes.metrics import MetricsWriter, RunSummary, read_rows
from rlrecipes.recipe import load_recipe
from rlrecipes.workflow.driver import _bad_run
from rlrecipes.workflow.progress import ProgressBoard
from rlrecipes.workflow.events import Progress, RunFinished, RunStarted
from rlrecipes.workflow.worker import CheckpointRows


def row(step: int, **kw) -> dict:
    return {"step": step, "perf/tps_per_card": 100.0 + step, "timing_s/step": 0.1 + step / 1000,
            "timing_s/update": 0.05, "perf/overhead_share": 0.2, "reward/mean": step / 10,
            "reward/errors": 0, "reward/samples": 8, "actor/skipped_step": 0.0, **kw}


def test_progress_actor_drops_the_rows_the_driver_confirmed():
    p = ProgressBoard()
    for s in range(3):
        p.metrics(row(s))
    step, stage, new = p.poll(0)
    assert [r["step"] for r in new] == [0, 1, 2]
    # an answer that never arrived is sent again; what the driver holds is dropped
    assert [r["step"] for r in p.poll(0)[2]] == [0, 1, 2]
    assert [r["step"] for r in p.poll(2)[2]] == [2]
    for s in range(3, 1000):
        p.metrics(row(s))
        p.poll(s)  # the driver takes every row as it comes
    assert len(p.pending) == 1 and p.pending[0]["step"] == 999
    assert p.poll(1000)[2] == [] and p.pending == []
    p.stage(7, "update")
    assert p.where() == (7, "update")


def test_progress_actor_merges_rollout_facts_once():
    p = ProgressBoard()
    p.rollout(4, {"timing_s/rollout": 1.5})
    p.metrics(row(4))
    assert p.poll(0)[2][0]["timing_s/rollout"] == 1.5 and p.rollout_facts == {}


def _old_summary(rows: list[dict]) -> dict:
    """What the CLI's summary computed from every row in memory before (the reference)."""
    first = [r["reward/mean"] for r in rows[:5] if r.get("reward/mean") is not None]
    last = [r["reward/mean"] for r in rows[-5:] if r.get("reward/mean") is not None]
    tps = [r["perf/tps_per_card"] for r in rows[1:] or rows]
    return {"first": statistics.fmean(first), "last": statistics.fmean(last), "tps": statistics.median(tps),
            "step_s": statistics.fmean(r["timing_s/step"] for r in rows),
            "update": statistics.fmean(r.get("timing_s/update", 0.0) for r in rows)}


def test_run_summary_from_the_metrics_file_matches_the_in_memory_one(tmp_path):
    rows = [row(s) for s in range(40)]
    rows[3]["reward/mean"] = float("nan")  # written as null, skipped as before
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    for r in rows:
        w.write(r)
    w.close()
    s = RunSummary.from_file(tmp_path / "metrics.jsonl")
    kept = [dict(r, **{"reward/mean": None}) if r["step"] == 3 else r for r in rows]
    ref = _old_summary(kept)
    assert s.steps == 40
    assert s.reward_ends() == (ref["first"], ref["last"])
    assert s.tps_median == ref["tps"]
    assert math.isclose(s.mean("timing_s/step"), ref["step_s"])
    assert math.isclose(s.mean("timing_s/update"), ref["update"])
    assert s.stage_keys == ["timing_s/update"]
    # a resumed session summarises its own rows only
    assert RunSummary.from_file(tmp_path / "metrics.jsonl", first_step=30).steps == 10


def test_run_summary_keeps_bounded_state():
    s = RunSummary()
    for i in range(20000):
        s.add(row(i))
    s.finish()
    assert len(s.first_rewards) == 5 and len(s.last_rewards) == 5 and s._tps == []
    assert len(s.sums) == 5 and s.steps == 20000  # timing_s/step, /update, overhead, errors, samples


def test_read_rows_skips_a_half_written_line(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps(row(0)) + "\n" + json.dumps(row(1)) + "\n" + '{"step": 2, "perf')
    assert [r["step"] for r in read_rows(f)] == [0, 1]


def test_bad_run_reads_the_summary():
    recipe = load_recipe("qwen25_7b", smoke=True)
    s = RunSummary()
    for i in range(4):
        s.add(row(i, **{"reward/errors": 8, "reward/first_error": "ValueError: no parser"}))
    why = _bad_run(recipe, s.finish())
    assert "raised on 100% of the samples" in why and "no parser" in why
    s = RunSummary()
    for i in range(4):
        s.add(row(i, **{"actor/skipped_step": 1.0}))
    assert "100% of the steps skipped" in _bad_run(recipe, s.finish())
    assert _bad_run(recipe, RunSummary().finish()) is None


def test_cli_view_keeps_only_the_newest_row_and_renders_the_summary(tmp_path, monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(cli_run, "console", Console(file=out, width=200))
    view = cli_run.RunView(quiet=True)
    view(RunStarted("r", "grpo", tmp_path, 2, "tp1", "tp1", ["rollout"], {"chat_joined": 0}, 0, 100))
    for s in range(100):
        view(Progress(s, "update", [row(s)]))
    assert view.last["step"] == 99 and not hasattr(view, "rows")
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    for s in range(100):
        w.write(row(s))
    w.close()
    view(RunFinished("r", tmp_path, RunSummary.from_file(tmp_path / "metrics.jsonl"), 12.0))
    text = out.getvalue()
    assert "r: 100 steps in 12s" in text and "TPS/card, median (step 1 on)" in text and "150.0" in text


def test_checkpoint_rows_hold_only_the_rows_since_the_last_checkpoint(tmp_path: Path):
    rows = CheckpointRows()
    for s in range(4):
        rows.append(row(s))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    ckpt = tmp_path / "step_000004"  # what checkpoint.save wrote from them
    ckpt.mkdir()
    (ckpt / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows.saved(ckpt)
    assert rows.recent == []
    for s in range(4, 6):
        rows.append(row(s))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]  # iterable again
    assert bool(CheckpointRows())  # `rows or []` in checkpoint.save keeps it
    # a resume starts from the checkpoint's own copy; one written before rows were kept has none
    assert [r["step"] for r in CheckpointRows(ckpt)] == [0, 1, 2, 3]
    assert list(CheckpointRows(tmp_path / "old")) == []
