"""Does anything grow over a long run? Resident memory of every process of a smoke run, and the step time.

Runs ``rlrecipes run RECIPE --smoke --steps N --out DIR --quiet`` (default qwen25_7b, 3000 steps) as
a subprocess, exactly as a user would, and every ``--interval`` seconds (2) reads from ``/proc``
the resident set size (``VmRSS``) of the driver process and of every Ray actor process of the run:
the embedded Ray's processes are the driver's descendants, and an actor's process title is
``ray::<Class>[.<method>]`` (``Worker`` -> ``worker<rank>`` by the pids in the run's
``workers.json``; ``_Warehouse`` -> ``warehouse<i>`` in pid order, warehouse 0 hosting the dock's
metadata controller; ``ProgressBoard`` -> ``progress``; any other actor by its class name). With
``--ray-system`` Ray's own processes (gcs_server, raylet, dashboard, agents) are reported too.
The run's current step is the number of rows in its ``metrics.jsonl``.

Output, one JSON line per process: ``process``, ``pid``, ``rss_mb_warm`` (the first sample at or
after step ``--warm-step``, 100), ``rss_mb_end`` (the last sample), ``growth_mb_per_1000_steps``
(least-squares slope of RSS over the step for the samples from the warm step on) and ``samples``;
then a last line ``{"trend": ...}`` with ``step_s_early`` (median ``timing_s/step`` of the rows of
steps 100-599), ``step_s_late`` (the median over the last 500 rows), their ratio, the fastest
tenth of each window (``step_s_*_p10``: on a shared machine other processes' load moves the
medians, the tenth percentile much less), the same two medians as the driver saw them (wall
seconds per step between samples, ``wall_s_per_step_*``), the 1-minute load average at the end
and the run's exit code. Measurements only, no assertions.

Usage: ``python benchmarks/soak.py [--recipe qwen25_7b] [--steps 3000] [--interval 2] [--warm-step 100]
[--out DIR] [--ray-system] [--tty] [--json FILE] [--samples FILE] [KEY=VALUE overrides ...]``; ``--tty`` runs the driver
on a pseudo-terminal without ``--quiet``, so its live table is what renders.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2 ** 20 if hasattr(os, "sysconf") else 4096 / 2 ** 20
RAY_SYSTEM = ("gcs_server", "raylet", "dashboard", "monitor.py", "log_monitor.py", "DashboardAgent",
              "RuntimeEnvAgent")


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process (one pass over /proc)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses
        kids.setdefault(ppid, []).append(int(d))
    return kids


def _descendants(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def rss_mb(pid: int) -> float | None:
    """Resident set size in MB (``/proc/<pid>/statm``), None when the process is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_MB
    except (OSError, IndexError, ValueError):
        return None


def label_processes(driver: int, run_dir: Path, ray_system: bool) -> dict[str, int]:
    """``{label: pid}`` of the driver and the run's Ray actors (and Ray's own processes if asked)."""
    ranks: dict[int, int] = {}
    try:
        ranks = {pid: r for r, pid in enumerate(json.loads((run_dir / "workers.json").read_text())["pids"])}
    except (OSError, ValueError, KeyError):
        pass
    found: dict[str, int] = {"driver": driver}
    by_class: dict[str, list[int]] = {}
    for pid in _descendants(driver):
        cmd = _cmdline(pid)
        if cmd.startswith("ray::"):
            cls = cmd[5:].split()[0].split(".")[0] if len(cmd) > 5 else ""
            if pid in ranks:
                found[f"worker{ranks[pid]}"] = pid
            elif cls in ("IDLE", "") or cls in RAY_SYSTEM and not ray_system:
                continue
            elif cls in RAY_SYSTEM:
                found[f"ray:{cls}"] = pid
            elif cls != "Worker":  # a worker before workers.json is written is left out
                by_class.setdefault(cls, []).append(pid)
        elif ray_system:
            name = next((n for n in RAY_SYSTEM if n in cmd.split(" ", 2)[0] or f"/{n}" in cmd.split(" --")[0]), None)
            if name:
                found[f"ray:{name.removesuffix('.py')}"] = pid
    for cls, pids in by_class.items():
        name = {"_Warehouse": "warehouse", "ProgressBoard": "progress", "_Controller": "controller"}.get(cls, cls)
        if len(pids) == 1 and name != "warehouse":
            found[name] = pids[0]
        else:
            for i, pid in enumerate(sorted(pids)):
                found[f"{name}{i}"] = pid
    return found


class StepCounter:
    """The number of complete rows in metrics.jsonl, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rows = path, 0, 0

    def __call__(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.rows
        done = chunk.rfind(b"\n") + 1
        self.rows += chunk[:done].count(b"\n")
        self.offset += done
        return self.rows


def slope_per_1000(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of RSS (MB) over the step, per 1000 steps."""
    if len(points) < 2:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def summarise(samples: list[tuple[float, int, dict[str, float]]], pids: dict[str, int], warm: int) -> list[dict]:
    out = []
    for name in pids:
        series = [(step, rss[name]) for _, step, rss in samples if name in rss]
        after = [(s, m) for s, m in series if s >= warm]
        slope = slope_per_1000(after)
        out.append({"process": name, "pid": pids[name],
                    "rss_mb_warm": round(after[0][1], 1) if after else None,
                    "rss_mb_end": round(series[-1][1], 1) if series else None,
                    "growth_mb_per_1000_steps": round(slope, 2) if slope is not None else None,
                    "samples": len(after)})
    return out


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 5) if xs else None


