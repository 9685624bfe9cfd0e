"""Watching the workers: wait on their calls, read the cluster's node table, and turn the first
failure into one message with its root cause (a dead worker before the survivors' broken
collectives; a lost node with the worker ranks it held), the last checkpoint and the command that
continues from it."""
from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..metrics import MetricsError
from ..recipe import Recipe
from . import checkpoint
from .events import EventSink, Progress, RunError
from .progress import RowCollector


#: seconds between two looks at the cluster's node table while the workers run
NODE_CHECK_S = 2.0
#: how long a worker's death that Ray attributes to its node waits for the GCS to mark the node dead
NODE_GRACE_S = 5.0


@dataclass
class WorkerPlacement:
    """Where the workers run, so that a lost node can be named with the ranks it took."""

    run_dir: Path
    nodes: list[str]
    """The Ray node id of each worker rank (``workers.json``'s ``nodes``)."""
    resume: str
    """The command that continues the run from its last checkpoint."""


def resume_command(recipe: Recipe, run_dir: Path, embedded: bool, address: Optional[str]) -> str:
    cmd = f"rlrecipes run {recipe.name} --resume {shlex.quote(str(run_dir))}"
    if embedded:
        cmd += " --smoke"
    if address:
        cmd += f" --address {shlex.quote(address)}"
    return cmd


def wait_for_workers(futures, progress, phase: str, tick=None, poll_s: float = 0.5,
          where: Optional[WorkerPlacement] = None) -> list:
    """Wait for every worker's call; ``tick()`` runs after each poll (and once more on a failure).

    The first failure stops the run with the root cause (see :func:`_failure`). With ``where``, the
    cluster's node table is read every :data:`NODE_CHECK_S` seconds too: a node of the run that
    Ray reports dead stops the run at once, naming it and the worker ranks it held, even while the
    workers' calls have not failed yet."""
    import ray

    from ..cluster import lost_nodes

    pending = list(futures)
    next_check = time.monotonic() + NODE_CHECK_S
    while pending:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        for f in done:
            try:
                ray.get(f)
            except Exception as e:  # a worker raised or died: stop everything now
                _last_tick(tick)
                raise RunError(_failure(futures, f, e, progress, phase, where), code=1) from None
        if where is not None and time.monotonic() >= next_check:
            next_check = time.monotonic() + NODE_CHECK_S
            lost = lost_nodes(where.nodes)
            if lost:
                _last_tick(tick)
                _settle(futures)
                raise RunError(_node_loss(where, lost, progress), code=1)
        if tick is not None:
            tick()
    return ray.get(futures)


def _last_tick(tick) -> None:
    """The rows that arrived before a failure still reach metrics.jsonl (best effort)."""
    if tick is None:
        return
    try:
        tick()
    except MetricsError:
        raise
    except Exception:  # noqa: BLE001 - the failure being reported matters more
        pass


def _failure(futures, f, e, progress, phase: str, where: Optional[WorkerPlacement]) -> str:
    """The message for a failed worker call: a lost node when Ray reports one of the run's nodes
    dead (waiting up to :data:`NODE_GRACE_S` when the actor's death names its node), else the root
    cause among the workers' failures."""
    from ..cluster import lost_nodes, unanswering_nodes, wait_for_lost_nodes

    lost = wait_for_lost_nodes(where.nodes, NODE_GRACE_S if _node_died(e) else 0.0) if where is not None else []
    failures = _settle(futures, (f, e))
    if where is not None and not lost:
        lost = lost_nodes(where.nodes)  # the grace may have let the GCS catch up
        if not lost:  # a raylet killed outright: the GCS learns it only from its health checks
            lost = unanswering_nodes([where.nodes[futures.index(d)] for d, x in failures if _died(x)])
    if lost:
        return _node_loss(where, lost, progress)
    msg = _root_cause(futures, failures, progress, phase)
    last = checkpoint.latest(where.run_dir) if where is not None else None
    if last is not None:  # the way on: the command that continues from the last checkpoint
        msg += f". Continue from its last checkpoint ({last.name}) with: {where.resume}"
    return msg


def _died(e: Exception) -> bool:
    """The actor itself is gone (its process or node), not a Python error raised in it."""
    import ray

    return isinstance(e, ray.exceptions.RayActorError) and not isinstance(e, ray.exceptions.RayTaskError)


