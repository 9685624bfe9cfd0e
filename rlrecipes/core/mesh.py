"""The native engines' device mesh of a :class:`~rlrecipes.core.parallel.ParallelLayout`
(:meth:`ParallelLayout.build_mesh`): one ``DeviceMesh`` over the initialised world, and the groups an
engine asks it for (``MeshInfo``). Rank order is the layout's (``docs/conventions.md``): the mesh is
``("dp", "etp", "ep")`` of shape ``(dp, tp // ep, ep)`` with ``"tp"`` the flattening of
``("etp", "ep")``, so ``tp_rank = etp_rank * ep + ep_rank`` and ``ep_rank = tp_rank % ep``: EP groups
are contiguous blocks of ranks inside one TP group. The device type comes from :mod:`rlrecipes.device`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlrecipes import device as devmod

from .parallel import LayoutError, ParallelLayout


@dataclass(frozen=True)
class MeshInfo:
    """One engine's device mesh over the whole world (see module docstring for the rank order)."""

    root: DeviceMesh  # ("dp", "etp", "ep"); with sequence parallelism ("dp", "sp", "etp", "ep")
    tp: int
    ep: int
    dp: int
    sp: int = 1
    """Ulysses sequence-parallel ranks per DP group (``layout.sp``): they hold the same samples."""
    flat: dict = field(default_factory=dict, compare=False, repr=False)
    """The flattened dimensions (``"tp"``, and with SP ``"mp"``, ``"dpsp"``) as ``_flatten`` returned
    them. Kept here, not sliced from ``root`` again: a slice is a mesh-layout computation (and, for a
    flattened name, a deprecation warning) on every call, and the engines ask on every pass."""

    def _dim(self, name: str) -> DeviceMesh:
        return self.flat[name] if name in self.flat else self.root[name]

    # every mesh and rank below is fixed for the mesh's life and asked on every pass: computed once
    @functools.cached_property
    def dp_mesh(self) -> DeviceMesh:
        return self.root["dp"]

    @functools.cached_property
    def grad_mesh(self) -> DeviceMesh:
        """The ranks whose gradients are averaged (FSDP2's shard mesh, replicated DP's all-reduce):
        DP, and the SP ranks inside each DP group."""
        return self._dim("dpsp") if self.sp > 1 else self.dp_mesh

    @property
    def grad_size(self) -> int:
        return self.dp * self.sp

    @functools.cached_property
    def sp_group(self):
        """The process group of this rank's SP peers (None at SP1)."""
        return self.root["sp"].get_group() if self.sp > 1 else None

    @functools.cached_property
    def sp_rank(self) -> int:
        return self.root["sp"].get_local_rank() if self.sp > 1 else 0

    @functools.cached_property
    def mp_mesh(self) -> DeviceMesh:
        """The ranks that hold the same samples: TP, and SP around it."""
        return self._dim("mp") if self.sp > 1 else self.tp_mesh

    @property
    def mp_size(self) -> int:
        return self.tp * self.sp

    @functools.cached_property
    def tp_mesh(self) -> DeviceMesh:
        return self._dim("tp")

    @functools.cached_property
    def ep_mesh(self) -> DeviceMesh:
        return self.root["ep"]

    @functools.cached_property
    def tp_rank(self) -> int:
        return self.tp_mesh.get_local_rank()

    @functools.cached_property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @functools.cached_property
    def ep_rank(self) -> int:
        return self.ep_mesh.get_local_rank()

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.sp


def world_layout(layout, *, role: str = "", sp: int = 1, pp: int = 1, pp_layers=None) -> ParallelLayout:
    """An engine's layout over its initialised process group (one process when there is none): a
    :class:`ParallelLayout` (``EngineSpec.layout``) with its world set to the group's, or the
    ``(tp, ep)`` pair an engine's constructor also takes (with ``sp``, ``pp``, ``pp_layers``)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(layout, ParallelLayout):
        return layout.on(world)
    tp, ep = (tuple(int(x) for x in layout) + (1,))[:2]
    return ParallelLayout(role=role, tp=tp, ep=ep, sp=int(sp or 1), pp=int(pp), pp_layers=pp_layers, world=world)


def build_mesh(layout: ParallelLayout, device_type: str) -> MeshInfo:
    """A (dp, tp) mesh with EP inside TP over the whole initialised world; with ``sp > 1`` a
    (dp, sp, tp) mesh, SP ranks between DP and TP (Megatron's order for context parallelism).

    Raises :class:`LayoutError` when the layout does not fit the world or ``ep`` does not divide ``tp``.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "torch.distributed.init_process_group(device.comm_backend(), ...) first "
                           "(a single process can use world_size=1)")
    world = dist.get_world_size()
    if layout.world != world:
        raise LayoutError(f"{layout._key()}: a layout over {layout.world} devices on a world of {world} ranks")
    if layout.pp != 1:
        raise LayoutError(f"{layout._key('pp')}={layout.pp}: this mesh has no pipeline stages")
    layout.check(ep_groups="within_tp", engine="native")
    tp, ep, sp, dp = layout.tp, layout.ep, layout.sp, layout.dp
    mesh_type = devmod.mesh_device_type(device_type)
    if sp == 1:
        root = init_device_mesh(mesh_type, (dp, tp // ep, ep), mesh_dim_names=("dp", "etp", "ep"))
        return MeshInfo(root=root, tp=tp, ep=ep, dp=dp, flat={"tp": root["etp", "ep"]._flatten("tp")})
    root = init_device_mesh(mesh_type, (dp, sp, tp // ep, ep), mesh_dim_names=("dp", "sp", "etp", "ep"))
    flat = {"tp": root["etp", "ep"]._flatten("tp"), "mp": root["sp", "etp", "ep"]._flatten("mp"),
            "dpsp": root["dp", "sp"]._flatten("dpsp")}
    return MeshInfo(root=root, tp=tp, ep=ep, dp=dp, sp=sp, flat=flat)


__all__ = ["MeshInfo", "build_mesh", "world_layout"]
