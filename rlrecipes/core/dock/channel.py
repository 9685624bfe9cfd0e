"""Direct channels from dock clients to warehouses over ZeroMQ (``pyzmq``): a DEALER socket per
(client thread, warehouse) (:class:`ChannelPool`), connected to a socket of its own in the
warehouse's process that a thread of its own serves (:class:`ChannelServer`). The dock's one
transport: it carries only the typed requests of ``messages.py`` (checked as they are sent and as
they arrive) to ``_Warehouse.handle`` and its typed answers back; a handler's exception comes back
as ``messages.Failed`` and is raised at the caller. Keys, cost, failure semantics:
docs/transfer_dock.md ("Channels").

Security (:class:`DockKeys`, made per dock): between machines CURVE -- encrypted, the client checks
the warehouse's key and the warehouse's ZAP handler admits only the run's client key; ZeroMQ
finishes that handshake before it delivers a message, so nothing from an unknown peer reaches
``pickle``. ``encrypted=False``: PLAIN, the run's random token, in clear. On one machine: the
warehouse's socket files (a 0700 folder), PLAIN with a second token; that traffic never leaves it.

Wire: a multipart message per request or answer: the message as ``messages.encode`` gives it (nested
tuples of plain values), pickled with protocol 5, then each out-of-band
buffer (numpy array) as a frame the receiver's array wraps. Requests copy their buffers as they are
sent (the caller may reuse its tensors at once); answers send the store's arrays, never written in
place, without a copy.
"""
from __future__ import annotations

import copy
import os
import pickle
import secrets
import shutil
import tempfile
import threading
import time
import traceback
import types

import zmq
import zmq.utils.monitor
from zmq.auth.thread import ThreadAuthenticator

from .errors import DockError
from .messages import Failed, Request, checked_request, decode, encode


_SLICE_MS = 1000      # a caller waiting for an answer checks for a lost connection this often
_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED
           | zmq.EVENT_DISCONNECTED)


class ChannelClosed(DockError):
    """The connection to a warehouse is gone (its actor died, or the dock was shut down)."""


class ChannelTimeout(DockError):
    """No answer within the caller's timeout; the channel is closed."""


class DockKeys:
    """One dock's credentials: CURVE keypairs (z85) of the warehouses and of the clients, or, with
    ``encrypted=False``, a PLAIN token; and the token of same-machine channels. ``for_clients()``
    drops the warehouses' secret key."""

    def __init__(self, encrypted: bool = True, same_host_files: bool = True):
        self.encrypted, self.same_host_files = encrypted, same_host_files
        self.server_public, self.server_secret = zmq.curve_keypair() if encrypted else (None, None)
        self.client_public, self.client_secret = (zmq.curve_keypair() if encrypted else
                                                  (None, secrets.token_hex(32).encode()))
        self.local_token = secrets.token_hex(32).encode()

    def __repr__(self) -> str:   # never the keys
        return f"DockKeys({'curve' if self.encrypted else 'plain'})"

    def for_clients(self) -> "DockKeys":
        k = copy.copy(self)
        k.server_secret = None
        return k

    def client(self, sock: zmq.Socket, local: bool = False) -> None:
        if local or not self.encrypted:
            sock.plain_username, sock.plain_password = (b"local", self.local_token) if local else \
                (b"dock", self.client_secret)
        else:
            sock.curve_serverkey, sock.curve_publickey = self.server_public, self.client_public
            sock.curve_secretkey = self.client_secret

    def admit(self, auth: ThreadAuthenticator) -> None:
        """The warehouse's ZAP handler (domain "dock"): the dock's client key (CURVE) or tokens
        (PLAIN)."""
        users = {"local": self.local_token.decode()}
        if self.encrypted:
            auth.configure_curve_callback("dock", types.SimpleNamespace(
                callback=lambda _, key: secrets.compare_digest(key, self.client_public)))
        else:
            users["dock"] = self.client_secret.decode()
        auth.configure_plain("dock", users)

    def serve(self, sock: zmq.Socket, local: bool = False) -> None:
        """Make ``sock`` a server of this dock's mechanism, admitted by the ZAP handler; without the
        handler every handshake fails (``zap_enforce_domain``)."""
        sock.zap_domain, sock.zap_enforce_domain = b"dock", True
        if self.encrypted and not local:
            sock.curve_server, sock.curve_secretkey = True, self.server_secret
        else:
            sock.plain_server = True


