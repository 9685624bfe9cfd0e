"""The dock's messages: one request class for every call a client (or another warehouse) makes to a
warehouse -- or, through it, to the metadata controller -- and the answers they get. The channels
(``channel.py``) carry nothing else: a peer sends a :class:`Request`, the warehouse dispatches on its
type (``warehouse.py``) and answers one of the types the request names in ``ANSWER``; the server
checks both (:func:`checked_request`, :func:`checked_answer`), so a request that is no message, or
an answer the schema does not allow, fails at once and by name instead of being unpacked wrongly
somewhere else.

Every message is a slotted dataclass. On a channel it travels as a plain tuple, ``(tag, field
values...)`` (:func:`encode`, :func:`decode`; ``tag``: the class's place in the registry below, so the
pickle names no class), with the fields ``NESTED`` names encoded in turn: messages, lists of them,
and column data (``{column: Packed}``, in the wire format of ``packing.to_wire``). Pickling a class
instance costs about 5 us per object at the two ends together (its class looked up by name, a
``__reduce__`` call); the tuples cost what the untyped protocol's tuples cost. A message pickled
another way (a test, a copy) pickles by its field values.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

from .errors import DockError
from .packing import _from_wire, detached, slice_packed, to_wire

NoneType = type(None)

#: kinds of NESTED fields: a message (or a plain value), a list of messages, {column: Packed} or None
ONE, MANY, COLUMNS = "one", "many", "columns"

_TYPES: list[type] = []          # tag -> message class
_ENCODERS: dict[type, Any] = {}  # message class -> its encoder


class Message:
    """A dock message (what :func:`message` makes). ``NESTED``: field -> ONE, MANY or COLUMNS."""
    __slots__ = ()
    NESTED: dict = {}


def encode(obj):
    """A message as the channel carries it (nested tuples of plain values); anything else as is.
    Dock answers are never bare tuples, so :func:`decode` tells the two apart."""
    enc = _ENCODERS.get(type(obj))
    return enc(obj) if enc is not None else obj


def decode(obj):
    """The inverse of :func:`encode`; a tuple whose tag no message has is a DockError."""
    if type(obj) is not tuple:
        return obj
    try:
        cls = _TYPES[obj[0]]
    except (IndexError, TypeError):
        raise DockError(f"dock: a message with an unknown tag {obj[:1]!r}: not a dock message, or "
                        "from another version of rlrecipes") from None
    return cls._dec(obj)


_ENC = {ONE: encode, MANY: lambda vs: [encode(v) for v in vs],
        COLUMNS: lambda cols: None if cols is None else {c: to_wire(p) for c, p in cols.items()}}
_DEC = {ONE: decode, MANY: lambda vs: [decode(v) for v in vs],
        COLUMNS: lambda cols: None if cols is None else {c: _from_wire(*w) for c, w in cols.items()}}


def message(cls):
    """``cls`` as a slotted dataclass, registered for the channel's encoding (:func:`encode`)."""
    cls = dataclass(slots=True)(cls)
    names = tuple(f.name for f in fields(cls))
    tag = len(_TYPES)
    nested_enc = [(names.index(n), _ENC[k]) for n, k in cls.NESTED.items()]
    nested_dec = [(names.index(n), _DEC[k]) for n, k in cls.NESTED.items()]
    if len(names) > 1:
        get = operator.attrgetter(*names)
    else:
        def get(obj, _n=names[0] if names else None):
            return (getattr(obj, _n),) if _n else ()

    if nested_enc:
        def enc(obj):
            vals = [tag, *get(obj)]
            for i, fn in nested_enc:
                vals[i + 1] = fn(vals[i + 1])
            return tuple(vals)

        def dec(t):
            vals = list(t)
            for i, fn in nested_dec:
                vals[i + 1] = fn(vals[i + 1])
            return cls(*vals[1:])
    else:
        def enc(obj):
            return (tag, *get(obj))

        def dec(t):
            return cls(*t[1:])
    cls._dec = staticmethod(dec)
    cls.__reduce__ = lambda self: (type(self), get(self))
    _TYPES.append(cls)
    _ENCODERS[cls] = enc
    return cls


