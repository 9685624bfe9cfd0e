"""TransferDock: the sample flow between RL stages without a central driver. One row per sample;
columns (``prompt_ids``, ``response_ids``, ``scores``, ...) are written by the stage that produces
them and read by every stage that needs them. Semantics, balancing, transports and cost:
docs/transfer_dock.md.

* ``TransferDock.local()`` -- in-process and thread-safe: one warehouse (``warehouse.py``) hosting
  the controller in the client's process (``local.py``); ``in_worker()`` builds it in the one
  process that uses it.
* ``TransferDock.ray()`` -- one warehouse actor per Ray node holding the tensors of its rows, the
  metadata-only controller (``metadata.py``, ``balance.py``) inside the first node's; clients
  (``ray_backend.py``) ask the controller which rows and where, and read and write the warehouses
  directly. Every dock call is a typed request (``messages.py``) over a ZeroMQ channel
  (``channel.py``), the dock's one transport; Ray places, names and kills the actors. The driver
  never touches sample data.

Tensors of a :class:`Batch` may be read-only views of a received buffer or of object-store memory:
``clone()`` before writing in place (or ``get(..., copy=True)``).
"""
from __future__ import annotations

from typing import Sequence

from .balance import partition_kk, partition_lpt, partition_sticky
from .channel import ChannelClosed, ChannelTimeout, DockKeys
from .client import Batch, DockClient
from .errors import DEFAULT_TIMEOUT_S, DockError, DockTimeout
from .local import LocalDock
from .ray_backend import RayDock, _check_choice
from .warehouse import _Warehouse

__all__ = [
    "Batch", "ChannelClosed", "ChannelTimeout", "DEFAULT_TIMEOUT_S", "DockClient", "DockError", "DockTimeout",
    "InWorker", "LocalDock", "RayDock", "TransferDock", "partition_kk", "partition_lpt", "partition_sticky",
]


class InWorker:
    """A picklable placeholder for a dock that the one process using it builds itself
    (:meth:`TransferDock.in_worker`): the process calls :meth:`build`."""

    def __init__(self, equal_count: bool = True):
        self.equal_count = equal_count

    def build(self) -> LocalDock:
        return LocalDock(equal_count=self.equal_count)

    def shutdown(self) -> None:
        pass


class TransferDock:
    """Constructors of the two backends."""

    @staticmethod
    def local(*, equal_count: bool = True) -> LocalDock:
        """In-process dock (threads). ``equal_count``: balanced bins hold equal row counts (LPT);
        False: Karmarkar-Karp on tokens only."""
        return LocalDock(equal_count=equal_count)

    @staticmethod
    def in_worker(*, equal_count: bool = True) -> InWorker:
        """For a run whose every client is one process (a single worker): the controller and the
        warehouse live in that process, so a get or put crosses no process boundary. The same
        bookkeeping and store as the Ray backend; pass the placeholder to the process, which calls
        ``build()``."""
        return InWorker(equal_count)

    @staticmethod
    def ray(*, name: str | None = None, nodes: Sequence[str] | None = None,
            placement: str = "round_robin", equal_count: bool = True, concurrency: int = 256,
            encryption: bool = True, same_host_files: bool = True) -> RayDock:
        """Start the controller and one warehouse per alive Ray node (or per id in ``nodes``);
        needs ``ray.init`` first; ``shutdown()`` on the returned client stops the actors.

        ``placement``: ``round_robin`` (prompt groups to warehouses in turn) or ``writer_node`` (on
        the warehouse of the node that calls ``add_groups``). ``name``: a prefix of the actors'
        names. ``concurrency``: the warehouse actors' threads for Ray's own calls (starting and
        connecting them). Every dock call goes over ZeroMQ channels (``channel.py``), each served
        by a thread of its own, each warehouse listening on an ephemeral port of its node (and on
        socket files for clients on its machine). ``encryption``: CURVE between machines (only this
        dock's clients are admitted); False: in clear, admitted by a token (a trusted network
        only). ``same_host_files``: a client on a warehouse's machine uses its socket files (a
        token, not encrypted: nothing leaves the machine); False: TCP, as from another node. The
        keys are made here, per dock, and travel only through Ray. See docs/transfer_dock.md.
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            raise DockError("TransferDock.ray(): Ray is not initialised; call ray.init() (or "
                            "rlrecipes.cluster) first, or use TransferDock.local()")
        _check_choice("placement", placement, ("round_robin", "writer_node"))
        if nodes is None:
            nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        nodes = list(nodes)
        if not nodes:
            raise DockError("TransferDock.ray(): no alive Ray nodes")
        opts = {"num_cpus": 0, "max_restarts": 0}
        warehouses: list = []
        for i, node in enumerate(nodes):
            w_opts = dict(opts, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False))
            if name:
                w_opts["name"] = f"{name}:warehouse{i}"
            # warehouse 0 (the first node's) hosts the metadata controller in its process
            head = warehouses[0] if warehouses else None
            warehouses.append(ray.remote(_Warehouse).options(**w_opts, max_concurrency=concurrency).remote(
                i, head, len(nodes), equal_count))
        got = ray.get([w.node_id.remote() for w in warehouses])
        if got != nodes:  # NodeAffinity with soft=False guarantees this; check anyway
            raise DockError(f"warehouses landed on {got}, expected {nodes}")
        keys = DockKeys(encrypted=encryption, same_host_files=same_host_files)
        channels = ray.get([w.open_channel.remote(keys) for w in warehouses])
        keys = keys.for_clients()
        if len(warehouses) > 1:   # each reaches the others (the head's controller, forwarded writes)
            ray.get([w.connect.remote(channels, keys) for w in warehouses])
        dock = RayDock(warehouses, nodes, placement, channels, keys)
        dock._owner = True
        dock.reset(0)
        return dock