def _dumps(obj) -> list:
    bufs: list[pickle.PickleBuffer] = []
    return [pickle.dumps(obj, protocol=5, buffer_callback=bufs.append), *(b.raw() for b in bufs)]


def _recv(sock: zmq.Socket) -> tuple[bytes, list]:
    """One message's frames: the first as bytes (a copy is cheaper than a frame object for the
    small pickle), the out-of-band buffers as frames the arrays wrap. An empty first frame: goodbye."""
    head, bufs = sock.recv(), []
    while sock.get(zmq.RCVMORE):
        bufs.append(sock.recv(copy=False).buffer)
    return head, bufs


def _send(sock: zmq.Socket, frames: list, flags: int = 0, copy: bool = True) -> None:
    for f in frames[:-1]:
        sock.send(f, flags | zmq.SNDMORE, copy=copy)
    sock.send(frames[-1], flags, copy=copy)


def _socket(ctx: zmq.Context, kind: int, host: str = "") -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.sndhwm = sock.rcvhwm = 0        # no high-water mark: a ROUTER drops, the others block, at one
    sock.linger, sock.ipv6 = 0, ":" in host
    return sock


def _endpoint(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


#: the file in a server's socket folder that tells a client it can reach that folder
_MARKER = "machine"


def sees_socket_files(files: str, marker: str) -> bool:
    """Whether this process reaches the socket folder of a server's ``files`` endpoint: the folder's
    marker file holds ``marker``. Two processes of one machine can still live in different filesystem
    views (containers on one host share a boot id, not ``/tmp``), so the test is the folder itself."""
    if not marker or not files.startswith("ipc://"):
        return False
    try:
        with open(os.path.join(os.path.dirname(files[len("ipc://"):]), _MARKER)) as f:
            return secrets.compare_digest(f.read(), marker)
    except OSError:
        return False


class ChannelServer:
    """Listens on ``host`` (an ephemeral port) and on a socket file: each client channel first asks
    there for a socket of its own, which a thread of its own serves -- ``handle(request)`` for each
    request, in order, answered on the same socket -- until the client says goodbye. A blocked
    claim so holds only its own channel. An exception raised by ``handle`` is raised at the caller,
    with the server's traceback as a note. ``received``: messages delivered past the handshake."""

    def __init__(self, handle, keys: DockKeys, host: str):
        self._handle, self._keys, self._host = handle, keys, host
        self._ctx = zmq.Context()
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        keys.admit(self._auth)
        self._dir = tempfile.mkdtemp(prefix="rlrecipes-dock-")   # socket files only this user opens
        self._opened, self._closed, self.received = 0, False, 0
        (tcp_door, tcp), (files_door, files) = (self._listen(zmq.ROUTER, local) for local in (False, True))
        self._doors = [tcp_door, files_door]
        marker = secrets.token_hex(16)
        with open(os.open(os.path.join(self._dir, _MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(marker)
        self.address = (host, int(tcp.rsplit(":", 1)[1]), files, marker)
        threading.Thread(target=self._open_channels, name="dock-channel-door", daemon=True).start()

    def _listen(self, kind: int, local: bool) -> tuple[zmq.Socket, str]:
        sock = _socket(self._ctx, kind, self._host)
        self._keys.serve(sock, local)
        if local:
            self._opened += 1
            sock.bind(f"ipc://{self._dir}/{self._opened}")
        else:
            sock.bind_to_random_port(_endpoint(self._host))
        return sock, sock.last_endpoint.decode()

    def _open_channels(self) -> None:
        doors = zmq.Poller()
        for door in self._doors:
            doors.register(door, zmq.POLLIN)
        try:
            while True:
                for door, _ in doors.poll():
                    peer = door.recv_multipart()[0]
                    self.received += 1
                    sock, endpoint = self._listen(zmq.DEALER, local=door is self._doors[1])
                    threading.Thread(target=self._serve, args=(sock,), name="dock-channel", daemon=True).start()
                    door.send_multipart([peer, endpoint.encode()])
        except zmq.ContextTerminated:
            for door in self._doors:
                door.close()

    def _serve(self, sock: zmq.Socket) -> None:
        try:
            while (frames := _recv(sock))[0]:                # empty: the client closed its channel
                self.received += 1
                try:
                    request = checked_request(decode(pickle.loads(frames[0], buffers=frames[1])))
                    answer = _dumps(encode(self._handle(request)))
                except BaseException as e:   # noqa: BLE001 -- every failure goes back to the caller
                    tb = "".join(traceback.format_exception(e))
                    try:
                        answer = _dumps(encode(Failed(e, tb)))
                    except Exception:   # noqa: BLE001 -- an exception that does not pickle
                        answer = _dumps(encode(Failed(DockError(f"{type(e).__name__}: {e}"), tb)))
                try:
                    _send(sock, answer, zmq.NOBLOCK, copy=False)
                except zmq.Again:                     # the client is gone (it timed out)
                    pass
        except zmq.ContextTerminated:
            pass
        sock.close()

    def close(self) -> None:
        """Stop listening and close every channel (their callers see ``ChannelClosed``); a thread
        busy in ``handle`` closes its channel when that returns."""
        if not self._closed:
            self._closed = True
            self._auth.stop()                         # from now on every handshake fails (zap_enforce_domain)
            threading.Thread(target=self._ctx.term, name="dock-channel-close", daemon=True).start()
            shutil.rmtree(self._dir, ignore_errors=True)


class Channel:
    """The client end: ``send`` a request (returns its sequence number, without waiting), then
    ``result(seq)`` reads answers in order until that one, keeping earlier unread ones. Opening it
    asks the server for a socket and waits for both handshakes, so a refused or unauthenticated
    connection fails here. A client that reaches the server's socket folder (:func:`sees_socket_files`)
    uses its socket files; any other, TCP."""

    def __init__(self, address: tuple, keys: DockKeys, connect_timeout: float = 10.0, name: str = "a warehouse"):
        self.address, self.name, self._sock = tuple(address), name, None
        self.local = keys.same_host_files and len(address) > 3 and sees_socket_files(address[2], address[3])
        door, events = self._connect(address[2] if self.local else f"{_endpoint(address[0])}:{address[1]}",
                                     keys, connect_timeout)
        door.send(b"")
        endpoint = door.recv().decode() if door.poll(int(connect_timeout * 1000)) else None
        _close(door, events)
        if endpoint is None:
            raise ChannelClosed(f"channel to {self._where}: no answer in {connect_timeout:.0f}s")
        self._sock, self._events = self._connect(endpoint, keys, connect_timeout)
        self._slice_ms = self._sock.rcvtimeo = _SLICE_MS
        self._sent = self._read = 0
        self._answers: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def _connect(self, endpoint: str, keys: DockKeys, timeout: float) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER connected to ``endpoint`` once the handshake succeeded, and the monitor that
        reports its loss."""
        sock = _socket(zmq.Context.instance(), zmq.DEALER, self.address[0])
        sock.heartbeat_ivl, sock.heartbeat_timeout = 5000, 30000   # ms: a vanished node is noticed
        keys.client(sock, self.local)
        events = sock.get_monitor_socket(_EVENTS)
        sock.connect(endpoint)
        event = events.poll(int(timeout * 1000)) and _event(events)
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return sock, events
        _close(sock, events)
        why = ("the warehouse refused this client's key" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else
               "refused or unreachable" if event in (zmq.EVENT_CLOSED, zmq.EVENT_CONNECT_RETRIED) else
               f"no handshake in {timeout:.0f}s" if not event else "not this dock's keys")
        raise ChannelClosed(f"channel to {self._where}: handshake failed ({why}); a wrong dock key, or the "
                            "warehouse is gone")

    @property
    def _where(self) -> str:
        return f"{self.name} at {self.address[0]}:{self.address[1]}"

    def send(self, request: Request) -> int:
        frames = _dumps(encode(checked_request(request)))
        with self._lock:
            if self._sock is None:
                raise ChannelClosed(f"channel to {self._where} is closed")
            _send(self._sock, frames)                  # copied: the caller may reuse its buffers
            self._sent += 1
            return self._sent

    def result(self, seq: int, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while seq not in self._answers:
                if self._sock is None:
                    raise ChannelClosed(f"channel to {self._where} is closed")
                if seq <= self._read:
                    raise DockError(f"channel: answer {seq} was already taken")
                # wait in slices: between them, the monitor is asked whether the connection is lost
                ms = _SLICE_MS if deadline is None else \
                    max(min(int((deadline - time.monotonic()) * 1000) + 1, _SLICE_MS), 1)
                if ms != self._slice_ms:
                    self._slice_ms = self._sock.rcvtimeo = ms
                try:
                    head, bufs = _recv(self._sock)
                except zmq.Again:                      # answers already here are read before a loss
                    if self._lost():
                        self._close(bye=False)
                        raise ChannelClosed(f"channel to {self._where}: connection lost; the warehouse "
                                            "actor died or the dock was shut down") from None
                    if deadline is not None and time.monotonic() >= deadline:
                        self._close()
                        raise ChannelTimeout(f"channel to {self._where}: no answer in {timeout:.1f}s") from None
                    continue
                self._read += 1
                try:
                    self._answers[self._read] = decode(pickle.loads(head, buffers=bufs))
                except Exception as e:   # noqa: BLE001 -- this answer only: the next ones stay in order
                    self._answers[self._read] = Failed(DockError(
                        f"channel to {self._where}: answer {self._read} does not unpickle here: "
                        f"{type(e).__name__}: {e}"))
            answer = self._answers.pop(seq)
        if isinstance(answer, Failed):
            if answer.traceback:
                answer.error.add_note(f"raised in the warehouse process:\n{answer.traceback}")
            raise answer.error
        return answer

    def _lost(self) -> bool:
        lost = False
        while self._events.poll(0):
            lost |= _event(self._events) == zmq.EVENT_DISCONNECTED
        return lost

    def _close(self, bye: bool = True) -> None:
        if self._sock is not None:
            if bye:                                    # the server's thread for this channel ends
                self._sock.send(b"", zmq.NOBLOCK)
            _close(self._sock, self._events, linger=1000 if bye else 0)
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def __del__(self):
        try:
            self._close()
        except Exception:   # noqa: BLE001 -- interpreter shutdown
            pass


def _event(events: zmq.Socket) -> int:
    return zmq.utils.monitor.recv_monitor_message(events)["event"]


def _close(sock: zmq.Socket, events: zmq.Socket, linger: int = 0) -> None:
    # the monitor's unread events first: stopping it posts one more, which waits for room in the
    # monitor's queue (libzmq's high-water marks), so a full queue would block this close (and a
    # ``__del__`` the garbage collector runs) for good
    while True:  # to the end: an inproc pipe holds both ends' high-water marks
        try:
            events.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
    sock.disable_monitor()    # then: an event sent to a closed monitor would block libzmq's I/O thread
    events.close()
    sock.close(linger=linger)


class ChannelPool:
    """Channels to one listener, one per calling thread, each opened on that thread's first
    :meth:`get`. Per thread because a peer's requests are answered in order: a claim waiting on one
    thread's channel must not hold up the write another thread sends to the same warehouse, which
    may be the write that claim waits for. Where a channel cannot be opened (a firewall between
    nodes, a wrong key), ``get`` raises :class:`ChannelClosed` naming the far end (``to``), the
    caller (``by``) and what to open, and so does every later ``get`` of any thread (no retry
    that would wait for a connect timeout at each call)."""

    def __init__(self, address: tuple, keys: DockKeys, to: str, by: str):
        self.address = tuple(address)
        self._keys, self._to, self._by = keys, to, by
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.opened = 0        # channels opened so far (threads that called get)
        self.failed: ChannelClosed | None = None    # why a channel could not be opened

    def get(self) -> Channel:
        ch = getattr(self._tls, "channel", None)
        if ch is not None:
            return ch
        if self.failed is not None:
            raise self.failed
        try:
            ch = self._tls.channel = Channel(self.address, self._keys, name=self._to)
        except (ChannelClosed, zmq.ZMQError) as e:
            with self._lock:
                self.failed = ChannelClosed(
                    f"TransferDock: {self._by} cannot open a channel to {self._to} at {self.address[0]}:"
                    f"{self.address[1]} ({e}). The dock's clients and warehouses talk over ZeroMQ "
                    "connections to an ephemeral TCP port of each warehouse's node (or, on one machine, "
                    "its socket files): allow TCP between the cluster's nodes, as Ray's own workers need")
            raise self.failed from None
        with self._lock:
            self.opened += 1
        return ch


class Reply:
    """The pending answer of one channel request."""

    __slots__ = ("channel", "seq")

    def __init__(self, channel: Channel, seq: int):
        self.channel, self.seq = channel, seq

    def result(self, timeout: float | None = None):
        return self.channel.result(self.seq, timeout)
