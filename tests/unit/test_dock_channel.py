"""The dock's direct channel (``core/dock/channel.py``, ZeroMQ): a real server on 127.0.0.1 in this
process, real client sockets; the semantics the dock relies on, with encryption on and off. What a
peer without the keys gets, and what the wire shows: ``test_dock_zmq.py``."""
from __future__ import annotations

from typing import Any

import pickle
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rlrecipes.core.dock import ChannelClosed, ChannelTimeout, DockError
from rlrecipes.core.dock.channel import Channel, ChannelPool, ChannelServer, DockKeys, Reply, _dumps, _send
from rlrecipes.core.dock.messages import CurrentStep, NoneType, Request, message


@message
class Echo(Request):
    ANSWER = (object,)
    value: Any = None


@message
class Fail(Request):
    ANSWER = ()
    message: str


@message
class Block(Request):
    ANSWER = (NoneType,)


@message
class Odd(Request):
    ANSWER = (object,)


class Handler:
    """Echoes ``Echo(x)``, raises on ``Fail(msg)``, waits on ``Block()``, answers what does not
    unpickle on ``Odd()``."""

    def __init__(self):
        self.calls = 0
        self.release = threading.Event()
        self.blocked = threading.Event()

    def __call__(self, request):
        self.calls += 1
        if isinstance(request, Fail):
            raise DockError(request.message)
        if isinstance(request, Odd):
            return Unpicklable()
        if isinstance(request, Block):
            self.blocked.set()
            self.release.wait(10)
            return None
        return request.value


@pytest.fixture(params=[True, False], ids=["curve", "plain"])
def served(request):
    h, keys = Handler(), DockKeys(encrypted=request.param)
    srv = ChannelServer(h, keys, "127.0.0.1")
    yield h, keys.for_clients(), srv
    h.release.set()
    srv.close()


def test_requests_pipeline_and_answer_in_order_with_large_arrays_intact(served):
    h, keys, srv = served
    ch = Channel(srv.address, keys)
    big = np.arange(300_000, dtype=np.int64).reshape(1000, 300)        # 2.4 MB: an out-of-band frame
    small = {"ids": np.arange(5, dtype=np.int32), "b": b"\x00" * 10}
    seqs = [ch.send(Echo(x)) for x in (big, small, [1, 2])]
    assert ch.result(seqs[2]) == [1, 2]                                # later answer first: earlier kept
    got = ch.result(seqs[0])
    assert np.array_equal(got, big) and got.flags.writeable            # wraps the received frame
    assert np.array_equal(ch.result(seqs[1])["ids"], small["ids"])
    with pytest.raises(DockError, match="already taken"):
        ch.result(seqs[1])
    assert Reply(ch, ch.send(Echo(7))).result(5) == 7


def test_a_request_copies_its_buffers_so_the_caller_may_reuse_them_at_once(served):
    h, keys, srv = served
    ch = Channel(srv.address, keys)
    x = np.zeros(100_000, dtype=np.int64)                              # out of band
    seq = ch.send(Echo(x))
    x[:] = 7                                                           # as a caller's next step would
    assert not ch.result(seq, 10).any()


class Unpicklable:
    """Pickles fine; unpickling raises (as an exception whose ``__init__`` does not take its args)."""

    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise TypeError("cannot rebuild this object here")


def test_a_message_that_does_not_unpickle_fails_only_its_own_call(served):
    h, keys, srv = served
    ch = Channel(srv.address, keys)
    # a request the server cannot unpickle: answered as an error, the channel stays in order
    first, second = ch.send(Echo(Unpicklable())), ch.send(Echo("A"))
    with pytest.raises(TypeError, match="cannot rebuild"):
        ch.result(first, 10)
    assert ch.result(second, 10) == "A"
    # an answer the caller cannot unpickle: that call raises, the next answers are still its own
    bad, after, last = ch.send(Odd()), ch.send(Echo("B")), ch.send(Echo("C"))
    with pytest.raises(DockError, match=f"answer {bad} does not unpickle here: TypeError: cannot rebuild"):
        ch.result(bad, 10)
    assert ch.result(after, 10) == "B" and ch.result(last, 10) == "C"


def test_a_handler_error_is_raised_at_the_caller_with_the_server_traceback(served):
    h, keys, srv = served
    ch = Channel(srv.address, keys)
    with pytest.raises(DockError, match="rows \\[3\\] unknown") as e:
        ch.result(ch.send(Fail("rows [3] unknown")))
    assert any("raised in the warehouse process" in n and "in __call__" in n
               for n in getattr(e.value, "__notes__", []))
    assert ch.result(ch.send(Echo("still open"))) == "still open"


def test_a_wrong_key_is_refused_before_any_request_is_read(served):
    h, keys, srv = served
    with pytest.raises(ChannelClosed, match="handshake failed"):
        Channel(srv.address, DockKeys(encrypted=keys.encrypted))
    assert h.calls == 0 and srv.received == 0


def test_a_timeout_closes_the_channel(served):
    h, keys, srv = served
    ch = Channel(srv.address, keys)
    with pytest.raises(ChannelTimeout, match="no answer in 0.2s"):
        ch.result(ch.send(Block()), timeout=0.2)
    with pytest.raises(ChannelClosed, match="is closed"):
        ch.send(Echo(1))
    h.release.set()
    fresh = Channel(srv.address, keys)                 # the server still serves new channels
    assert fresh.result(fresh.send(Echo(2)), 10) == 2


