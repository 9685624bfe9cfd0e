"""One role's parallel layout: :class:`ParallelLayout`, validated by one set of rules, built once per role.

A layout is the sizes a recipe gives a role (``<role>.layout``: TP, PP, EP, SP and the pipeline's
layer split) over the devices the role spans (``world``); DP is inferred, ``world / (tp * pp * sp)``.
The same object is what the schema's layout sections become (:func:`rlrecipes.recipe.roles.role_layout`),
what ``plan`` checks and prints, what the resharder plans from (its rank coordinates are here) and
what each engine builds from (:meth:`ParallelLayout.build_mesh` for the native engine's meshes,
the sizes and :meth:`ParallelLayout.check` for megatron's and vLLM's own groups).

Rank order (``docs/conventions.md``, Megatron's): TP fastest, then SP, then DP, then PP::

    rank = pp_rank * (dp * sp * tp) + (dp_rank * sp + sp_rank) * tp + tp_rank

SP ranks hold the same weights as their DP group, so to the resharder a layout has ``dp * sp``
weight *replicas* per pipeline stage (:attr:`ParallelLayout.replicas`), and
``ep_rank = (replica * tp + tp_rank) % ep``: EP groups are contiguous blocks of a stage's ranks.

The rules (:meth:`ParallelLayout.problems`) are stated here once; ``plan`` reports each as a
violation naming the recipe key (``key``, e.g. ``actor.layout``) and a fix, engines and the
resharder raise the same sentences as :class:`LayoutError`:

* TP x PP x SP divides the role's devices (DP is a whole number);
* the EP rule, one statement with the engine's placement of expert groups (:data:`EP_GROUPS`):
  ``ep * etp`` divides the ``dp * sp * tp`` ranks of a pipeline stage (``etp`` = 1: experts are
  whole on their EP rank; ``etp`` = TP: megatron splits every expert over TP too, so the EP groups
  span data-parallel ranks), or, for engines that keep EP inside the TP group, ``ep`` divides TP;
* the layer split has one entry per pipeline stage.

Only :mod:`rlrecipes.device` names devices: the mesh's device type comes from it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

#: how an engine lays its expert-parallel groups over the ranks of a pipeline stage:
#: ``"stage"`` anywhere in the stage (the resharder, vLLM), ``"across_dp"`` with every expert split
#: over ``etp`` tensor ranks as well (megatron: EP x ETP divides the stage), ``"within_tp"`` inside
#: each TP group (the native engines' ``(dp, etp, ep)`` mesh)
EP_GROUPS = ("stage", "across_dp", "within_tp")

# the rule names plan reports (and its nearest-node search keys on)
DIVIDES_RULE = "TP*PP divides the world"
DIVIDES_SP_RULE = "TP*PP*SP divides the world"
EP_RULE = "EP divides DP*TP"
EP_ACROSS_DP_RULE = "engine places EP groups across DP"
EP_WITHIN_TP_RULE = "engine keeps EP inside the TP group"
SPLIT_LEN_RULE = "layer split has one entry per PP stage"


class LayoutError(ValueError):
    """A layout that cannot run: the message names the recipe key and the fix."""


@dataclass(frozen=True)
class LayoutProblem:
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.detail}"


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) if n >= 1 else "none"


@dataclass(frozen=True)
class ParallelLayout:
    """One role's parallel sizes over the ``world`` devices it spans; DP is inferred from them."""

    role: str = ""
    """``actor``, ``ref``, ``critic`` or ``rollout`` (empty: a layout outside a recipe)."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (rollout layouts: 1)."""
    ep: int = 1
    """Expert-parallel size: EP groups are carved out of the ``dp * sp * tp`` ranks of a stage."""
    world: int = 1
    """Devices the role spans (its device group; the whole run when colocated)."""
    pp_layers: Optional[tuple[int, ...]] = None
    """Decoder layers per pipeline stage; None: an even split (the parameter specs' own stages)."""
    sp: int = 1
    """Sequence-parallel size (Ulysses in the native engine, context parallelism in megatron):
    ranks that split each sequence and see the same samples, carved out of DP."""
    key: str = ""
    """The recipe key the sizes come from (``actor.layout``; a ref on the actor's layout says
    ``actor.layout``), named by every problem; empty: ``<role>.layout`` or ``layout``."""

    def __post_init__(self):
        for k in ("tp", "pp", "ep", "sp"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"{self._key(k)}={v!r}: must be a positive integer")
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 0:
            raise LayoutError(f"layout world={self.world!r}: must be a whole number of devices")
        if self.pp_layers is not None:
            object.__setattr__(self, "pp_layers", tuple(int(n) for n in self.pp_layers))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def of(cls, tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1, pp_layers=None, *, sp: int = 1,
           role: str = "", key: str = "") -> "ParallelLayout":
        """The layout with ``dp`` data-parallel ranks (``world = tp * pp * sp * dp``)."""
        return cls(role=role, tp=tp, pp=pp, ep=ep, world=tp * pp * sp * dp, pp_layers=pp_layers, sp=sp, key=key)

    def on(self, world: int) -> "ParallelLayout":
        """The same sizes over ``world`` devices (DP inferred again)."""
        return self if world == self.world else replace(self, world=int(world))

    # ------------------------------------------------------------------ sizes
    @property
    def model_parallel(self) -> int:
        """Devices of one data-parallel replica: TP x PP x SP."""
        return self.tp * self.pp * self.sp

    @property
    def dp(self) -> Optional[int]:
        """Data-parallel size, ``world / (tp * pp * sp)``; None when that is not a whole number."""
        k = self.model_parallel
        return self.world // k if self.world >= 1 and self.world % k == 0 else None

    @property
    def replicas(self) -> int:
        """Weight replicas per pipeline stage, ``dp * sp`` (SP ranks hold their DP group's weights)."""
        return self._dp() * self.sp

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: ``dp * sp * tp``."""
        return self.replicas * self.tp

    def _dp(self) -> int:
        dp = self.dp
        if dp is None:
            raise LayoutError(self.problems()[0].detail)
        return dp

    def _key(self, size: str = "") -> str:
        base = self.key or (f"{self.role}.layout" if self.role else "layout")
        return f"{base}.{size}" if size else base

    # ------------------------------------------------------------------ the rules
    def problems(self, ep_groups: str = "stage", etp: int = 1, where: Optional[tuple[str, str]] = None,
                 engine: str = "") -> list[LayoutProblem]:
        """Every structural rule this layout breaks, each naming the recipe key and a fix.

        ``ep_groups`` / ``etp``: how the engine lays out its EP groups (:data:`EP_GROUPS`). ``where``
        = (rule, the device set and its fix) replaces the TP x PP rule's wording under disaggregated
        placement (``plan``); the default names the role's device count. ``engine`` names the engine
        whose placement a rule is."""
        if ep_groups not in EP_GROUPS:
            raise ValueError(f"ep_groups={ep_groups!r}: one of {', '.join(EP_GROUPS)}")
        name = self.role or "layout"
        out: list[LayoutProblem] = []
        by = f"engine {engine}" if engine else "the engine"
        inside = []  # EP inside TP: whatever the device count
        if ep_groups == "within_tp" and self.ep > 1 and self.tp % self.ep:
            inside.append(LayoutProblem(EP_WITHIN_TP_RULE, f"{name}: EP{self.ep} does not divide TP{self.tp} ({by}); "
                                                           f"use ep <= tp with tp % ep == 0 ({self._key('ep')})"))
        k = self.model_parallel
        sizes = f"TP{self.tp} x PP{self.pp}" + (f" x SP{self.sp}" if self.sp > 1 else "")
        if self.world % k or self.world < 1:
            rule = DIVIDES_RULE if self.sp == 1 else DIVIDES_SP_RULE
            fix = ""
            tp_pp = self.tp * self.pp
            if self.sp > 1 and not where and self.world % tp_pp == 0 and self.world > tp_pp:
                fix = f"; use an sp that divides {self.world // tp_pp}"
            elif not where and self.world >= 1:
                fix = f"; set {self._key()} sizes whose product divides {self.world}, or change the node count"
            return [LayoutProblem(where[0] if where else rule,
                                  f"{name}: {sizes} = {k} does not divide "
                                  f"{where[1] if where else f'{self.world} devices'}{fix}")] + out + inside
        dp = self.world // k
        stage = dp * self.sp * self.tp
        sp = f" x SP{self.sp}" if self.sp > 1 else ""
        # the EP rule: ep (x etp, when every expert is split over TP as well) divides a stage's ranks
        across = ep_groups == "across_dp" and self.ep > 1
        room = stage // etp if across and stage % etp == 0 else stage
        if stage % self.ep:
            out.append(LayoutProblem(EP_RULE, f"{name}: EP{self.ep} does not divide DP{dp}{sp} x TP{self.tp} = "
                                              f"{stage}; set {self._key('ep')} to one of {_divisors(room)}"))
        elif across and stage % (self.ep * etp):
            ranks = f"DP{dp} x SP{self.sp} = {dp * self.sp}" if self.sp > 1 else f"DP{dp}"
            out.append(LayoutProblem(EP_ACROSS_DP_RULE,
                                     f"{name}: EP{self.ep} does not divide {ranks} ({by} splits experts over TP as "
                                     f"well, so the EP groups span data-parallel ranks); use an {self._key('ep')} "
                                     f"that divides {room}"))
        return out + inside

    def check(self, ep_groups: str = "stage", etp: int = 1, engine: str = "") -> "ParallelLayout":
        """``self`` when :meth:`problems` and :meth:`split_problems` find none; else :class:`LayoutError`
        with every problem."""
        found = self.problems(ep_groups, etp, engine=engine) + self.split_problems()
        if found:
            raise LayoutError("; ".join(map(str, found)))
        return self

    def split_problems(self) -> list[LayoutProblem]:
        """The layer split has one entry per pipeline stage."""
        if self.pp_layers is None or len(self.pp_layers) == self.pp:
            return []
        return [LayoutProblem(SPLIT_LEN_RULE, f"{self.role or 'layout'}: pp_layers has {len(self.pp_layers)} entries "
                                              f"for PP{self.pp}; give {self._key('pp_layers')} one entry per stage, "
                                              f"or null for an even split")]

    def model_problems(self, dims) -> list[LayoutProblem]:
        """The rules between these sizes and a model (``dims``: a ``ModelDims``): heads and KV heads
        divide by TP, experts by EP, EP only on an MoE model, the layer split (one entry per stage,
        none empty) sums to the layers, or PP is at most the layers. Each names the key and a fix."""
        name, out = self.role or "layout", []
        if dims.num_heads % self.tp:
            out.append(LayoutProblem("attention heads divide by TP", f"{name}: {dims.num_heads} heads, TP{self.tp}; "
                                                                     f"set {self._key('tp')} to a divisor of "
                                                                     f"{dims.num_heads}"))
        if not dims.is_mla and dims.num_kv_heads % self.tp:
            out.append(LayoutProblem("KV heads divide by TP", f"{name}: {dims.num_kv_heads} KV heads, TP{self.tp}; set "
                                                              f"{self._key('tp')} to a divisor of {dims.num_kv_heads}"))
        if dims.is_moe and dims.num_experts % self.ep:
            out.append(LayoutProblem("experts divide by EP", f"{name}: {dims.num_experts} experts, EP{self.ep}; set "
                                                             f"{self._key('ep')} to a divisor of {dims.num_experts}"))
        if not dims.is_moe and self.ep != 1:
            out.append(LayoutProblem("EP needs an MoE model", f"{name}: EP{self.ep} on dense family {dims.family}; "
                                                              f"set {self._key('ep')}=1"))
        if self.pp_layers is not None:
            out += self.split_problems()
            if sum(self.pp_layers) != dims.num_layers:
                out.append(LayoutProblem("layer split sums to the layer count",
                                         f"{name}: pp_layers {list(self.pp_layers)} sums to {sum(self.pp_layers)}, "
                                         f"model has {dims.num_layers} layers; make {self._key('pp_layers')} sum to "
                                         f"{dims.num_layers}, or null for an even split"))
            if self.pp_layers and min(self.pp_layers) < 1:
                out.append(LayoutProblem("every pipeline stage has a layer",
                                         f"{name}: pp_layers {list(self.pp_layers)} leaves a stage without layers; "
                                         f"give every entry of {self._key('pp_layers')} at least 1"))
        elif self.pp > dims.num_layers:
            out.append(LayoutProblem("PP at most the layer count", f"{name}: PP{self.pp} > {dims.num_layers} layers; "
                                                                   f"lower {self._key('pp')} to {dims.num_layers} "
                                                                   f"or less"))
        return out

    # ------------------------------------------------------------------ ranks
    def coords(self, rank: int) -> dict[str, int]:
        """``{'pp', 'dp', 'tp', 'ep'}`` of a rank; ``dp`` counts weight replicas (``dp * sp`` of them)."""
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} outside layout world {self.world}")
        S = self.stage_size
        loc = rank % S
        return {"pp": rank // S, "dp": loc // self.tp, "tp": loc % self.tp, "ep": loc % self.ep}

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The global rank of (pipeline stage, replica, TP rank)."""
        return pp * self.stage_size + dp * self.tp + tp

    def stage_of(self, spec) -> int:
        """Pipeline stage of a parameter (a ``ParamSpec``) in this layout."""
        if self.pp == 1:
            return 0
        if self.pp_layers is not None:
            from .param_spec import stage_of_spec

            return stage_of_spec(spec, self.pp_layers)
        return spec.pp_stage

    def chunks(self, spec) -> int:
        """Chunks this layout cuts ``spec`` into along its split dim (experts over EP, the rest over TP)."""
        if spec.kind == "expert":
            return self.ep
        return self.tp if spec.tp_dim is not None else 1

    def chunk_index(self, spec, rank: int) -> int:
        c = self.coords(rank)
        if spec.kind == "expert":
            return c["ep"]
        return c["tp"] if spec.tp_dim is not None else 0

    # ------------------------------------------------------------------ text
    def describe(self) -> str:
        """``"TP4 PP8 EP8 DP8 layers 7,7,..."`` (``SP`` when > 1; ``DP?`` when it is not whole)."""
        dp = "?" if self.dp is None else self.dp
        s = f"TP{self.tp} PP{self.pp} EP{self.ep}" + (f" SP{self.sp}" if self.sp > 1 else "") + f" DP{dp}"
        if self.pp_layers and self.pp > 1:
            s += f" layers {','.join(map(str, self.pp_layers))}"
        return s

    def to_json(self) -> dict:
        return {"role": self.role, "tp": self.tp, "pp": self.pp, "ep": self.ep, "dp": self.dp, "world": self.world,
                "pp_layers": list(self.pp_layers) if self.pp_layers is not None else None, "sp": self.sp}


__all__ = ["DIVIDES_RULE", "DIVIDES_SP_RULE", "EP_ACROSS_DP_RULE", "EP_GROUPS", "EP_RULE", "EP_WITHIN_TP_RULE",
           "LayoutError", "LayoutProblem", "ParallelLayout", "SPLIT_LEN_RULE"]
