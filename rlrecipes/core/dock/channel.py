"""A direct channel from a dock client to a warehouse: one authenticated TCP connection per
(client thread, warehouse) (:class:`ChannelPool`), with one server thread per connection in the
warehouse's process.

Why not only Ray calls: a Ray actor call from one worker to a threaded actor costs about 1 ms of CPU
on a 2-core host (submission, the actor's task queue, its executor thread, the reply through the
caller's core worker), and a dock step makes several per worker and stage. The same request over a
socket costs about 20 us (``benchmarks/dock_call.py --transport direct``). Ray still places,
starts, names and kills the warehouses; the channel carries only the calls of
``_Warehouse.call`` (the same requests and answers as the Ray path), so either path serves every
call and a client falls back to Ray calls where a connection cannot be opened.

Wire: each message is ``pickle`` protocol 5 with its large buffers (numpy arrays) out of band:
a header (main length, buffer count, buffer lengths), the main pickle, then each buffer. The
receiver reads each buffer straight into the bytearray the array will wrap (no copy after the
socket). A connection is a pipeline: requests are answered in order, so a client may send several
and read the answers later (``Channel.send`` / ``Channel.result``).

Security: a connection must answer an HMAC-SHA256 challenge with the dock's key (made by the dock's
creator, carried only inside the pickled client, as the actor handles are) before any request is
unpickled.
"""
from __future__ import annotations

import hashlib
import hmac
import pickle
import secrets
import socket
import struct
import threading
import time
import traceback
import warnings

from .errors import DockError

_HEAD = struct.Struct("<QI")      # main pickle bytes, out-of-band buffer count
_LEN = struct.Struct("<Q")        # one buffer's bytes
_JOIN_BELOW = 1 << 16             # frames below this go out in one send
_NONCE = 32


class ChannelClosed(DockError):
    """The connection to a warehouse is gone (its actor died, or the dock was shut down)."""


class ChannelTimeout(DockError):
    """No answer within the caller's timeout; the connection is closed (its stream is mid-message)."""


def _frame(obj) -> list:
    bufs: list[pickle.PickleBuffer] = []
    main = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    raws = [b.raw() for b in bufs]
    head = _HEAD.pack(len(main), len(raws)) + b"".join(_LEN.pack(r.nbytes) for r in raws)
    return [head, main, *raws]


def _send(sock: socket.socket, parts: list) -> None:
    if sum(memoryview(p).nbytes for p in parts) < _JOIN_BELOW:
        sock.sendall(b"".join(parts))
    else:
        for p in parts:
            sock.sendall(p)


def _read_into(sock: socket.socket, buf) -> None:
    view = memoryview(buf).cast("B")
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ChannelClosed("the other end closed the connection")
        view = view[n:]


def _recv(sock: socket.socket):
    head = bytearray(_HEAD.size)
    _read_into(sock, head)
    n_main, n_bufs = _HEAD.unpack(head)
    lens = bytearray(_LEN.size * n_bufs)
    if n_bufs:
        _read_into(sock, lens)
    main = bytearray(n_main)
    _read_into(sock, main)
    bufs = []
    for (n,) in _LEN.iter_unpack(lens):
        b = bytearray(n)
        _read_into(sock, b)
        bufs.append(b)
    return pickle.loads(main, buffers=bufs)


def _digest(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, hashlib.sha256).digest()


def new_key() -> bytes:
    return secrets.token_bytes(32)


