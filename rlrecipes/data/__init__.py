"""Prompt datasets (JSONL / Parquet) and the bundled synthetic smoke task."""
from .prompts import DataError, PromptDataset, PromptSampler, load_prompt_rows, render_prompt
from .smoke import (
    SMOKE_TASKS,
    SMOKE_VOCAB_SIZE,
    build_smoke_tokenizer,
    smoke_example,
    smoke_task_dataset,
    smoke_vocab,
)

__all__ = [
    "DataError", "PromptDataset", "PromptSampler", "SMOKE_TASKS", "SMOKE_VOCAB_SIZE", "build_smoke_tokenizer",
    "load_prompt_rows", "render_prompt", "smoke_example", "smoke_task_dataset", "smoke_vocab",
]
