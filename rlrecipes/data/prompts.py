"""Prompt datasets: JSONL / Parquet loading, chat templates, length filter, deterministic
shuffling and DP sharding with a resumable position.

Typical use::

    rows, skipped = load_prompt_rows("data/train.jsonl", prompt_key="question", answer_key="answer")
    ds = PromptDataset(rows, tokenizer=tok, max_prompt_len=1024)
    sampler = PromptSampler(len(ds), seed=1, dp_rank=r, dp_size=dp)
    batch = [ds[i] for i in sampler.next_indices(prompts_per_rank)]
    ckpt["data"] = sampler.state_dict()          # ... later: sampler.load_state_dict(ckpt["data"])
"""
from __future__ import annotations

import difflib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

ON_MALFORMED = ("error", "skip")


class DataError(ValueError):
    """A malformed data file or row; the message names ``file:line`` and the fix."""


# --------------------------------------------------------------------------- loading
def _get_field(row: dict, key: str) -> Any:
    """``row[key]``; a dotted key (``reward_model.ground_truth``) walks nested objects. KeyError if absent."""
    cur: Any = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(part)
        cur = cur[part]
    return cur


def _missing_key_message(where: str, key: str, row: dict, config_key: str) -> str:
    keys = sorted(row.keys()) if isinstance(row, dict) else []
    close = difflib.get_close_matches(key.split(".")[-1], keys, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: missing key {key!r} (row has keys: {', '.join(keys) or 'none'}){hint} Set {config_key} to the field name."


def _row_to_example(row: Any, where: str, prompt_key: str, answer_key: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
    out = {}
    for key, cfg, name in ((prompt_key, "data.prompt_key", "prompt"), (answer_key, "data.answer_key", "answer")):
        try:
            v = _get_field(row, key)
        except KeyError:
            raise DataError(_missing_key_message(where, key, row, cfg)) from None
        if v is None:
            raise DataError(f"{where}: key {key!r} is null; fill it or set data.on_malformed=skip")
        out[name] = v
    p = out["prompt"]
    if isinstance(p, str):
        if not p.strip():
            raise DataError(f"{where}: prompt {prompt_key!r} is empty")
    elif isinstance(p, list) and all(isinstance(m, dict) and "content" in m for m in p) and p:
        out["prompt"] = [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in p]
    else:
        raise DataError(
            f"{where}: prompt {prompt_key!r} must be a string or a list of chat messages "
            f"[{{'role': ..., 'content': ...}}]; got {type(p).__name__}"
        )
    a = out["answer"]
    out["answer"] = a if isinstance(a, str) else json.dumps(a) if isinstance(a, (list, dict)) else str(a)
    kw = row.get("tool_kwargs")
    if kw is not None:  # multi-turn: the sample's own tool arguments, {tool: {argument: value}}
        if not (isinstance(kw, dict) and all(isinstance(k, str) and isinstance(v, dict) for k, v in kw.items())):
            raise DataError(f"{where}: 'tool_kwargs' must map tool names to argument objects, "
                            f"e.g. {{\"calculator\": {{\"expression\": \"1+2\"}}}}; got {kw!r}")
        out["tool_kwargs"] = kw
    out["source"] = where
    return out


def _iter_jsonl(path: Path) -> Iterable[tuple[str, Any | Exception]]:
    with open(path, "rb") as f:  # decoded per line: a bad byte is named by file:line, not by the codec
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, DataError(f"{where}: not UTF-8 text (byte {e.start} of the line); is this a JSONL "
                                       "file? Save it as UTF-8, one JSON object per line")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})")


def _iter_parquet(path: Path, columns: Sequence[str]) -> Iterable[tuple[str, Any | Exception]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - re-raised with the file name
        raise DataError(f"{path}: cannot read Parquet file ({e})") from e
    names = table.column_names
    for c in columns:
        top = c.split(".")[0]
        if top not in names:
            close = difflib.get_close_matches(top, names, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise DataError(f"{path}: no column {top!r} (columns: {', '.join(names)}){hint}")
    for i, row in enumerate(table.to_pylist(), 1):
        yield f"{path}:row {i}", row


def load_prompt_rows(
    path: str | os.PathLike,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    on_malformed: str = "error",
) -> tuple[list[dict], int]:
    """Read prompt rows from ``.jsonl``/``.json`` (one object per line) or ``.parquet``.

    Args:
        prompt_key, answer_key: field names (dotted for nested, e.g. ``reward_model.ground_truth``).
        on_malformed: ``error`` raises :class:`DataError` naming ``file:line``; ``skip`` drops the row.
    Returns:
        ``(rows, n_skipped)``; each row is ``{"prompt": str | list[message], "answer": str, "source": "file:line"}``.
    """
    if on_malformed not in ON_MALFORMED:
        raise DataError(f"data.on_malformed must be one of {', '.join(ON_MALFORMED)}; got {on_malformed!r}")
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file; check data.train_files (paths are relative to the working directory)")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        it = _iter_jsonl(p)
    elif suffix in (".parquet", ".pq"):
        it = _iter_parquet(p, [prompt_key, answer_key])
    else:
        raise DataError(f"{p}: unsupported file type {suffix!r}; use .jsonl or .parquet")
    rows, skipped = [], 0
    for where, raw in it:
        try:
            if isinstance(raw, Exception):
                raise raw
            rows.append(_row_to_example(raw, where, prompt_key, answer_key))
        except DataError:
            if on_malformed == "error":
                raise
            skipped += 1
    return rows, skipped


# --------------------------------------------------------------------------- tokenised dataset
def render_prompt(prompt: str | list[dict], tokenizer, tools: list[dict] | None = None) -> str:
    """Prompt text as the model sees it: the chat template (with the generation prompt, and the
    tools' schemas for a multi-turn rollout) when the tokenizer has one, else the raw text (message
    contents joined by newlines)."""
    has_template = tokenizer is not None and getattr(tokenizer, "chat_template", None)
    if has_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **({"tools": tools} if tools else {}))
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt)