def trend(rows: list[dict], samples: list[tuple[float, int, dict]], steps: int, warm: int) -> dict:
    times = {r["step"]: r.get("timing_s/step") for r in rows if r.get("timing_s/step") is not None}
    early = [t for s, t in times.items() if warm <= s < 600]
    late = [times[s] for s in sorted(times)[-500:]]
    # the driver's view: wall seconds per step between consecutive samples
    wall = [((t1 - t0) / (s1 - s0), s1) for (t0, s0, _), (t1, s1, _) in zip(samples, samples[1:]) if s1 > s0]
    w_early = [w for w, s in wall if warm <= s <= 600]
    last = max(times) if times else 0
    w_late = [w for w, s in wall if s > last - 500]
    e, la = _median(early), _median(late)
    return {"trend": True, "steps": steps, "rows": len(rows), "step_s_early": e, "step_s_late": la,
            "late_over_early": round(la / e, 3) if e and la else None,
            # the fastest tenth: what the step costs when nothing else on the machine competes
            "step_s_early_p10": _p10(early), "step_s_late_p10": _p10(late),
            "wall_s_per_step_early": _median(w_early), "wall_s_per_step_late": _median(w_late),
            "load_avg_1min": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}


def _p10(xs: list[float]) -> float | None:
    return round(statistics.quantiles(xs, n=10)[0], 5) if len(xs) >= 10 else None


def _start(cmd: list[str], env: dict, logf, tty: bool):
    """The driver, its output going to ``logf`` (through a pseudo-terminal with ``tty``); returns the
    process and the thread that copies the terminal's output (None without ``tty``)."""
    if not tty:
        return subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env), None
    import pty
    import threading

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=dict(env, COLUMNS="120"))
    os.close(slave)

    def pump() -> None:  # a terminal that is never read would block the driver
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the driver closed its end
                break
            if not data:
                break
            logf.write(data)
        os.close(master)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return proc, thread


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE recipe overrides")
    ap.add_argument("--recipe", default="qwen25_7b")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--warm-step", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None, help="run folder (kept); default a temporary one")
    ap.add_argument("--ray-system", action="store_true", help="also report Ray's own processes")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON lines to this file")
    ap.add_argument("--samples", type=Path, default=None,
                    help="write every sample (time, step, RSS of each process) to this JSON-lines file")
    ap.add_argument("--tty", action="store_true",
                    help="run the driver on a pseudo-terminal without --quiet (its live table) instead of --quiet")
    a = ap.parse_args()

    tmp = None
    if a.out is None:
        tmp = Path(tempfile.mkdtemp(prefix="soak-"))
        run_dir = tmp / "run"
    else:
        run_dir = a.out
    log = (tmp or run_dir.parent) / f"{run_dir.name}.driver.log"
    cmd = [sys.executable, "-m", "rlrecipes", "run", a.recipe, "--smoke", "--steps", str(a.steps), "--out",
           str(run_dir), *([] if a.tty else ["--quiet"]), *a.overrides]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    samples: list[tuple[float, int, dict[str, float]]] = []
    pids: dict[str, int] = {}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as logf:
        proc, pump = _start(cmd, env, logf, a.tty)
        count = StepCounter(run_dir / "metrics.jsonl")
        try:
            while proc.poll() is None:
                step = count()
                found = label_processes(proc.pid, run_dir, a.ray_system)
                rss = {k: m for k, p in found.items() if (m := rss_mb(p)) is not None}
                if step > 0 and step < a.steps:  # training, not bring-up or shutdown
                    samples.append((time.time(), step, rss))
                    for k, p in found.items():
                        pids.setdefault(k, p)
                time.sleep(a.interval)
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait(60)
        if pump is not None:
            pump.join(30)
    rows = []
    try:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        pass
    if a.samples is not None:
        a.samples.parent.mkdir(parents=True, exist_ok=True)
        a.samples.write_text("".join(
            json.dumps({"t": round(t, 2), "step": st, **{k: round(v, 2) for k, v in r.items()}}) + "\n"
            for t, st, r in samples))
    lines = summarise(samples, pids, a.warm_step)
    lines.append({**trend(rows, samples, a.steps, a.warm_step), "exit_code": proc.returncode,
                  "driver_log": str(log) if tmp is None else None})
    text = "".join(json.dumps(x) + "\n" for x in lines)
    sys.stdout.write(text)
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text)
    if proc.returncode != 0:
        sys.stderr.write(open(log, errors="replace").read()[-3000:])
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