class ChannelServer:
    """Listens on ``host`` (an ephemeral port) and answers each authenticated connection's requests
    in order with ``handle(request)`` on a thread of its own. An exception raised by ``handle``
    goes back to the caller and is raised there, with the server-side traceback as a note."""

    def __init__(self, handle, key: bytes, host: str):
        self._handle = handle
        self._key = key
        self._sock = socket.create_server((host, 0), backlog=256)
        self.address = (host, self._sock.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="dock-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="dock-channel", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nonce = secrets.token_bytes(_NONCE)
                conn.sendall(nonce)
                answer = bytearray(_NONCE)
                _read_into(conn, answer)
                if not hmac.compare_digest(bytes(answer), _digest(self._key, nonce)):
                    return                                  # wrong key: close before unpickling anything
                conn.sendall(b"\x01")
                while True:
                    request = _recv(conn)
                    try:
                        reply = _frame(("ok", self._handle(request)))
                    except BaseException as e:   # noqa: BLE001 -- every failure goes back to the caller
                        reply = self._error_frame(e)
                    _send(conn, reply)
            except (ChannelClosed, OSError):
                return                                      # the client went away

    @staticmethod
    def _error_frame(e: BaseException) -> list:
        tb = "".join(traceback.format_exception(e))
        try:
            return _frame(("err", e, tb))
        except Exception:   # noqa: BLE001 -- an exception that does not pickle
            return _frame(("err", DockError(f"{type(e).__name__}: {e}"), tb))

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


class Channel:
    """The client end: ``send`` a request (returns its sequence number, without waiting), then
    ``result(seq)`` reads answers in order until that one, keeping earlier unread ones."""

    def __init__(self, address: tuple, key: bytes, connect_timeout: float = 10.0):
        sock = socket.create_connection(tuple(address), timeout=connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = bytearray(_NONCE)
            _read_into(sock, nonce)
            sock.sendall(_digest(key, bytes(nonce)))
            ok = bytearray(1)
            _read_into(sock, ok)
        except (OSError, ChannelClosed) as e:
            sock.close()
            raise ChannelClosed(f"channel to {address[0]}:{address[1]}: handshake failed ({e}); "
                                "a wrong dock key, or the warehouse is gone") from None
        sock.settimeout(None)
        self._sock = sock
        self.address = tuple(address)
        self._sent = 0
        self._read = 0
        self._answers: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def send(self, request) -> int:
        parts = _frame(request)
        with self._lock:
            self._check()
            try:
                _send(self._sock, parts)
            except OSError as e:
                self._close()
                raise ChannelClosed(f"channel to {self.address[0]}:{self.address[1]}: send failed ({e}); "
                                    "the warehouse actor died or the dock was shut down") from None
            self._sent += 1
            return self._sent

    def result(self, seq: int, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while seq not in self._answers:
                self._check()
                if seq <= self._read:
                    raise DockError(f"channel: answer {seq} was already taken")
                try:
                    self._sock.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
                    answer = _recv(self._sock)
                except (socket.timeout, TimeoutError):
                    self._close()
                    raise ChannelTimeout(f"channel to {self.address[0]}:{self.address[1]}: no answer in "
                                         f"{timeout:.1f}s") from None
                except (OSError, ChannelClosed) as e:
                    self._close()
                    raise ChannelClosed(f"channel to {self.address[0]}:{self.address[1]}: connection lost "
                                        f"({e}); the warehouse actor died or the dock was shut down") from None
                self._read += 1
                self._answers[self._read] = answer
            answer = self._answers.pop(seq)
        if answer[0] == "err":
            e = answer[1]
            e.add_note(f"raised in the warehouse process:\n{answer[2]}")
            raise e
        return answer[1]

    def _check(self) -> None:
        if self._sock is None:
            raise ChannelClosed(f"channel to {self.address[0]}:{self.address[1]} is closed")

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def __del__(self):
        try:
            self._close()
        except Exception:   # noqa: BLE001 -- interpreter shutdown
            pass


class ChannelPool:
    """Channels to one listener, one per calling thread, each opened on that thread's first
    :meth:`get`. Per thread because a connection answers in order: a claim waiting on one thread's
    connection must not hold up the write another thread sends to the same warehouse, which may be
    the write that claim waits for. Where a connection cannot be opened (a firewall between nodes,
    say), ``get`` answers None from then on, for every thread, after one RuntimeWarning, and the
    caller makes Ray calls. ``to`` names the far end and ``then`` the calls that fall back, for the
    warning."""

    def __init__(self, address: tuple, key: bytes, to: str, then: str):
        self.address = tuple(address)
        self._key, self._to, self._then = key, to, then
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.opened = 0        # channels opened so far (threads that called get)
        self.failed = False    # a connection could not be opened: Ray calls from now on

    def get(self) -> Channel | None:
        ch = getattr(self._tls, "channel", None)
        if ch is not None or self.failed:
            return ch
        try:
            ch = self._tls.channel = Channel(self.address, self._key)
        except (ChannelClosed, OSError) as e:
            with self._lock:
                first, self.failed = not self.failed, True
            if first:
                warnings.warn(f"TransferDock: no direct channel to {self._to} at {self.address} ({e}); "
                              f"{self._then} go through Ray actor calls", RuntimeWarning, stacklevel=4)
            return None
        with self._lock:
            self.opened += 1
        return ch


class Reply:
    """The pending answer of one channel request (what a Ray ``ObjectRef`` is on the Ray path)."""

    __slots__ = ("channel", "seq")

    def __init__(self, channel: Channel, seq: int):
        self.channel, self.seq = channel, seq

    def result(self, timeout: float | None = None):
        return self.channel.result(self.seq, timeout)