class Request(Message):
    """A call to a warehouse. ``ANSWER``: the answer types the schema allows."""
    __slots__ = ()
    ANSWER: tuple = ()


class ControllerRequest(Request):
    """A call to the metadata controller; any warehouse takes it (the head's runs it in its own
    process, the others pass it on over their channel to the head)."""
    __slots__ = ()


# -- answers ---------------------------------------------------------------------------------------

@message
class Allocated(Message):
    """Rows allocated by ``add_groups`` (or a reset with its first groups) and their warehouses."""
    step: int
    rows: list
    warehouses: list


@message
class Placed(Message):
    """The warehouse of each asked row, at ``step``."""
    step: int
    warehouses: list


@message
class Stored(Message):
    """A write was stored and committed where it was sent."""


@message
class Committed(Message):
    """The controller marked a write's rows ready."""


@message
class Moved(Message):
    """The rows were another warehouse's (the writer's row map was stale): forwarded there (a write)
    or to be forwarded (a commit). ``warehouses``: each row's warehouse at ``step``."""
    step: int
    warehouses: list


@message
class Refused(Message):
    """The write (or commit) was refused, with nothing kept; ``message`` says why."""
    message: str


@message
class Applied(Message):
    """What a call carrying deferred writes, marks and drops did with them: one answer per write,
    up to and including the first refused one (the rest was not tried), and ``error``: a failed mark
    or drop (after the writes)."""
    NESTED = {"writes": MANY}
    writes: list
    error: Optional[str] = None

    @property
    def failure(self) -> Optional[str]:
        """The first failure's message, or None."""
        bad = first_refused(self.writes)
        return bad.message if bad is not None else self.error


@message
class Claimed(Message):
    """The rows a claim took, at ``step``: ``cached`` (column -> holder rank of each row), the stored
    ``columns`` with their ``kinds`` (dtype name, stacked), the claimed rows by warehouse, and for
    ``count=None`` the round's ``partition`` (every rank's rows) and ``partition_holders``."""
    step: int
    rows: list
    cached: dict
    columns: list
    by_warehouse: dict
    kinds: dict
    partition: Optional[list] = None
    partition_holders: dict = field(default_factory=dict)


@message
class TimedOut(Message):
    """A claim waited past its timeout; ``diagnostics`` for :class:`~.errors.DockTimeout`."""
    diagnostics: dict


@message
class ClaimedHere(Message):
    """The answer of :class:`ClaimRead`: the carried writes' answers, then the claim (None when a
    carried write failed: nothing was claimed) and the answering warehouse's ``share`` of the claimed
    rows' stored columns (None: it holds none, or the dock moved on meanwhile)."""
    NESTED = {"applied": ONE, "claim": ONE, "share": COLUMNS}
    applied: Applied
    claim: Any = None                      # Claimed | TimedOut | None
    warehouse: int = -1
    share: Optional[dict] = None           # column -> Packed of the rows by_warehouse[warehouse]


def first_refused(answers) -> Optional[Refused]:
    """The first :class:`Refused` among write answers, or None."""
    return next((a for a in answers if isinstance(a, Refused)), None)


# -- controller requests ---------------------------------------------------------------------------

@message
class Reset(ControllerRequest):
    """Start ``step``; with ``groups=(n_groups, group_size)`` allocate them too (as AddGroups)."""
    ANSWER = (Allocated, NoneType)
    step: int
    groups: Optional[tuple] = None
    warehouse: Optional[int] = None


@message
class AddGroups(ControllerRequest):
    ANSWER = (Allocated,)
    n_groups: int
    group_size: int
    warehouse: Optional[int] = None        # writer_node placement: the caller's node's warehouse


@message
class Placement(ControllerRequest):
    ANSWER = (Placed,)
    rows: list


@message
class Commit(ControllerRequest):
    """A warehouse stored ``rows`` at ``step``: mark them ready (``meta``: column -> (dtype, stacked,
    per-row lengths))."""
    ANSWER = (Committed, Moved, Refused)
    step: Optional[int]
    warehouse: int
    meta: dict
    rows: list


