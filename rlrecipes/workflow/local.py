"""One colocated worker in this process, without Ray: what ``rlrecipes run <recipe> --smoke -d 1`` does.

The same plan, resolved recipe, smoke tokenizer, in-worker TransferDock and :class:`Worker` (its
setup, the controller loop, the stages) as a Ray run, driven from the calling process. The GPU suite
(``benchmarks/gpu_suite.py``), the GPU stage tests (``tests/gpu``) and the device-strict tests on CPU
(``rlrecipes.device_strict``) run whole RL steps through it, so a failure carries the caller's
traceback and a debugger can step into any stage.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from .. import device as devmod
from .worker import Worker


class _Remote:
    """``.remote(...)`` of a Ray actor method, called in this process."""

    def __init__(self, fn) -> None:
        self.remote = fn


class LocalProgress:
    """The driver's progress actor, in this process: keeps the metrics rows and the stages entered."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.stages: list[tuple[int, str]] = []
        self.setup: dict = {}
        """What the worker's setup reported (its device, the step's stages, ...)."""
        self.metrics = _Remote(self.rows.append)
        self.stage = _Remote(lambda step, name: self.stages.append((step, name)))
        self.rollout = _Remote(lambda *a: None)


class LocalWorker(Worker):
    def binding(self) -> dict:  # no Ray: the process sees its device as index 0
        kind = devmod.resolve(self.recipe.resources.device)
        env = devmod.VISIBLE_DEVICES_ENV[kind]
        return {"rank": self.rank, "device_type": kind, "assigned": [],
                "visible": os.environ.get(env) if env else None, "local_rank": 0}

    def _rows_delivered(self) -> None:  # in this process: every row is already on the board
        pass


def run_local(recipe_name: str, overrides: Sequence[str], steps: int, run_dir: Path) -> LocalProgress:
    """Run ``steps`` steps of ``recipe_name`` (``--smoke``, with ``overrides``) on one worker in this
    process; the metrics rows go to ``<run_dir>/metrics.jsonl`` as the driver writes them, and the
    returned progress holds them, every ``(step, stage)`` entered and the worker's setup report. A stage that fails raises the
    worker's ``StageFailure`` (naming the stage and step) chained to the original exception."""
    import yaml

    from ..core.dock import TransferDock
    from ..data import build_smoke_tokenizer
    from ..metrics import MetricsWriter
    from ..plan import build_plan, format_violations, refuse_missing_engines, resolve
    from ..recipe import load_recipe

    recipe = load_recipe(recipe_name, smoke=True, overrides=list(overrides))
    plan = build_plan(recipe, None, 1, keep_batch=True)
    if not plan.ok:
        raise RuntimeError(format_violations(plan))
    if plan.world != 1:
        raise RuntimeError(f"the in-process driver runs one worker; the plan has {plan.world}")
    refuse_missing_engines(plan)
    recipe = resolve(recipe, plan)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    (run_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=2))
    build_smoke_tokenizer(run_dir / "tokenizer", vision=recipe.model.dims().has_vision)
    progress = LocalProgress()
    w = LocalWorker(0, 1, recipe.model_dump(mode="json"), str(run_dir.resolve()), [TransferDock.in_worker()], progress)
    port = w.open_store()
    try:
        progress.setup = w.setup("127.0.0.1", port)
        w.run(0, steps)
    finally:
        w.shutdown()
        writer = MetricsWriter(run_dir / "metrics.jsonl")
        for row in progress.rows:
            writer.write(row)
        writer.close()
    return progress


__all__ = ["LocalProgress", "LocalWorker", "run_local"]
