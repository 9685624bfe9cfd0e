"""The bundled smoke task: a deterministic synthetic digit task and a character-level tokenizer.

The tokenizer is a real Hugging Face tokenizer (``tokenizers`` WordLevel model wrapped in
``PreTrainedTokenizerFast``) saved with ``save_pretrained`` so runs load it with
``AutoTokenizer.from_pretrained(folder)`` -- the same code path as a real model. Its vocabulary
has 32 entries (the smoke models use ``vocab_size=32``).

Task (chosen by experiment, see ``benchmarks/smoke_task_check.py``): **copy** a short digit
string. Prompt ``"<bos>407="``, expected response ``"407"`` then ``<eos>``. The reward
(:func:`rlrecipes.rewards.smoke_reward`) is graded: the fraction of leading characters that are
right. Also ``reverse``, ``add`` and ``longtail`` (a heavy-tailed response length, see
:data:`LONGTAIL_LONG_SHARE`): prompt ``"7*45="`` asks for the digit ``7`` written 45 times.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
# 4 special + 10 digits + 18 symbols/letters = 32
CHARS = list("0123456789") + list("+-*/=()., ?:abcxy")
SMOKE_VOCAB_SIZE = 32
#: the vision-language smoke vocabulary: the 31 tokens above, Qwen2.5-VL's three vision tokens, extras
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
SMOKE_VL_VOCAB_SIZE = 40
SMOKE_TASKS = ("copy", "reverse", "add", "longtail", "colors")
"""``colors`` is the vision-language task (:mod:`rlrecipes.data.images`): the answer is the colour of
a shape in the row's image."""

# longtail: "repeat digit d n times", prompt "d*n=" (as Python's "7" * 45), answer length n drawn per
# row: with probability LONGTAIL_LONG_SHARE uniform in LONGTAIL_LONG, else uniform in LONGTAIL_SHORT
# (bounds inclusive). Median 3 digits, 10 % of the rows need 40-60 (mean 7.7), so a synchronous
# step waits for its few long samples; the longest response (60 digits + <eos>) fits
# rollout.sampling.max_new_tokens=64, the prompt (6 tokens with <bos>) data.max_prompt_length=32.
LONGTAIL_SHORT = (2, 4)
LONGTAIL_LONG = (40, 60)
LONGTAIL_LONG_SHARE = 0.1


def smoke_vocab(vision: bool = False) -> dict[str, int]:
    """Token -> id; ids 0..3 are pad, bos, eos, unk. ``vision``: the VL vocabulary (40 ids, the vision
    tokens at 31, 32, 33, as the smoke qwen2_5_vl dims say)."""
    toks = SPECIAL_TOKENS + CHARS + (VISION_TOKENS if vision else [])
    size = SMOKE_VL_VOCAB_SIZE if vision else SMOKE_VOCAB_SIZE
    toks = toks + [f"<extra_{i}>" for i in range(size - len(toks))]
    assert len(toks) == size, len(toks)
    return {t: i for i, t in enumerate(toks)}


def build_smoke_tokenizer(folder: str | os.PathLike, *, vision: bool = False) -> Path:
    """Build the character-level smoke tokenizer and ``save_pretrained`` it into ``folder``.

    Every character is one token; ``<bos>`` is prepended (post-processor) and decoding joins the
    characters back without spaces. Returns the folder path; load with
    ``AutoTokenizer.from_pretrained(folder)``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = smoke_vocab(vision)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    if vision:  # whole tokens, never split into characters
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left", model_max_length=512,
    )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


def smoke_example(rng: random.Random, task: str = "copy", num_digits: int = 3) -> dict[str, str]:
    """One example ``{"prompt": ..., "answer": ...}`` of the smoke task.

    ``longtail``: prompt ``"7*45="``, answer ``"7*45"`` (the reward wants ``"777...7"``, 45 digits).
    """
    if task == "copy":
        s = "".join(rng.choice("0123456789") for _ in range(num_digits))
        return {"prompt": f"{s}=", "answer": s}
    if task == "reverse":
        s = "".join(rng.choice("0123456789") for _ in range(num_digits))
        return {"prompt": f"{s}=", "answer": s[::-1]}
    if task == "add":
        a, b = rng.randrange(10 ** num_digits), rng.randrange(10 ** num_digits)
        # a multi-turn rollout's calculator call takes the sample's expression (tool format smoke)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b), "tool_kwargs": {"calculator": {"expression": f"{a}+{b}"}}}
    if task == "longtail":  # num_digits does not apply
        lo, hi = LONGTAIL_LONG if rng.random() < LONGTAIL_LONG_SHARE else LONGTAIL_SHORT
        n, d = rng.randint(lo, hi), rng.choice("0123456789")
        # the answer stays in the compact notation: smoke_reward expands "d*n" (and grades its length)
        return {"prompt": f"{d}*{n}=", "answer": f"{d}*{n}"}
    raise ValueError(f"unknown smoke task {task!r}; choose one of {', '.join(SMOKE_TASKS)}")


def smoke_task_dataset(n: int, seed: int = 0, *, task: str = "copy", num_digits: int = 3) -> list[dict[str, str]]:
    """``n`` deterministic smoke examples from ``seed`` (no files). Rows: ``{"prompt", "answer"}``.

    The same ``(n, seed, task, num_digits)`` always gives the same rows, and a longer dataset
    starts with the rows of a shorter one (``longtail`` ignores ``num_digits``).
    """
    if n < 0:
        raise ValueError(f"smoke_task_dataset: n must be >= 0; got {n}")
    if task == "colors":  # rows with images: {"prompt", "answer", "images"}
        from .images import vision_smoke_dataset

        return vision_smoke_dataset(n, seed)
    key = f"{task}-{seed}" if task == "longtail" else f"{task}-{num_digits}-{seed}"
    rng = random.Random(f"rlrecipes-smoke-{key}")
    return [smoke_example(rng, task, num_digits) for _ in range(n)]