_SERVER = """
import pickle, sys, time
from rlrecipes.core.dock.channel import ChannelServer, DockKeys
keys = DockKeys(encrypted=sys.argv[1] == "1")
srv = ChannelServer(lambda request: time.sleep(600), keys, "127.0.0.1")     # every call blocks
print(pickle.dumps((srv.address, keys.for_clients())).hex(), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("encrypted", [True, False], ids=["curve", "plain"])
def test_a_warehouse_process_that_dies_while_a_caller_waits_is_named(encrypted):
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(int(encrypted))], stdout=subprocess.PIPE)
    try:
        address, keys = pickle.loads(bytes.fromhex(proc.stdout.readline().decode()))
        ch = Channel(address, keys, name="warehouse 1")
        seq = ch.send(CurrentStep())
        proc.kill()                                   # the warehouse actor's process ends mid-call
        with pytest.raises(ChannelClosed, match="channel to warehouse 1 at .*: connection lost; the "
                                                "warehouse actor died"):
            ch.result(seq, timeout=60)
        with pytest.raises(ChannelClosed, match="is closed"):
            ch.send(Echo(1))
    finally:
        proc.kill()
        proc.wait()


def test_a_closed_server_closes_its_channels(served):
    h, keys, srv = served
    ch = Channel(srv.address, keys)
    assert ch.result(ch.send(Echo(1)), 10) == 1
    srv.close()
    with pytest.raises(ChannelClosed, match="connection lost"):
        ch.result(ch.send(Echo(2)), timeout=60)
    with pytest.raises(ChannelClosed, match="handshake failed"):
        Channel(srv.address, keys, connect_timeout=2)


def test_a_refused_connection_fails_at_once_with_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]                # nothing listens there
    with pytest.raises(ChannelClosed, match=f"channel to warehouse 3 at 127.0.0.1:{dead}: handshake failed"):
        Channel(("127.0.0.1", dead), DockKeys().for_clients(), name="warehouse 3")


def test_a_pool_gives_each_thread_its_own_channel_and_names_what_to_open_when_none_opens(served):
    h, keys, srv = served
    pool = ChannelPool(srv.address, keys, "the server", "a test client")
    mine = pool.get()
    assert pool.get() is mine
    other = []
    t = threading.Thread(target=lambda: other.append(pool.get()))
    t.start()
    t.join()
    assert other[0] is not None and other[0] is not mine and pool.opened == 2
    assert other[0].result(other[0].send(Echo(3))) == 3 and mine.result(mine.send(Echo(4))) == 4
    refused = ChannelPool(srv.address, DockKeys(keys.encrypted), "the server", "a test client")   # wrong keys
    with pytest.raises(ChannelClosed, match="a test client cannot open a channel to the server at 127.0.0.1:.*"
                                            "handshake failed.*allow TCP between the cluster's nodes"):
        refused.get()
    with pytest.raises(ChannelClosed, match="cannot open a channel"):        # at once: no retry
        refused.get()
    assert refused.failed and refused.opened == 0 and h.calls == 2


def test_the_channel_carries_only_dock_requests(served):
    h, keys, srv = served
    ch = Channel(srv.address, keys)
    with pytest.raises(DockError, match="takes only dock requests .* not tuple"):
        ch.send(("echo", 1))                                            # refused before it is sent
    for raw, why in ((("echo", 1), "a message with an unknown tag \\('echo',\\)"),     # peers that send anyway
                     ({"method": "echo"}, "takes only dock requests .* not dict")):
        _send(ch._sock, _dumps(raw))
        ch._sent += 1
        with pytest.raises(DockError, match=why):
            ch.result(ch._sent, 10)
    assert h.calls == 0 and ch.result(ch.send(Echo("next")), 10) == "next"


def test_one_peers_waiting_request_does_not_hold_up_another_peers(served):
    # A claim blocks its peer's thread on the server; another thread's channel (another peer) is
    # answered meanwhile -- the write a waiting claim needs arrives that way.
    h, keys, srv = served
    a, b = Channel(srv.address, keys), Channel(srv.address, keys)
    seq = a.send(Block())
    assert h.blocked.wait(10)
    assert b.result(b.send(Echo("meanwhile")), 10) == "meanwhile"
    h.release.set()
    assert a.result(seq, 10) is None


def test_keys_never_print_and_clients_get_no_server_secret():
    k = DockKeys()
    assert "curve" in repr(k) and k.server_secret.decode() not in repr(k) and k.client_secret.decode() not in repr(k)
    c = k.for_clients()
    assert c.server_secret is None and k.server_secret is not None
    assert (c.server_public, c.client_public, c.client_secret) == (k.server_public, k.client_public, k.client_secret)
    p = DockKeys(encrypted=False)
    assert p.client_secret.decode() not in repr(p) and len(p.client_secret) == 64


def test_a_channel_left_open_after_its_warehouse_closed_neither_retries_nor_blocks_its_close(served):
    """A channel nobody closed (the garbage collector's ``__del__`` closes it, on any thread, at any
    time) whose warehouse went away: its socket retries the connection every 100 ms and posts an event
    to its monitor each time, and a monitor queue filled to libzmq's limit must not block the close
    (it did: a test process hung in ``disable_monitor`` inside a garbage collection)."""
    import zmq

    from rlrecipes.core.dock.channel import _EVENTS, _close

    h, keys, srv = served
    ch = Channel(srv.address, keys)
    srv.close()
    # a socket that does retry, every millisecond, where nothing listens: its monitor's queue of
    # unread events fills within a second or two
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RECONNECT_IVL, 1)
    events = sock.get_monitor_socket(_EVENTS)
    sock.connect(f"tcp://127.0.0.1:{dead}")
    time.sleep(3)
    assert events.poll(0)
    for closing in (lambda: _close(sock, events), ch.close):
        t = threading.Thread(target=closing, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the close blocked"
