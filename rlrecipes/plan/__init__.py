"""``rlrecipes plan``: the recipe that runs on N nodes, checked before any process starts.

* :mod:`.build` — :func:`build_plan` (layouts, memory, reshard volume, every violation at once),
  :func:`resolve` (the recipe that runs), :func:`refuse_missing_engines`, :func:`format_violations`;
* :mod:`.checks` — the layout, engine, model and placement rules, :class:`Violation`, :class:`PlanError`;
* :mod:`.memory` — per-device memory models (the one a train engine declares in
  ``Capabilities.memory_model``);
* :mod:`.reshard` — reshard traffic per device;
* :mod:`.placement` — :func:`placement_groups`, the device groups the workflow places roles on.

The modules import one way (checks <- memory <- reshard <- build; checks <- placement). Engines
are read only through ``engines.base`` and ``engines.registry``.
"""
from .build import Plan, build_plan, format_violations, nearest_valid_nodes, refuse_missing_engines, resolve
from .checks import NODE_INDEPENDENT_RULES, PlanError, Violation
from .memory import Memory
from .placement import PlacementGroups, placement_groups

__all__ = ["Memory", "NODE_INDEPENDENT_RULES", "PlacementGroups", "Plan", "PlanError", "Violation",
           "build_plan", "format_violations", "nearest_valid_nodes", "placement_groups", "refuse_missing_engines",
           "resolve"]