def _node_died(e: Exception) -> bool:
    """Ray says the actor died with its node (rather than its process alone)."""
    if not _died(e):
        return False
    return bool(re.search(r"node (has )?died|node .*(dead|died|removed|terminated)", str(e), re.IGNORECASE))


def _node_loss(where: WorkerPlacement, lost: list, progress) -> str:
    import ray

    try:
        position = ray.get(progress.where.remote(), timeout=2)
    except Exception:  # noqa: BLE001 - the message stands without it
        position = None
    return node_loss_message(where, lost, position)


def node_loss_message(where: WorkerPlacement, lost: list, position: Optional[tuple[int, str]] = None) -> str:
    """Which nodes went (``cluster.LostNode``), with which worker ranks, where the run stood
    (``(step, stage)``), the last checkpoint and the command that continues from it."""
    at = f" during stage {position[1]!r} of step {position[0]}" if position else ""
    parts = []
    for node in lost:
        ranks = [r for r, n in enumerate(where.nodes) if n == node.node_id]
        held = (f"which held worker rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks
                else "which held none of the workers")
        parts.append(f"{node.describe()}, {held}")
    last = checkpoint.latest(where.run_dir)
    if last is not None:
        after = (f"The last checkpoint, {last}, is intact (checkpoints/{checkpoint.CKPT_LATEST} only moves after a "
                 f"complete save). Once the cluster has its nodes again, continue from it with: {where.resume}")
    else:
        after = ("No checkpoint had been written yet (trainer.checkpoint_interval), so the run starts again "
                 "once the cluster has its nodes again.")
    return (f"lost {'a node' if len(lost) == 1 else f'{len(lost)} nodes'} of the Ray cluster{at}: "
            f"{'; '.join(parts)}. The other workers were stopped. {after}")


def _settle(futures, first: Optional[tuple] = None, grace_s: float = 3.0) -> list[tuple]:
    """``first`` (a failed call and its error) and the other calls' failures that come within
    ``grace_s``. Each error is retrieved here, so Ray does not print it as unhandled at exit."""
    import ray

    failures = [first] if first is not None else []
    others = [x for x in futures if first is None or x is not first[0]]
    if others:
        done, _ = ray.wait(others, num_returns=len(others), timeout=grace_s)
        for d in done:
            try:
                ray.get(d)
            except Exception as e2:  # noqa: BLE001
                failures.append((d, e2))
    return failures


def _root_cause(futures, failures: list[tuple], progress, phase) -> str:
    """The first failure seen is often a survivor's broken collective; a dead worker is the cause.

    ``failures`` (:func:`_settle`): the first one, then the others that came within its grace; a
    dead worker is reported first.
    """
    died = [(d, x) for d, x in failures if _died(x)]
    f, e = died[0] if died else failures[0]
    msg = _worker_error(futures.index(f), e, progress, phase)
    if len(failures) > 1:
        msg += f" ({len(failures) - 1} other worker(s) stopped as a consequence)"
    return msg


def _worker_error(rank: int, e: Exception, progress, phase: str) -> str:
    import ray

    try:
        step, stage = ray.get(progress.where.remote(), timeout=5)
    except Exception:
        step, stage = -1, phase
    text = str(e)
    found = re.findall(r"worker rank \d+ failed in stage '[^']*'.*", text)
    if found:
        return found[-1].strip()
    if isinstance(e, (ray.exceptions.ActorDiedError, ray.exceptions.RayActorError)):
        return (f"worker rank {rank} died (its process was killed or crashed) during stage {stage!r} of step "
                f"{step}; the last checkpoint is intact")
    return f"worker rank {rank} failed in {phase}, stage {stage!r} of step {step}: {text.splitlines()[-1] if text else e!r}"


def watch_run(futures, rows: RowCollector, on_event: EventSink, where: Optional["WorkerPlacement"] = None) -> None:
    """Write rank 0's metrics rows into metrics.jsonl while the workers run; emit progress."""

    def tick() -> None:
        step, stage, new = rows.take()
        on_event(Progress(step, stage, new))

    wait_for_workers(futures, rows.progress, "run", tick, where=where)
    tick()  # rows rank 0 sent just before returning
