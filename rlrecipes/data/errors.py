"""The data error every loader raises (its message names ``file:line`` or the row and the fix)."""
from __future__ import annotations


class DataError(ValueError):
    """A malformed data file or row; the message names ``file:line`` and the fix."""


__all__ = ["DataError"]
