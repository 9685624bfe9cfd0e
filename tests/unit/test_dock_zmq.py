"""What the dock's ZeroMQ channel shows to whoever can reach its port, or read its traffic.

* A peer without the run's keys is refused during ZeroMQ's handshake: nothing it sends is delivered
  to the warehouse's socket, so nothing is unpickled (a pickle that records its own unpickling is
  the payload; the same payload from a peer with the keys is unpickled, so the check can fail).
* The bytes on the wire during a dock write and read (relays between client and warehouse record
  every byte both ways, so this runs without root; ``tests/dist/test_dock_ray.py`` captures a Ray
  dock's traffic on the loopback interface where the process may) hold no sample bytes with
  encryption on, and hold them with it off (so the check can fail).
"""
from __future__ import annotations

import os
import pickle
import socket
import threading

import numpy as np
import pytest
import torch
import zmq
import zmq.utils.monitor

from rlrecipes.core.dock import ChannelClosed
from rlrecipes.core.dock.channel import Channel, ChannelServer, DockKeys
from rlrecipes.core.dock.client import _put_meta
from rlrecipes.core.dock import messages as m
from rlrecipes.core.dock.messages import CachedOn
from rlrecipes.core.dock.messages import write_part
from rlrecipes.core.dock.warehouse import _Warehouse

UNPICKLED: list[str] = []


