"""A verl-format Parquet file (gsm8k / math / deepscaler preprocessing schema) trains a smoke run."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_smoke_runs import cli  # same folder (rootdir-relative imports)

from rlrecipes.data import smoke_task_dataset

pytestmark = pytest.mark.e2e


def write_verl_parquet(path, rows):
    """Exactly verl's schema: prompt = chat messages, answer under reward_model.ground_truth."""
    table = pa.Table.from_pylist([{
        "data_source": "rlrecipes/copy",
        "prompt": [{"role": "user", "content": r["prompt"]}],
        "ability": "copy",
        "reward_model": {"style": "rule", "ground_truth": r["answer"]},
        "extra_info": {"split": "train", "index": i},
    } for i, r in enumerate(rows)])
    pq.write_table(table, path)


def test_smoke_run_on_verl_parquet(tmp_path):
    data = tmp_path / "train.parquet"
    write_verl_parquet(data, smoke_task_dataset(256, seed=0, task="copy", num_digits=3))
    assert pq.read_schema(data).field("prompt").type == pa.list_(pa.struct([("role", pa.string()),
                                                                            ("content", pa.string())]))
    run = tmp_path / "run"
    out = cli("run", "qwen25_7b", "--smoke", "--steps", "3", "--quiet", "--out", str(run), "data.synthetic=null",
              f"data.train_files=[{data}]", "data.prompt_key=prompt", "data.answer_key=reward_model.ground_truth",
              check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "chat messages but the tokenizer has no chat template" in " ".join(out.stderr.split())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["samples"] == 128 for r in rows)
    assert all(r["reward/errors"] == 0 for r in rows)


def test_own_model_data_and_reward_end_to_end(tmp_path):
    """docs/own_model_data_reward.md as a test: a local HF folder, a verl Parquet file, a module:function reward."""
    from rlrecipes.data import build_smoke_tokenizer
    from rlrecipes.engines.native.loader import build_model
    from rlrecipes.models import SMOKE

    model, _ = build_model(SMOKE["qwen2"], seed=0)
    model.save_pretrained(tmp_path / "my_model", safe_serialization=True)
    build_smoke_tokenizer(tmp_path / "my_model")
    write_verl_parquet(tmp_path / "train.parquet", smoke_task_dataset(256, seed=1, task="copy", num_digits=3))
    (tmp_path / "my_reward.py").write_text(
        "def score(completion: str, answer: str) -> float:\n"
        "    return 1.0 if completion.strip().startswith(answer) else 0.0\n")
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rlrecipes", "run", "qwen25_7b", "--smoke", "--steps", "2", "--quiet",
                          "--out", str(run), "model.smoke=null", "model.preset=null",
                          f"model.path={tmp_path / 'my_model'}", "data.synthetic=null",
                          f"data.train_files=[{tmp_path / 'train.parquet'}]", "data.answer_key=reward_model.ground_truth",
                          "reward.fn=my_reward:score"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["reward/errors"] == 0 for r in rows)
    assert (run / "actor_hf" / "config.json").is_file()
