"""Where a run's per-step metrics go besides ``metrics.jsonl`` (always written): ``trainer.loggers``.

* ``tensorboard`` -- event files under ``<run>/tensorboard`` through ``torch.utils.tensorboard``
  (needs the ``tensorboard`` package: ``pip install -e ".[tensorboard]"``); one scalar per numeric
  key of the row, at ``global_step = step``.
* ``wandb`` -- a W&B run in ``<run>/wandb``, online when the user is logged in (``WANDB_API_KEY`` or
  ``wandb login``), offline otherwise (``wandb sync <run>/wandb/offline-run-*`` uploads it later);
  ``WANDB_MODE`` set by the user wins. Needs ``pip install -e ".[wandb]"``.

A logger that is named but not installed is refused before the run starts (:func:`missing`).
The driver calls :meth:`Logger.log` with exactly the rows it writes to metrics.jsonl.
"""
from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

#: logger name -> (module that must import, the extra that installs it)
REQUIRES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
NAMES = ("jsonl", *REQUIRES)


class Logger(Protocol):
    def log(self, row: dict) -> None: ...

    def close(self) -> None: ...


def missing(names: Sequence[str]) -> list[str]:
    """Problems for loggers named in the recipe that cannot run here (with the install command)."""
    out = []
    for n in names:
        if n in REQUIRES and importlib.util.find_spec(REQUIRES[n][0]) is None:
            out.append(f"trainer.loggers: {n} needs the `{REQUIRES[n][0]}` package, not installed here: "
                       f"pip install -e \".[{REQUIRES[n][1]}]\" (or drop {n} from trainer.loggers)")
    return out


def _scalars(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardLogger:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(run_dir) / "tensorboard"
        self._w = SummaryWriter(log_dir=str(self.dir))

    def log(self, row: dict) -> None:
        for k, v in _scalars(row).items():
            self._w.add_scalar(k, v, global_step=int(row["step"]))
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _wandb_logged_in(wandb: Any) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(wandb.api.api_key)
    except Exception:  # noqa: BLE001 - no settings / netrc: not logged in
        return False


class WandbLogger:
    def __init__(self, run_dir: Path, project: str, config: dict, resume: bool) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_logged_in(wandb) else "offline")
        self.mode = mode
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", f"rlrecipes-{project}"), dir=str(run_dir),
                               name=Path(run_dir).name, id=Path(run_dir).name.replace("/", "-"), config=config,
                               mode=mode, resume="allow" if resume else None, reinit=True)

    def log(self, row: dict) -> None:
        self._run.log(_scalars(row), step=int(row["step"]))

    def close(self) -> None:
        self._run.finish()


def build(names: Sequence[str], run_dir: Path, *, project: str, config: dict, resume: bool) -> list[Logger]:
    """The extra loggers a recipe names (``jsonl`` is the metrics file itself, written by the driver)."""
    out: list[Logger] = []
    for n in dict.fromkeys(names):
        if n == "tensorboard":
            out.append(TensorBoardLogger(run_dir))
        elif n == "wandb":
            out.append(WandbLogger(run_dir, project, config, resume))
    return out
