"""``plan``'s checks of a pooled rollout (partial rollout, over-sampling, DAPO's dynamic sampling on
disaggregated rollout workers; ``workflow/pool.py``), and the device count of a disaggregated smoke."""
from __future__ import annotations

from ..algos.spec import pooled_rollout
from ..recipe import Recipe
from .checks import Violation, one_rank_sessions

POOL_RULE = "a pooled rollout runs on this rollout engine and layout"
WAIT_RULE = "rollout.max_wait_steps caps a pooled rollout"


def pool_checks(r: Recipe) -> list[Violation]:
    """A pooled rollout continues samples through the engine's turn sessions: refused where those
    run on one rank per instance only, and with routing replay (recorded per generate call); and
    ``rollout.max_wait_steps`` without a pool."""
    if not pooled_rollout(r):
        wait = r.rollout.max_wait_steps
        if wait is not None:  # a cap on the wait in a pool that this recipe does not keep
            return [Violation(WAIT_RULE, f"rollout.max_wait_steps={wait} caps how long a pooled rollout's groups "
                                         "wait, and this recipe keeps no pool (rollout.partial, rollout.oversample > 1, or "
                                         "algorithm.dynamic_sampling with resources.placement=disaggregated): set "
                                         "rollout.max_wait_steps=null, or turn one of those on")]
        return []
    v: list[Violation] = []
    what = ("rollout.partial" if r.rollout.partial else "rollout.oversample" if r.rollout.oversample > 1
            else "algorithm.dynamic_sampling with resources.placement=disaggregated")
    why = one_rank_sessions(r, f"{what} (it continues samples through turn sessions)")
    if why:
        v.append(Violation(POOL_RULE, why))
    if r.algorithm.routing_replay:
        v.append(Violation(POOL_RULE, f"algorithm.routing_replay records routing in whole generate calls, and {what} "
                                      "generates in chunks; set algorithm.routing_replay=false"))
    return v


def smoke_devices(r: Recipe) -> int:
    """A disaggregated ``--smoke`` run keeps its train group whole: when the smoke's devices less
    ``resources.rollout_devices`` cannot hold the train layouts (TP x PP of the actor, ref, critic),
    the rollout's devices are added to them instead (on the CPU a device is a process)."""
    res = r.resources
    dpn = res.devices_per_node
    if r.model.smoke is None or res.placement != "disaggregated" or not res.rollout_devices:
        return dpn
    mp = [r.actor.layout.tp * r.actor.layout.pp]
    for role in (r.ref, r.critic):
        lay = getattr(role, "layout", None)
        if lay is not None:
            mp.append(lay.tp * lay.pp)
    train = res.nodes * dpn - res.rollout_devices
    if train >= 1 and all(train % k == 0 for k in mp):
        return dpn
    return dpn + res.rollout_devices


def smoke_fit(r: Recipe) -> Recipe:
    """``r`` with the device count of :func:`smoke_devices`; the workers then share the smoke's CPUs
    (``cpus_per_worker`` scaled down), so the run asks this machine for no more CPUs than before."""
    grown = smoke_devices(r)
    if grown == r.resources.devices_per_node:
        return r
    r = r.model_copy(deep=True)
    res = r.resources
    res.cpus_per_worker = res.cpus_per_worker * res.devices_per_node / grown
    res.devices_per_node = grown
    return r


__all__ = ["POOL_RULE", "WAIT_RULE", "pool_checks", "smoke_devices", "smoke_fit"]
