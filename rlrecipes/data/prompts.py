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


from .errors import DataError  # noqa: E402 (re-exported: rlrecipes.data.prompts.DataError)


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


def _row_to_example(row: Any, where: str, prompt_key: str, answer_key: str, image_key: str | None = None,
                    base: Path | None = None) -> dict:
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
    if image_key:
        from .images import row_images

        imgs = row_images(row, image_key, where)
        if imgs is not None:
            out["images"], out["image_base"] = imgs, base
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
            raise DataError(f"{path}: no column {top!r} (columns: {', '.join(names)}){hint} Set data.prompt_key, "
                            "data.answer_key or data.image_key to the column's name")
    for i, row in enumerate(table.to_pylist(), 1):
        yield f"{path}:row {i}", row


def load_prompt_rows(
    path: str | os.PathLike,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    on_malformed: str = "error",
    image_key: str | None = None,
) -> tuple[list[dict], int]:
    """Read prompt rows from ``.jsonl``/``.json`` (one object per line) or ``.parquet``.

    Args:
        prompt_key, answer_key: field names (dotted for nested, e.g. ``reward_model.ground_truth``).
        on_malformed: ``error`` raises :class:`DataError` naming ``file:line``; ``skip`` drops the row.
        image_key: the field with the row's images (vision-language data, verl's ``images``): kept
            raw under ``"images"`` (decoded by :class:`PromptDataset`); a Parquet file must have the column.
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
        it = _iter_parquet(p, [prompt_key, answer_key] + ([image_key] if image_key else []))
    else:
        raise DataError(f"{p}: unsupported file type {suffix!r}; use .jsonl or .parquet")
    rows, skipped = [], 0
    for where, raw in it:
        try:
            if isinstance(raw, Exception):
                raise raw
            rows.append(_row_to_example(raw, where, prompt_key, answer_key, image_key, p.parent))
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


def _place_images(text: str, marks: list[str], where: str) -> str:
    """The rendered prompt with its ``<image>`` marks replaced by the images' tokens, in order."""
    from .images import IMAGE_MARK

    pieces = text.split(IMAGE_MARK)
    if len(pieces) - 1 != len(marks):
        raise DataError(f"{where}: the rendered prompt holds {len(pieces) - 1} {IMAGE_MARK} marks for {len(marks)} "
                        "image(s) (the chat template changed them?)")
    return "".join(p + m for p, m in zip(pieces, marks + [""]))


@dataclass
class PromptDataset:
    """Tokenised prompts with a length filter.

    Args:
        rows: from :func:`load_prompt_rows` or :func:`rlrecipes.data.smoke_task_dataset`.
        tokenizer: a HF tokenizer (or None: no tokenisation, no length filter).
        max_prompt_len: drop prompts with more tokens than this (count in :attr:`n_dropped_too_long`).
        tools: the tools' JSON schemas, given to the chat template (multi-turn rollouts).
        vision: a vision-language model's processor (``rlrecipes.models.vision.VisionSettings``:
            ``process(image) -> VisionInput``, ``placeholder(grid) -> str``, ``cat(inputs)``); rows with ``images``
            need it. Each image is decoded once here, its ``<image>`` mark (or the prompt's start)
            becomes the image tokens, and the item keeps ``"vision"`` (the pixels and grid every
            stage reads by the item's index).
        blank_images: replace every image by a black one of the same size (the smoke task's control:
            the same run with nothing to see).
    Items: ``{"prompt_ids": list[int], "prompt_text": str, "answer": str, "source": str}`` and
    ``"tool_kwargs"`` / ``"vision"`` where the row has them.
    """

    rows: list[dict]
    tokenizer: Any = None
    max_prompt_len: int | None = None
    tools: list[dict] | None = None
    vision: Any = None
    blank_images: bool = False
    n_dropped_too_long: int = field(init=False, default=0)
    n_chat_joined: int = field(init=False, default=0)
    """Chat-message prompts rendered without a template (the tokenizer has none): contents joined."""
    items: list[dict] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        chat = self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))
        for i, row in enumerate(self.rows):
            if not chat and not isinstance(row["prompt"], str):
                self.n_chat_joined += 1
            where = row.get("source", f"row {i}")
            prompt, vis = row["prompt"], None
            if row.get("images"):
                prompt, marks, vis = self._images(row, where)
            text = render_prompt(prompt, self.tokenizer, self.tools)
            if vis is not None:
                text = _place_images(text, marks, where)
            item = {"prompt_text": text, "answer": row["answer"], "source": where}
            if vis is not None:
                item["vision"] = vis
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

    def _images(self, row: dict, where: str):
        """The row's images decoded and processed, and its prompt with one ``<image>`` mark per image."""
        from .images import IMAGE_MARK, decode_image

        if self.vision is None:
            raise DataError(f"{where}: the row has images but the model is text-only; train a vision-language "
                            "family (model.family: qwen2_5_vl) or unset data.image_key")
        import numpy as np

        imgs = row["images"]
        prompt = row["prompt"]
        texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
        n_marks = sum(t.count(IMAGE_MARK) for t in texts)
        if n_marks > len(imgs):
            raise DataError(f"{where}: the prompt has {n_marks} {IMAGE_MARK} marks but the row has {len(imgs)} "
                            "image(s); give one image per mark")
        lead = IMAGE_MARK * (len(imgs) - n_marks)  # images without a mark open the (first user) prompt
        if lead:
            if isinstance(prompt, str):
                prompt = lead + prompt
            else:
                prompt = [dict(m) for m in prompt]
                first = next((m for m in prompt if m["role"] == "user"), prompt[0])
                first["content"] = lead + first["content"]
        marks, parts = [], []
        for k, raw in enumerate(imgs):
            arr = decode_image(raw, f"{where}: image {k}", row.get("image_base"))
            if self.blank_images:
                arr = np.zeros_like(arr)
            v = self.vision.process(arr)
            marks.append(self.vision.placeholder(v.grid_thw[0].tolist()))
            parts.append(v)
        return prompt, marks, self.vision.cat(parts)

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