@dataclass
class PromptDataset:
    """Tokenised prompts with a length filter.

    Args:
        rows: from :func:`load_prompt_rows` or :func:`rlrecipes.data.smoke_task_dataset`.
        tokenizer: a HF tokenizer (or None: no tokenisation, no length filter).
        max_prompt_len: drop prompts with more tokens than this (count in :attr:`n_dropped_too_long`).
        tools: the tools' JSON schemas, given to the chat template (multi-turn rollouts).
    Items: ``{"prompt_ids": list[int], "prompt_text": str, "answer": str, "source": str}`` and
    ``"tool_kwargs"`` where the row has them.
    """

    rows: list[dict]
    tokenizer: Any = None
    max_prompt_len: int | None = None
    tools: list[dict] | None = None
    n_dropped_too_long: int = field(init=False, default=0)
    n_chat_joined: int = field(init=False, default=0)
    """Chat-message prompts rendered without a template (the tokenizer has none): contents joined."""
    items: list[dict] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        chat = self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))
        for i, row in enumerate(self.rows):
            if not chat and not isinstance(row["prompt"], str):
                self.n_chat_joined += 1
            text = render_prompt(row["prompt"], self.tokenizer, self.tools)
            item = {"prompt_text": text, "answer": row["answer"], "source": row.get("source", f"row {i}")}
            if row.get("tool_kwargs") is not None:
                item["tool_kwargs"] = row["tool_kwargs"]
            if self.tokenizer is not None:
                # with a chat template the special tokens are already in the rendered text
                ids = self.tokenizer(text, add_special_tokens=not chat)["input_ids"]
                if self.max_prompt_len is not None and len(ids) > self.max_prompt_len:
                    self.n_dropped_too_long += 1
                    continue
                item["prompt_ids"] = list(ids)
            self.items.append(item)
        if not self.items:
            raise DataError(
                f"no prompts left: {len(self.rows)} rows, {self.n_dropped_too_long} longer than "
                f"max_prompt_len={self.max_prompt_len}; raise data.max_prompt_length"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


# --------------------------------------------------------------------------- sampling
@dataclass
class PromptSampler:
    """Deterministic shuffle + DP shard with a resumable ``(epoch, index)`` position.

    Each epoch permutes ``range(num_rows)`` with a RNG seeded by ``(seed, epoch)``; rank ``r``
    takes ``perm[r::dp_size]`` cut to ``num_rows // dp_size`` so every rank has the same count.
    :meth:`next_indices` returns the next ``n`` indices of this rank's shard; when fewer than
    ``n`` are left the rest of the epoch is skipped and the next epoch starts (every batch is
    full and the same on resume).
    """

    num_rows: int
    seed: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    shuffle: bool = True
    epoch: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        if not (0 <= self.dp_rank < self.dp_size):
            raise DataError(f"dp_rank={self.dp_rank} is outside [0, dp_size={self.dp_size})")
        if self.num_rows < self.dp_size:
            raise DataError(f"{self.num_rows} prompts cannot be sharded over {self.dp_size} DP ranks")

    @property
    def per_rank(self) -> int:
        return self.num_rows // self.dp_size

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's index order for ``epoch`` (the current epoch's is kept: drawn every step)."""
        cached = self.__dict__.get("_epoch_cache")
        if cached is not None and cached[0] == epoch:
            return list(cached[1])
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(f"rlrecipes-data-{self.seed}-{epoch}").shuffle(order)
        mine = order[self.dp_rank::self.dp_size][: self.per_rank]
        self.__dict__["_epoch_cache"] = (epoch, mine)
        return list(mine)

    def next_indices(self, n: int) -> list[int]:
        if n <= 0 or n > self.per_rank:
            raise DataError(
                f"cannot draw {n} prompts per rank from {self.per_rank} prompts per rank "
                f"({self.num_rows} rows / {self.dp_size} ranks); use a larger dataset or fewer prompts per step"
            )
        if self.index + n > self.per_rank:
            self.epoch += 1
            self.index = 0
        out = self.epoch_indices(self.epoch)[self.index:self.index + n]
        self.index += n
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_rows": self.num_rows,
                "dp_size": self.dp_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_rows", "dp_size", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"data position in the checkpoint has {key}={state[key]!r} but this run has "
                    f"{getattr(self, key)!r}; resume with the same data, seed and DP size"
                )
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
