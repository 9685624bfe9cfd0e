"""Vision-language runs through the CLI: a geometry3k-shaped Parquet file (verl's columns, images as
PNG bytes) written here loads and trains for 2 steps on the smoke Qwen2.5-VL, and the trained model
exports as an HF Qwen2.5-VL folder."""
import json
import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlrecipes.data.images import COLORS, draw_shape, encode_png

pytestmark = pytest.mark.e2e


def write_geometry3k_parquet(path, n: int = 64) -> None:
    """verl's geometry3k preprocessing schema: data_source, prompt (chat messages with an <image> mark),
    images (a list of {bytes, path}), ability, reward_model {ground_truth, style}, extra_info."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        k = rng.randrange(len(COLORS))
        rows.append({"data_source": "hiyouga/geometry3k",
                     "prompt": [{"role": "user", "content": "<image>?="}],
                     "images": [{"bytes": encode_png(draw_shape(rng, COLORS[k])), "path": None}],
                     "ability": "math", "reward_model": {"ground_truth": str(k), "style": "rule"},
                     "extra_info": {"split": "train", "index": i}})
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_geometry3k_parquet_trains_two_steps(tmp_path):
    data = tmp_path / "geometry3k_train.parquet"
    write_geometry3k_parquet(data)
    assert pq.read_schema(data).field("images").type == pa.list_(pa.struct([("bytes", pa.binary()),
                                                                            ("path", pa.null())]))
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rlrecipes", "run", "qwen25_vl_7b", "--smoke", "--steps", "2", "--quiet",
                          "--out", str(run), "data.synthetic=null", f"data.train_files=[{data}]",
                          "data.prompt_key=prompt", "data.answer_key=reward_model.ground_truth",
                          "data.image_key=images"],
                         capture_output=True, text=True, timeout=900, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["reward/errors"] == 0 for r in rows)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)  # the sampler saw the trainer's pixels
    cfg = json.loads((run / "actor_hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
