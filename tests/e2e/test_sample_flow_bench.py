"""benchmarks/sample_flow.py end to end at a tiny size (a subprocess: it owns its local Ray): every
mode runs, the dock modes pass no sample byte through the driver, and with equal-length rows the
dock keeps the update's cached rows with their holders, so the TensorCache exchange moves nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.dist
def test_sample_flow_runs_every_mode():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sample_flow.py"), "--workers", "2",
                          "--seq-len", "32", "--rows-per-worker", "8", "--steps", "2"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {d["mode"]: d for d in (json.loads(x) for x in out.stdout.splitlines() if x.startswith("{"))}
    assert set(lines) == {"centralised", "dock", "dock+cache"}
    assert lines["centralised"]["driver_bytes"] > 0
    assert lines["dock"]["driver_bytes"] == lines["dock+cache"]["driver_bytes"] == 0
    assert lines["dock+cache"]["a2a_bytes_per_step"] == 0
    assert all(d["seconds_per_step"] > 0 and d["rows"] == 16 for d in lines.values())


@pytest.mark.dist
@pytest.mark.parametrize("nodes", [1, 2])
def test_dock_call_prices_every_op(nodes):
    """benchmarks/dock_call.py: every op runs its calls (a claim per new consumer, so none waits),
    on one node and with the client's warehouse on a second node (controller calls cross nodes)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "dock_call.py"), "--calls", "20",
                          "--nodes", str(nodes)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [d["op"] for d in lines] == ["empty", "control", "put", "claim"]
    assert all(d["calls"] == 20 and d["nodes"] == nodes and d["us_per_call"] > 0 for d in lines)
    # the client opened a channel to each warehouse it called; on two nodes its warehouse also
    # reached the head's controller over channels of its own (none fell back to Ray calls)
    assert lines[-1]["client_channels"] == nodes
    assert (lines[-1]["head_channels"] >= 1) == (nodes == 2)