def _record(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Tripwire:
    """Unpickling it calls ``_record``: any unpickle in this process shows in ``UNPICKLED``."""

    def __init__(self, tag: str):
        self.tag = tag

    def __reduce__(self):
        return (_record, (self.tag,))


@pytest.fixture(params=[True, False], ids=["curve", "plain"])
def server(request):
    UNPICKLED.clear()
    calls: list = []
    keys = DockKeys(encrypted=request.param)
    srv = ChannelServer(calls.append, keys, "127.0.0.1")
    yield srv, keys, calls
    srv.close()


def _raw_dealer(address, setup) -> tuple[zmq.Socket, int]:
    """A DEALER that sends the tripwire at once (queued until a handshake succeeds) and the first
    handshake outcome its monitor reports."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    setup(sock)
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    sock.connect(f"tcp://{address[0]}:{address[1]}")
    sock.send(pickle.dumps(Tripwire("raw")))
    assert mon.poll(30_000), "no handshake outcome"
    event = zmq.utils.monitor.recv_monitor_message(mon)["event"]
    sock.disable_monitor()
    mon.close()
    return sock, event


def test_a_peer_without_the_keys_is_refused_before_anything_is_unpickled(server):
    srv, keys, calls = server
    other = DockKeys(encrypted=keys.encrypted)
    tcp = srv.address[:2]  # as a client on another machine reaches it (no socket files)
    # 1. the dock's own client with another run's keys: refused at the handshake, from another
    #    machine (CURVE, or PLAIN with the run's token) and from this one (PLAIN over the socket files)
    for address in (tcp, srv.address):
        with pytest.raises(ChannelClosed, match="handshake failed"):
            Channel(address, other.for_clients())
    local = zmq.Context.instance().socket(zmq.DEALER)  # a raw peer at the local door with a guessed token
    local.linger, local.plain_username, local.plain_password = 0, b"local", b"guess"
    local.connect(srv.address[2])
    local.send(pickle.dumps(Tripwire("local")))
    assert not local.poll(1000)
    local.close()
    attempts = {"null mechanism": lambda s: None}
    if keys.encrypted:
        def wrong_client_key(s):          # knows the warehouse's public key, not the run's client keypair
            s.curve_serverkey = keys.server_public
            s.curve_publickey, s.curve_secretkey = other.client_public, other.client_secret

        def wrong_server_key(s):          # the run's client keypair, talking to an impostor's key
            s.curve_serverkey = other.server_public
            s.curve_publickey, s.curve_secretkey = keys.client_public, keys.client_secret

        def plain(s):
            s.plain_username, s.plain_password = b"dock", b"guess"
        attempts |= {"wrong client key": wrong_client_key, "wrong server key": wrong_server_key,
                     "plain": plain}
    else:
        def wrong_token(s):
            s.plain_username, s.plain_password = b"dock", other.client_secret

        def curve(s):
            s.curve_serverkey = other.server_public or zmq.curve_keypair()[0]
            s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
        attempts |= {"wrong token": wrong_token, "curve": curve}
    # 2. raw zmq peers that send a pickle right away: the handshake fails, the message is dropped
    for name, setup in attempts.items():
        sock, event = _raw_dealer(tcp, setup)
        assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, name
        sock.close()
    # 3. a raw TCP peer writing a pickle: the server closes the connection at the greeting
    with socket.create_connection(tcp, timeout=30) as s:
        s.sendall(pickle.dumps(Tripwire("tcp")) * 8)
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
    assert srv.received == 0 and calls == [] and UNPICKLED == []
    # the same payload from a peer with the keys is delivered and unpickled: the check above can fail
    for n, address in enumerate((tcp, srv.address), 1):
        ch = Channel(address, keys.for_clients())
        assert ch.local is (address == srv.address)
        ch.result(ch.send(CachedOn(Tripwire("mine"), [])), 30)                 # a dock request carrying it
        assert srv.received == 2 * n and [c.column for c in calls] == ["mine"] * n and UNPICKLED == ["mine"] * n
        ch.close()


class Relay:
    """A TCP relay on 127.0.0.1 that forwards to ``target`` and records every byte, both ways."""

    def __init__(self, target: tuple):
        self.target = target
        self.sent = bytearray()        # client -> server
        self.answered = bytearray()    # server -> client
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.address = self._lsock.getsockname()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self._lsock.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target)
            except OSError:          # the server is gone (the client's reconnect after the test)
                a.close()
                continue
            threading.Thread(target=self._pump, args=(a, b, self.sent), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, self.answered), daemon=True).start()

    def _pump(self, src, dst, log):
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    log += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._lsock.close()


BIG_MARKER = b"SAMPLE-BYTES-IN-CLEAR/"     # in a column above 64 KiB: its own, out-of-band frame
SMALL_MARKER = b"small-row-in-clear!"      # in a small column: inside the pickle


def _marker_tensor(marker: bytes, rows: int, min_bytes: int) -> torch.Tensor:
    reps = -(-min_bytes // (rows * len(marker)))
    row = np.frombuffer(marker * reps, dtype=np.uint8)
    return torch.from_numpy(np.tile(row, (rows, 1)))          # [rows, reps * len(marker)] uint8


@pytest.mark.parametrize("encrypted", [True, False], ids=["encrypted", "in-clear"])
def test_sample_bytes_on_the_wire_only_when_encryption_is_off(encrypted, monkeypatch):
    # A warehouse as the Ray actor runs it (hosting the controller), served over the channel; the
    # client writes two columns and claims them back, as RayDock does. Every port the server listens
    # on (the one it is reached at, and each channel's own) is reached through a relay.
    relays: list[Relay] = []
    listen = ChannelServer._listen

    def relayed(self, kind, local):
        sock, endpoint = listen(self, kind, local)
        if local:  # the same-machine door: not on the wire at all
            return sock, endpoint
        relays.append(Relay(("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))))
        return sock, f"tcp://127.0.0.1:{relays[-1].address[1]}"
    monkeypatch.setattr(ChannelServer, "_listen", relayed)
    wh = _Warehouse(0)
    wh.clear(m.Clear(0))
    rows = wh.handle(m.Reset(0, (1, 4))).rows
    keys = DockKeys(encrypted=encrypted)
    srv = ChannelServer(wh.handle, keys, "127.0.0.1")
    try:
        ch = Channel(srv.address[:2], keys.for_clients())  # from another machine: TCP
        big = _marker_tensor(BIG_MARKER, len(rows), 128 << 10)
        small = _marker_tensor(SMALL_MARKER, len(rows), 64)
        meta, packed = _put_meta({"big": big, "small": small}, rows, own=False)
        assert ch.result(ch.send(write_part(rows, packed, meta, range(len(rows)))), 30) == m.Stored()
        claim = m.Claim("c", ["big", "small"], None, 0, 1, False, 30.0)
        res = ch.result(ch.send(m.ClaimRead(claim, m.Apply())), 30)
        assert isinstance(res.claim, m.Claimed) and sorted(res.claim.rows) == rows
        got = res.share
        assert np.array_equal(got["big"].flat, big.numpy().reshape(-1))
        assert np.array_equal(got["small"].flat, small.numpy().reshape(-1))
        ch.close()
    finally:
        srv.close()
        for r in relays:
            r.close()
    assert len(relays) == 2                                       # the server's address and the channel's
    for direction in (b"".join(bytes(r.sent) for r in relays), b"".join(bytes(r.answered) for r in relays)):
        assert len(direction) > (128 << 10)                       # the data did pass the relays
        for marker in (BIG_MARKER, SMALL_MARKER):
            assert (marker in direction) is (not encrypted), (marker, encrypted)


def test_without_its_zap_handler_a_warehouse_refuses_even_the_right_keys(server):
    # The server's sockets enforce the ZAP domain: with the handler gone (the server closing, or its
    # thread lost) a handshake fails instead of admitting whoever knows the warehouse's public key.
    srv, keys, calls = server
    srv._auth.stop()
    with pytest.raises(ChannelClosed, match="handshake failed"):
        Channel(srv.address, keys.for_clients(), connect_timeout=2)     # refused, or never admitted
    assert srv.received == 0 and calls == []


def test_a_client_on_the_same_machine_uses_the_servers_socket_files(server, tmp_path):
    # Same machine (the client reads the marker in the server's socket folder): PLAIN with the dock's token over socket files in a folder only
    # this user opens; nothing of it is on a network interface, so it is not encrypted (a peer that
    # could read it could read the processes' memory).
    srv, keys, calls = server
    host, port, door, marker = srv.address
    folder = door[len("ipc://"):].rsplit("/", 1)[0]
    assert os.stat(folder).st_mode & 0o777 == 0o700
    ch = Channel(srv.address, keys.for_clients())
    assert ch.local and ch.result(ch.send(m.AllConsumed("x")), 30) is None and calls == [m.AllConsumed("x")]
    ch.close()
    elsewhere = Channel((host, port, door, "another-marker"), keys.for_clients())  # TCP, with the keys
    assert not elsewhere.local and elsewhere.result(elsewhere.send(m.AllConsumed("y")), 30) is None
    assert calls == [m.AllConsumed("x"), m.AllConsumed("y")]
    elsewhere.close()


_CLIENT = """
import pickle, sys
from rlrecipes.core.dock.channel import Channel
from rlrecipes.core.dock.messages import AllConsumed
address, keys = pickle.load(sys.stdin.buffer)
ch = Channel(address, keys, connect_timeout=20)
print("local" if ch.local else "tcp", ch.result(ch.send(AllConsumed("from-the-other-view")), 30))
ch.close()
"""


def test_a_client_that_cannot_see_the_socket_folder_uses_tcp(server):
    """Two containers on one host share its boot id but not ``/tmp``: the client runs in a mount
    namespace of its own whose ``/tmp`` is empty (bubblewrap), so the server's socket folder is not
    there. It must choose TCP and be answered (with a boot-id test it chose the socket files, and its
    connect failed)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    bwrap = shutil.which("bwrap")
    if bwrap is None or subprocess.run([bwrap, "--dev-bind", "/", "/", "true"], capture_output=True).returncode:
        pytest.skip("bubblewrap (bwrap) is not usable here: apt-get install bubblewrap")
    srv, keys, calls = server
    folder = srv.address[2][len("ipc://"):].rsplit("/", 1)[0]
    hidden = tempfile.gettempdir()
    assert folder.startswith(hidden + "/")
    import rlrecipes
    here = os.path.dirname(os.path.dirname(rlrecipes.__file__))
    p = subprocess.run([bwrap, "--dev-bind", "/", "/", "--tmpfs", hidden, sys.executable, "-c", _CLIENT],
                       input=pickle.dumps((srv.address, keys.for_clients())), capture_output=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": here})
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    assert p.stdout.decode().split() == ["tcp", "None"]
    assert [c.consumer for c in calls] == ["from-the-other-view"]
