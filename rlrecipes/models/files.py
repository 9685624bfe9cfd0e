"""Reading the files a run is given (weights, checkpoints, configs, tokenizers): every error names its file.

Libraries report a damaged file with their own exception, and often without its name (safetensors:
``incomplete metadata, file not fully covered``; torch: ``PytorchStreamReader failed reading zip
archive``; DCP: a traceback per rank). :func:`reading` wraps a load and re-raises what it raises as
:class:`FileLoadError`: one line that names the file, says what it was read as, quotes the
library's own last line and says what to do. An error that already names the file passes
through unchanged, so the project's own messages keep their wording.

It lives in ``models`` (the lowest piece every loader above it may import: models, engines,
recipe, workflow, inputs); ``data`` may not import ``models`` and names its files itself
(``data.prompts.DataError``).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

#: what to do about a damaged file, by what it was read as
FIX_WEIGHTS = "the file is damaged or incomplete: download or export the model folder again"
FIX_CONFIG = "fix the file (it must be valid JSON), or download the model folder again"
FIX_TOKENIZER = "download the tokenizer files again, or point model.tokenizer at another tokenizer folder"


class FileLoadError(ValueError):
    """A file exists but cannot be read as what it should be (damaged, truncated, another format).
    The message is one line: the file, what it was read as, the reason, and the fix."""

    def __init__(self, path: str | os.PathLike, what: str, why: str, fix: str = ""):
        self.path = Path(path)
        self.what, self.why, self.fix = what, why, fix
        super().__init__(f"{self.path}: cannot read this {what}: {why}" + (f"; {fix}" if fix else ""))

    def __reduce__(self):  # picklable with its fields (a worker's error crosses to the driver through Ray)
        return type(self), (self.path, self.what, self.why, self.fix)


def reason(e: BaseException, limit: int = 300) -> str:
    """A library exception in one line: its type and the last line of its message (a DCP
    ``CheckpointException`` carries each rank's whole traceback; the last line is the cause)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    text = lines[-1] if lines else ""
    if not text:
        return type(e).__name__
    if not text.startswith(type(e).__name__) and ":" not in text.split(" ", 1)[0]:
        text = f"{type(e).__name__}: {text}"
    cut = text.find(". ", 60)  # the first sentence of a long explanation says it
    if len(text) > 160 and cut > 0:
        text = text[:cut + 1]
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextmanager
def reading(path: str | os.PathLike, what: str, fix: str = "") -> Iterator[None]:
    """Run a load of ``path``; anything it raises becomes a :class:`FileLoadError` naming ``path``
    (an error whose message already holds the path, and interrupts, pass through unchanged)."""
    try:
        yield
    except (FileLoadError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - any library's error (DCP's CheckpointException is a
        # BaseException), re-raised with the file's name
        if str(path) in str(e):
            raise
        raise FileLoadError(path, what, reason(e), fix) from e


__all__ = ["FIX_CONFIG", "FIX_TOKENIZER", "FIX_WEIGHTS", "FileLoadError", "reading", "reason"]