@message
class Claim(ControllerRequest):
    ANSWER = (Claimed, TimedOut)
    consumer: str
    columns: list
    count: Optional[int]
    dp_rank: int
    dp_size: int
    whole_groups: bool
    timeout: float


@message
class CurrentStep(ControllerRequest):
    ANSWER = (int,)


@message
class MarkReady(ControllerRequest):
    """``rank``'s TensorCache holds ``meta``'s columns of ``rows`` (or, from a write's commit, -1)."""
    ANSWER = (NoneType,)
    meta: dict
    rows: list
    rank: int


@message
class DropRows(ControllerRequest):
    """Answers the dropped rows by warehouse (whose data the caller then drops)."""
    ANSWER = (dict,)
    rows: list


@message
class CachedOn(ControllerRequest):
    ANSWER = (list,)
    column: str
    rows: list


@message
class AllConsumed(ControllerRequest):
    ANSWER = (bool,)
    consumer: str


@message
class ControllerStats(ControllerRequest):
    ANSWER = (dict,)


# -- warehouse requests ----------------------------------------------------------------------------

@message
class Clear(Request):
    ANSWER = (NoneType,)
    step: int


@message
class StartStep(Request):
    """The head warehouse's part of a reset: clear its store, then reset the controller."""
    ANSWER = (Allocated, NoneType)
    step: int
    groups: Optional[tuple] = None
    warehouse: Optional[int] = None


@message
class Write(Request):
    """Store ``columns`` (column -> Packed) of ``rows``, then commit them. ``hops``: how often it
    was forwarded already (a stale row map)."""
    ANSWER = (Stored, Moved, Refused)
    NESTED = {"columns": COLUMNS}
    rows: list
    columns: dict
    meta: dict
    hops: int = 0


def write_part(rows: Sequence[int], packed: dict, meta: dict, pos: Sequence[int], hops: int = 0):
    """The write of positions ``pos`` of a put (``rows``, ``{col: Packed}``, ``{col: (dtype, stacked,
    per-row lengths)}``) as one warehouse takes it: a :class:`Write`."""
    return Write([rows[i] for i in pos], {c: detached(slice_packed(p, pos)) for c, p in packed.items()},
                 {c: (d, st, [ls[i] for i in pos]) for c, (d, st, ls) in meta.items()}, hops)


@message
class Read(Request):
    """Columns of ``rows`` (column -> Packed) of ``step``."""
    ANSWER = (dict,)
    step: int
    columns: list
    rows: list


@message
class Apply(Request):
    """Deferred writes (to this warehouse), cache marks and dropped rows, in this order."""
    ANSWER = (Applied,)
    NESTED = {"writes": MANY, "marks": MANY}
    writes: list = field(default_factory=list)      # Write
    marks: list = field(default_factory=list)       # MarkReady
    drops: list = field(default_factory=list)       # row ids


@message
class ClaimRead(Request):
    """``carried`` (an Apply), then the claim, then this warehouse's share of the claimed rows."""
    ANSWER = (ClaimedHere,)
    NESTED = {"claim": ONE, "carried": ONE}
    claim: Claim
    carried: Apply


@message
class Drop(Request):
    ANSWER = (NoneType,)
    rows: list


@message
class StoreStats(Request):
    """This warehouse's store: row and byte counts, its index, its head channels and Ray node."""
    ANSWER = (dict,)


def checked_answer(request, answer):
    """``answer`` if the schema allows it for ``request``; else a DockError naming both."""
    if not isinstance(answer, request.ANSWER):
        raise DockError(f"dock: {type(request).__name__} answered with {type(answer).__name__}, not one of "
                        f"{', '.join(t.__name__ for t in request.ANSWER)}")
    return answer


def checked_request(request) -> Request:
    if not isinstance(request, Request):
        raise DockError(f"dock: a warehouse takes only dock requests (core/dock/messages.py), not "
                        f"{type(request).__name__}")
    return request


@message
class Failed(Message):
    """The answer to any request whose handler raised: the channel raises ``error`` at the caller,
    with the server's ``traceback`` as a note."""
    error: BaseException
    traceback: str = ""
