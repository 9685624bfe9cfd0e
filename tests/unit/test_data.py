"""Prompt datasets (JSONL/Parquet, malformed rows, filter, sharding, resume) and the smoke task."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rlrecipes.data import (
    SMOKE_VOCAB_SIZE,
    DataError,
    PromptDataset,
    PromptSampler,
    build_smoke_tokenizer,
    load_prompt_rows,
    smoke_task_dataset,
)
from rlrecipes.rewards import smoke_reward


@pytest.fixture(scope="module")
def smoke_tok(tmp_path_factory):
    folder = build_smoke_tokenizer(tmp_path_factory.mktemp("tok"))
    return AutoTokenizer.from_pretrained(str(folder))


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_custom_fields_and_nested(tmp_path):
    p = _write_jsonl(tmp_path / "train.jsonl", [
        json.dumps({"q": "1+1=", "meta": {"gt": 2}}),
        "",
        json.dumps({"q": [{"role": "user", "content": "hi"}], "meta": {"gt": "x"}}),
    ])
    rows, skipped = load_prompt_rows(p, prompt_key="q", answer_key="meta.gt")
    assert skipped == 0
    assert [r["answer"] for r in rows] == ["2", "x"]
    assert rows[0]["prompt"] == "1+1=" and rows[1]["prompt"][0]["content"] == "hi"
    assert rows[1]["source"].endswith("train.jsonl:3")


def test_jsonl_invalid_json_names_file_and_line(tmp_path):
    p = _write_jsonl(tmp_path / "train.jsonl", [json.dumps({"prompt": "a", "answer": "1"}), "{not json"])
    with pytest.raises(DataError, match=r"train\.jsonl:2: invalid JSON"):
        load_prompt_rows(p)


def test_jsonl_missing_key_suggests(tmp_path):
    p = _write_jsonl(tmp_path / "train.jsonl", [json.dumps({"prompt": "a", "answers": "1"})])
    with pytest.raises(DataError, match=r"train\.jsonl:1: missing key 'answer'.*did you mean 'answers'"):
        load_prompt_rows(p)


def test_jsonl_skip_malformed_counts(tmp_path):
    p = _write_jsonl(tmp_path / "train.jsonl", [
        json.dumps({"prompt": "a", "answer": "1"}),
        "{bad",
        json.dumps({"prompt": "b"}),
        json.dumps([1, 2]),
        json.dumps({"prompt": None, "answer": "1"}),
        json.dumps({"prompt": "c", "answer": 3}),
    ])
    rows, skipped = load_prompt_rows(p, on_malformed="skip")
    assert [r["prompt"] for r in rows] == ["a", "c"]
    assert skipped == 4


def test_parquet_and_bad_column(tmp_path):
    p = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["12=", "34="], "solution": ["12", "34"]}), p)
    rows, _ = load_prompt_rows(p, prompt_key="question", answer_key="solution")
    assert [(r["prompt"], r["answer"]) for r in rows] == [("12=", "12"), ("34=", "34")]
    with pytest.raises(DataError, match=r"no column 'solutions'.*did you mean 'solution'"):
        load_prompt_rows(p, prompt_key="question", answer_key="solutions")


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_prompt_rows(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type"):
        load_prompt_rows(tmp_path / "x.csv")


def test_length_filter_counts_dropped(smoke_tok):
    rows = [{"prompt": "1=", "answer": "1"}, {"prompt": "123456=", "answer": "1"}, {"prompt": "12=", "answer": "1"}]
    ds = PromptDataset(rows, tokenizer=smoke_tok, max_prompt_len=4)  # bos + 3 chars
    assert len(ds) == 2 and ds.n_dropped_too_long == 1
    assert ds[0]["prompt_ids"] == [smoke_tok.bos_token_id] + smoke_tok.convert_tokens_to_ids(["1", "="])
    with pytest.raises(DataError, match="raise data.max_prompt_len"):
        PromptDataset(rows[1:2], tokenizer=smoke_tok, max_prompt_len=2)


def test_chat_template_applied(tmp_path, smoke_tok):
    smoke_tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    try:
        ds = PromptDataset([{"prompt": "12", "answer": "12"}], tokenizer=smoke_tok)
        assert ds[0]["prompt_text"] == "12="
        # the template has no bos, and special tokens are not added a second time
        assert ds[0]["prompt_ids"] == smoke_tok.convert_tokens_to_ids(["1", "2", "="])
    finally:
        smoke_tok.chat_template = None


def test_sampler_deterministic_disjoint_and_complete():
    n, dp = 10, 2
    s0, s1 = PromptSampler(n, seed=3, dp_rank=0, dp_size=dp), PromptSampler(n, seed=3, dp_rank=1, dp_size=dp)
    e0, e1 = s0.epoch_indices(0), s1.epoch_indices(0)
    assert set(e0).isdisjoint(e1) and sorted(e0 + e1) == list(range(n))
    assert e0 == PromptSampler(n, seed=3, dp_rank=0, dp_size=dp).epoch_indices(0)
    assert e0 != PromptSampler(n, seed=4, dp_rank=0, dp_size=dp).epoch_indices(0)
    assert s0.epoch_indices(1) != e0  # reshuffled each epoch


def test_sampler_resume_continues_exactly():
    a = PromptSampler(7, seed=1)
    seq_a = [a.next_indices(3) for _ in range(5)]
    b = PromptSampler(7, seed=1)
    first = [b.next_indices(3) for _ in range(2)]
    state = b.state_dict()
    c = PromptSampler(7, seed=1)
    c.load_state_dict(json.loads(json.dumps(state)))
    rest = [c.next_indices(3) for _ in range(3)]
    assert first + rest == seq_a
    assert state["epoch"] == 0 and state["index"] == 6
    assert c.epoch == 2  # 2 full batches per epoch of 7 rows
    with pytest.raises(DataError, match="seed=1 but this run has 2"):
        PromptSampler(7, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="cannot draw 8 prompts per rank"):
        PromptSampler(7).next_indices(8)


def test_smoke_dataset_deterministic():
    a = smoke_task_dataset(20, seed=5)
    assert a == smoke_task_dataset(20, seed=5)
    assert a[:10] == smoke_task_dataset(10, seed=5)
    assert a != smoke_task_dataset(20, seed=6)
    for r in a:
        assert r["prompt"] == r["answer"] + "=" and len(r["answer"]) == 3 and r["answer"].isdigit()
    add = smoke_task_dataset(5, seed=0, task="add", num_digits=1)
    for r in add:
        x, y = r["prompt"][:-1].split("+")
        assert int(r["answer"]) == int(x) + int(y)
        assert r["tool_kwargs"] == {"calculator": {"expression": f"{x}+{y}"}}
    rev = smoke_task_dataset(5, seed=0, task="reverse")
    assert all(r["answer"] == r["prompt"][:-1][::-1] for r in rev)
    with pytest.raises(ValueError, match="unknown smoke task"):
        smoke_task_dataset(1, task="multiply")


def test_smoke_tokenizer_roundtrip(smoke_tok):
    assert len(smoke_tok) == SMOKE_VOCAB_SIZE == 32
    assert (smoke_tok.pad_token_id, smoke_tok.bos_token_id, smoke_tok.eos_token_id) == (0, 1, 2)
    for r in smoke_task_dataset(10, 0, task="add"):
        ids = smoke_tok(r["prompt"] + r["answer"])["input_ids"]
        assert ids[0] == smoke_tok.bos_token_id and max(ids) < 32 and smoke_tok.unk_token_id not in ids
        assert smoke_tok.decode(ids, skip_special_tokens=True) == r["prompt"] + r["answer"]
    # the smoke reward on a decoded response
    resp = smoke_tok.convert_tokens_to_ids(list("407")) + [smoke_tok.eos_token_id]
    assert smoke_reward(smoke_tok.decode(resp, skip_special_tokens=True), "407") == 1.0


def test_smoke_dataset_feeds_prompt_dataset(smoke_tok):
    ds = PromptDataset(smoke_task_dataset(8, 0), tokenizer=smoke_tok, max_prompt_len=16)
    assert len(ds) == 8 and all(len(x["prompt_ids"]) == 5 for x in ds.items)
