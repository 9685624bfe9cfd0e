"""Which global ranks run what: the device groups of a recipe, for the workflow.

``colocated`` (default) puts every role on all ``world`` devices. ``disaggregated``
(``resources.placement``) gives the rollout the last ``resources.rollout_devices`` ranks and the
train roles (actor, ref, critic) the first ``world - rollout_devices``; each group's DP comes from
its own device count. The split and the TP x PP / EP divisions are checked by the same rule
functions as ``build_plan`` (:mod:`.checks`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..recipe import Recipe
from .checks import PlanError, divisibility_violations, role_layouts, rollout_devices_that_fit, where


@dataclass(frozen=True)
class PlacementGroups:
    """Which global ranks run what, and the layouts they run (from :func:`placement_groups`).

    Attributes:
        placement: ``"colocated"`` or ``"disaggregated"``.
        world: devices (global ranks) of the run.
        train_ranks: global ranks of the train group (actor, ref, critic); ``range(0, T)``.
        rollout_ranks: global ranks of the rollout; ``range(T, world)`` when disaggregated,
            the same ``range(0, world)`` as ``train_ranks`` when colocated.
        roles: ``actor``, [``ref``], [``critic``], ``rollout`` -> the role's
            :class:`~rlrecipes.core.parallel.ParallelLayout` over its group (``world``; DP inferred). A
            train role's rank ``i``
            in its layout is global rank ``i``; the rollout's layout rank ``j`` is global rank
            ``rollout_ranks[j]``.
    """

    placement: str
    world: int
    train_ranks: range
    rollout_ranks: range
    roles: dict

    @property
    def disaggregated(self) -> bool:
        return self.placement == "disaggregated"

    def group_of(self, rank: int) -> str:
        """``"train"``, ``"rollout"`` or (colocated) ``"both"`` for a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the {self.world} devices of the run")
        if not self.disaggregated:
            return "both"
        return "train" if rank in self.train_ranks else "rollout"

    def reshard_layouts(self):
        """The resharder's (train, rollout) layouts: the actor's and the rollout's ``ParallelLayout``."""
        return self.roles["actor"], self.roles["rollout"]

    def reshard_plan(self, specs, dtype_bytes: int = 2):
        """The resharder's plan for these groups (``placement`` passed through): hand it to
        ``Resharder(plan, "auto", bucket_mb=..., group=<a group over all world ranks>)`` and call
        ``reshard`` on every rank (train ranks with their shards, rollout ranks with ``{}``)."""
        from ..core.resharder import plan_reshard

        train, rollout = self.reshard_layouts()
        return plan_reshard(train, rollout, specs, dtype_bytes, placement=self.placement)


def placement_groups(recipe: Recipe, world: Optional[int] = None) -> PlacementGroups:
    """The device groups of ``recipe`` on ``world`` devices (default: resources.nodes x devices_per_node).

    Colocated: one group, every role on ``range(world)``. Disaggregated: train roles on
    ``range(world - rollout_devices)``, the rollout on the last ``rollout_devices`` ranks; each
    role's DP from its own group (``world / (tp * pp * sp)``). Raises :class:`~.checks.PlanError`
    (naming the key and the fix) when the split or a layout's TP x PP (x SP) x EP does not fit its
    group; the engine, memory and batch rules are ``build_plan``'s.
    """
    res = recipe.resources
    world = world if world is not None else res.nodes * res.devices_per_node
    roles, T, R, violations = role_layouts(recipe, world)
    disagg = res.placement == "disaggregated"
    fits = rollout_devices_that_fit(world, roles) if disagg else []
    for role in roles.values():
        if role.world < 1:
            continue
        violations += divisibility_violations(role, where(role, world, fits, res.devices_per_node) if disagg else None)
    if violations:
        raise PlanError(f"{recipe.name} on {world} devices ({res.placement}): "
                        + "; ".join(str(v) for v in violations))
    train_ranks = range(T)
    rollout_ranks = range(T, world) if disagg else range(world)
    return PlacementGroups(res.placement, world, train_ranks, rollout_ranks, roles)


__all__ = ["PlacementGroups", "placement_groups"]
