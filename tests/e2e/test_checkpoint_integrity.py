"""Checkpoint integrity (issue 36, part 4) on real checkpoints written by smoke runs.

* Every file of a checkpoint is in its manifest with size and SHA-256 (DCP shards, RNG states,
  trainer state, metrics rows; a LoRA checkpoint's ``base_model.json`` too).
* ``--resume`` on a checkpoint with a truncated shard and a shard with one flipped byte exits 2,
  naming both files, and nothing in the run folder changed; the command it suggests (resume from
  the previous checkpoint) works.
* A LoRA checkpoint whose ``base_model.json`` was edited is refused the same way.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_smoke_runs import cli as smoke_cli  # same folder (rootdir-relative imports)

pytestmark = pytest.mark.e2e


def cli(*args, check=True):
    return smoke_cli(*map(str, args), check=check)


def snapshot(run: Path) -> dict:
    """Every path under the run folder with its size, modification time and content hash."""
    out = {}
    for p in sorted(run.rglob("*")):
        st = p.stat()
        out[p.relative_to(run).as_posix()] = (p.is_dir(), st.st_size, st.st_mtime_ns,
                                              None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())["files"]


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ckpt") / "run"
    cli("run", "qwen25_7b", "--smoke", "--steps", "2", "--out", run, "--quiet", "trainer.checkpoint_interval=1")
    return run



def flip_a_bit(path) -> None:
    """Alter one bit a third of the way into ``path`` (its size stays; only a checksum sees it)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))

def test_resume_refuses_a_truncated_and_an_altered_shard_by_name(smoke_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    ckpt = run / "checkpoints" / "step_000002"
    files = manifest(ckpt)
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert sorted([*files, "manifest.json"]) == on_disk  # every file, each with size and checksum
    assert {"trainer_state.json", "metrics.jsonl", "rng_rank0.pt", "actor/.metadata"} <= set(files)
    shards = sorted(n for n in files if n.endswith(".distcp"))
    assert len(shards) >= 2 and all(len(files[n]["sha256"]) == 64 for n in files)

    cut, flipped = ckpt / shards[0], ckpt / shards[1]
    os.truncate(cut, cut.stat().st_size // 2)
    flip_a_bit(flipped)
    before = snapshot(run)

    res = cli("run", "qwen25_7b", "--smoke", "--steps", "4", "--resume", run, "--quiet", check=False)
    err = flat(res.stderr)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"{cut}: truncated" in err and f"{flipped}: altered" in err, err
    assert "nothing was loaded or changed" in err and "Traceback" not in res.stderr
    assert snapshot(run) == before  # not a byte, not a timestamp

    # the way out it names: point `latest` at the previous checkpoint, then resume from there
    command = re.search(r"`(echo step_\d+ > \S+)`", err).group(1)
    subprocess.run(["bash", "-c", command], check=True)
    cli("run", "qwen25_7b", "--smoke", "--steps", "3", "--resume", run, "--quiet")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == [0, 1, 2]


def test_a_deleted_manifest_does_not_turn_the_check_off(smoke_run, tmp_path):
    """Deleting manifest.json and altering a shard used to resume with a notice that the checkpoint
    "predates manifests" (the run wrote one) and load the altered shard."""
    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    ckpt = run / "checkpoints" / "step_000002"
    shard = ckpt / sorted(n for n in manifest(ckpt) if n.endswith(".distcp"))[0]
    (ckpt / "manifest.json").unlink()
    flip_a_bit(shard)
    before = snapshot(run)
    res = cli("run", "qwen25_7b", "--smoke", "--steps", "3", "--resume", run, "--quiet", check=False)
    err = flat(res.stderr)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"{ckpt / 'manifest.json'}: missing" in err and "predates" not in err and "written before" not in err, err
    assert "echo step_000001 >" in err and snapshot(run) == before, err


def test_a_lora_checkpoints_base_model_json_is_covered(tmp_path):
    pytest.importorskip("peft")
    run = tmp_path / "lora"
    cli("run", "qwen25_7b", "--smoke", "--steps", "1", "--out", run, "--quiet", "actor.lora.rank=4",
        "trainer.checkpoint_interval=1", "trainer.export_hf=false")
    ckpt = run / "checkpoints" / "step_000001"
    assert "actor/base_model.json" in manifest(ckpt)
    f = ckpt / "actor" / "base_model.json"
    ref = json.loads(f.read_text())
    ref["lora"]["alpha"] = ref["lora"]["alpha"] * 2  # still valid JSON, another adapter scale
    f.write_text(json.dumps(ref, indent=2))
    before = snapshot(run)
    res = cli("run", "qwen25_7b", "--smoke", "--steps", "2", "--resume", run, "--quiet", check=False)
    err = flat(res.stderr)
    assert res.returncode == 2 and (f"{f}: altered" in err or f"{f}: changed after the save" in err), err
    assert "there is no older checkpoint" in err
    assert snapshot(run) == before
