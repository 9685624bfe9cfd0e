"""TransferDock: the sample flow between RL stages without a central driver.

Modules: ``client.py`` (the :class:`DockClient` API, :class:`Batch`), ``metadata.py`` (controller
bookkeeping and the balanced hand-out), ``balance.py`` (LPT / Karmarkar-Karp), ``packing.py`` (columns
as numpy arrays, the column store), ``warehouse.py`` (the controller and the warehouse: the one
implementation of writes, claims and reads), ``channel.py`` (the direct client-warehouse
channel over ZeroMQ), ``local.py`` (in-process backend: one warehouse in the
client's process), ``ray_backend.py`` (the client of per-node warehouse actors); :class:`TransferDock`
(here) constructs either.

One row per sample; columns (``prompt_ids``, ``response_ids``, ``scores``, ``ref_log_probs``, ...)
are written by the stage that produces them and read by every stage that needs them.

Two backends, one API (:class:`DockClient`):

* ``TransferDock.local()`` -- in-process and thread-safe: one warehouse (lock) hosting the
  controller (condition variable) in the client's process; unit tests and single-process runs.
* ``TransferDock.ray()`` -- a *controller* that holds metadata only (per-column readiness,
  per-consumer consumption, row -> warehouse map, groups, per-row token lengths, cache holders) and
  one *warehouse* actor per Ray node, pinned there with ``NodeAffinitySchedulingStrategy``, that
  holds the tensors of the rows assigned to it. The controller runs inside the first node's
  warehouse process, so claims and commits there cost no extra hop. Warehouses are threaded actors
  (one lock around the store, one condition around the metadata): a call costs about half of an
  asyncio actor's on a small host (0.7 vs 1.3 ms measured here), and a blocked claim holds a thread.
  Clients (worker actors, each with the same picklable handle) ask the controller *which* rows and
  *where*, then write to / read from the warehouses directly -- by default over a ZeroMQ channel
  per (client thread, warehouse), authenticated and encrypted with CURVE (``channel.py``: tens of
  microseconds of CPU a call where a Ray actor call costs about 1 ms), else through Ray actor calls. The driver never touches sample data. A get is one client round trip: the
  caller's node warehouse claims at the controller and answers with the rows it holds. A put is
  sent without waiting: the warehouse stores the rows and commits them (marks them ready) at the
  controller, so readiness never runs ahead of the data; the writer settles the answer at its next
  blocking call (``flush``).

Data travels as flat numpy arrays (one per column and warehouse call). Over a channel each array
wraps the message frame it arrived in (no copy). Over Ray calls, arrays above Ray's inline
threshold go through the shared-memory object store and are read back zero-copy, so the tensors of
a :class:`Batch` may be read-only views of object-store memory: ``clone()`` before writing in place
(or pass ``copy=True`` to :meth:`DockClient.get`).

Balancing (documented choice): ``get(consumer, cols, count=None, dp_rank=r, dp_size=k)`` means
"everything of this stage". The first rank of the consumer to ask waits until every live row that
the consumer has not taken yet has ``cols`` ready, then partitions those rows (or whole groups)
into ``k`` bins by token count -- greedy LPT with equal row counts per bin (``equal_count=True``,
default; what micro-batched training wants) or Karmarkar-Karp differencing (``equal_count=False``)
-- and every rank receives its own bin. The partition is deterministic (ties broken by row id).
Among partitions no less balanced (``partition_sticky``: the heaviest bin is no heavier than the
plain partition's), the claim keeps rows where they are: rows of cached columns (``mark_cached``)
with their holder (its rank taken as the DP rank), so a balanced step's ``TensorCache.exchange``
moves nothing and an unbalanced one only the excess; stored rows in contiguous blocks of the row
order, so a rank's read is one slice of one writer's chunk.
``count=N`` streams: the rank takes the first ``N`` ready rows nobody of that consumer took yet.
"""
from __future__ import annotations

from typing import Sequence

from .balance import partition_kk, partition_lpt, partition_sticky
from .channel import ChannelClosed, ChannelTimeout, DockKeys
from .client import Batch, DockClient
from .errors import DEFAULT_TIMEOUT_S, DockError, DockTimeout
from .local import LocalDock
from .ray_backend import RayDock
from .warehouse import _Warehouse

__all__ = [
    "Batch", "ChannelClosed", "ChannelTimeout", "DEFAULT_TIMEOUT_S", "DockClient", "DockError", "DockTimeout", "InWorker", "LocalDock", "RayDock",
    "TransferDock", "partition_kk", "partition_lpt", "partition_sticky",
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
            transport: str = "direct", encryption: bool = True, same_host_files: bool = True) -> RayDock:
        """Start the controller and one warehouse per alive Ray node (or per id in ``nodes``).

        ``placement``: ``round_robin`` assigns prompt groups to warehouses in turn;
        ``writer_node`` puts the groups on the warehouse of the node that calls ``add_groups``.
        ``name``: a name prefix for the actors (findable with ``ray.get_actor``).
        ``concurrency``: threads per warehouse actor. A get blocks one thread of the caller's node
        warehouse (and of the head's) until its rows are ready, so it must exceed the number of
        clients that read at once (the workflow passes a bound from the worker count).
        ``transport``: ``direct`` (default) -- clients call the warehouses over ZeroMQ channels
        (``channel.py``: tens of microseconds of CPU a call against about 1 ms for a Ray actor
        call), with Ray calls wherever a channel cannot be opened; ``ray`` -- Ray actor calls only
        (the warehouses do not listen). Ray starts, places and kills the actors either way.
        ``encryption``: the channels use CURVE (encrypted; only this dock's clients are admitted);
        False -- in clear, admitted by a token (a trusted network only). The keys are made here,
        per dock, and reach the warehouses and clients only through Ray. ``same_host_files``: a
        client on a warehouse's machine reaches it through socket files in a folder only this user
        opens, admitted by a token and not encrypted (its traffic never leaves the machine); False
        sends it over TCP as from another node (tests of the wire).
        Needs ``ray.init`` first. Call ``shutdown()`` on the returned client to stop the actors.
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            raise DockError("TransferDock.ray(): Ray is not initialised; call ray.init() (or "
                            "rlrecipes.cluster) first, or use TransferDock.local()")
        if placement not in ("round_robin", "writer_node"):
            raise DockError(f"TransferDock.ray(placement={placement!r}): expected round_robin or writer_node")
        if transport not in ("direct", "ray"):
            raise DockError(f"TransferDock.ray(transport={transport!r}): expected direct or ray")
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
        ray.get([w.set_peers.remote(warehouses) for w in warehouses])
        got = ray.get([w.node_id.remote() for w in warehouses])
        if got != nodes:  # NodeAffinity with soft=False guarantees this; check anyway
            raise DockError(f"warehouses landed on {got}, expected {nodes}")
        channels = keys = None
        if transport == "direct":
            keys = DockKeys(encrypted=encryption, same_host_files=same_host_files)
            channels = ray.get([w.open_channel.remote(keys) for w in warehouses])
            keys = keys.for_clients()
            ray.get([w.connect_head.remote(channels[0], keys) for w in warehouses[1:]])
        dock = RayDock(warehouses, nodes, placement, channels, keys)
        dock._owner = True
        dock.reset(0)
        return dock
