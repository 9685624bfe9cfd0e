"""What every recipe section shares: the error a bad recipe raises and the strict base model."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RecipeError(ValueError):
    """A bad recipe, override or recipe name. The message names the file/key and suggests a fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # inf/nan: an error


def registered_engine(name: str, role: str, key: str) -> str:
    """``name`` when the engine registry (``rlrecipes/engines/registry.py``, ``BACKENDS``) holds it
    and its capabilities serve ``role`` (train or rollout); else a ValueError naming ``key`` and the
    engines that would do. The registry is the one list: a new engine needs no schema edit."""
    from ..engines.registry import BACKENDS, capabilities

    import difflib

    able = [n for n in BACKENDS if role in capabilities(n).roles]
    if name not in BACKENDS:
        close = difflib.get_close_matches(name, able, n=1)
        raise ValueError(f"{key}={name!r} is not a registered engine; one of: {', '.join(able)}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))
    if role not in capabilities(name).roles:
        raise ValueError(f"{key}={name!r}: that engine does not serve the {role} role; one of: {', '.join(able)}")
    return name


def registered_name(value: str, names, key: str, what: str) -> str:
    """``value`` when ``names`` (a registry's list) holds it; else a ValueError naming ``key``, the
    registered names and the nearest. The registry is the one list: the schema names none itself."""
    import difflib

    names = list(names)
    if value not in names:
        close = difflib.get_close_matches(str(value), names, n=1)
        raise ValueError(f"{key}={value!r} is not a registered {what}; one of: {', '.join(names)}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))
    return value
