"""`rlrecipes report`: a PNG of reward, TPS/card and stage timings per step, and a summary table."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ._common import console, die, user_errors


def summarize(rows: list[dict]) -> dict:
    """Summary numbers of a run: first/last-5 reward, median TPS/card, mean stage times and overhead share."""
    def mean(key, rs):
        vals = [r[key] for r in rs if isinstance(r.get(key), (int, float))]  # null (NaN) values are skipped
        return statistics.fmean(vals) if vals else float("nan")

    stages = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    out = {
        "steps": len(rows),
        "reward_first5": mean("reward/mean", rows[:5]),
        "reward_last5": mean("reward/mean", rows[-5:]),
        "tps_per_card_median": statistics.median([r["perf/tps_per_card"] for r in rows
                                                  if isinstance(r.get("perf/tps_per_card"), (int, float))]
                                                 or [float("nan")]),
        "step_s_mean": mean("timing_s/step", rows),
        "stage_s_mean": {s: mean(f"timing_s/{s}", rows) for s in stages},
    }
    overhead = [r["perf/overhead_share"] for r in rows if isinstance(r.get("perf/overhead_share"), (int, float))]
    if overhead:
        out["overhead_share_mean"] = statistics.fmean(overhead)
    return out


def write_png(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def col(key):
        return [v if isinstance(v := r.get(key), (int, float)) else float("nan") for r in rows]

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, col("reward/mean"), marker="o", ms=3)
    axes[0].set_title("reward/mean")
    axes[1].plot(steps, col("perf/tps_per_card"), marker="o", ms=3, color="tab:green")
    axes[1].set_title("perf/tps_per_card")
    stages = sorted({k for r in rows for k in r if k.startswith("timing_s/") and k != "timing_s/step"})
    bottom = [0.0] * len(rows)
    for s in stages:
        vals = [v if v == v else 0.0 for v in col(s)]
        axes[2].bar(steps, vals, bottom=bottom, label=s.split("/", 1)[1])
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[2].set_title("stage seconds per step")
    axes[2].legend(fontsize=7, loc="upper right")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def register(app: typer.Typer) -> None:
    @app.command("report", help="Write RUN/report.png (reward, TPS/card, stage timings per step) and print a "
                                "summary table.\n\nExample: `rlrecipes report runs/qwen25_7b-20261121-120000`")
    @user_errors
    def report(run_dir: Path = typer.Argument(..., help="A run folder (holds metrics.jsonl)."),
               out: Optional[Path] = typer.Option(None, "--out", "-o", help="PNG path (default: <run>/report.png).")) -> None:
        from ..baseline import BaselineError, read_metrics
        from ..inputs import writable_file

        png = out or run_dir / "report.png"
        try:
            rows = read_metrics(run_dir)
        except BaselineError as e:
            die(str(e))
        if not rows:
            die(f"{run_dir}/metrics.jsonl is empty: the run recorded no step yet")
        bad = writable_file(png, "--out")
        if bad:
            die(bad[0])
        write_png(rows, png, run_dir.name)
        s = summarize(rows)
        t = Table(title=f"{run_dir.name}: {s['steps']} steps")
        t.add_column("metric")
        t.add_column("value", justify="right")
        t.add_row("reward, mean of first 5 steps", f"{s['reward_first5']:.3f}")
        t.add_row("reward, mean of last 5 steps", f"{s['reward_last5']:.3f}")
        t.add_row("TPS/card, median", f"{s['tps_per_card_median']:.1f}")
        t.add_row("step seconds, mean", f"{s['step_s_mean']:.2f}")
        if "overhead_share_mean" in s:
            t.add_row("share of step outside model compute", f"{s['overhead_share_mean']:.1%}")
        for k, v in s["stage_s_mean"].items():
            t.add_row(f"  {k} s", f"{v:.3f}")
        console.print(t)
        console.print(f"wrote {png}")
