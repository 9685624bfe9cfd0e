"""What every recipe section shares: the error a bad recipe raises and the strict base model."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RecipeError(ValueError):
    """A bad recipe, override or recipe name. The message names the file/key and suggests a fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # inf/nan: an error
