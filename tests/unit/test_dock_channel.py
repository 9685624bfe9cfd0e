"""The dock's direct channel (``core/dock/channel.py``): a real server on 127.0.0.1 in this process,
real client connections."""
from __future__ import annotations

import socket
import threading
import warnings

import numpy as np
import pytest

from rlrecipes.core.dock import ChannelClosed, ChannelTimeout, DockError
from rlrecipes.core.dock.channel import Channel, ChannelPool, ChannelServer, Reply, new_key


class Handler:
    """Echoes ``("echo", x)``, raises on ``("fail", msg)``, waits on ``("block", event)``."""

    def __init__(self):
        self.calls = 0
        self.release = threading.Event()

    def __call__(self, request):
        self.calls += 1
        kind, arg = request
        if kind == "fail":
            raise DockError(arg)
        if kind == "block":
            self.release.wait(10)
        return arg


@pytest.fixture
def served():
    h, key = Handler(), new_key()
    srv = ChannelServer(h, key, "127.0.0.1")
    yield h, key, srv
    h.release.set()
    srv.close()


def test_requests_pipeline_and_answer_in_order_with_large_arrays_intact(served):
    h, key, srv = served
    ch = Channel(srv.address, key)
    big = np.arange(300_000, dtype=np.int64).reshape(1000, 300)        # 2.4 MB: out-of-band buffer
    small = {"ids": np.arange(5, dtype=np.int32), "b": b"\x00" * 10}
    seqs = [ch.send(("echo", x)) for x in (big, small, [1, 2])]
    assert ch.result(seqs[2]) == [1, 2]                                # later answer first: earlier kept
    got = ch.result(seqs[0])
    assert np.array_equal(got, big) and got.flags.writeable            # received into private memory
    assert np.array_equal(ch.result(seqs[1])["ids"], small["ids"])
    with pytest.raises(DockError, match="already taken"):
        ch.result(seqs[1])
    assert Reply(ch, ch.send(("echo", 7))).result(5) == 7


def test_a_handler_error_is_raised_at_the_caller_with_the_server_traceback(served):
    h, key, srv = served
    ch = Channel(srv.address, key)
    with pytest.raises(DockError, match="rows \\[3\\] unknown") as e:
        ch.result(ch.send(("fail", "rows [3] unknown")))
    assert any("raised in the warehouse process" in n and "in __call__" in n
               for n in getattr(e.value, "__notes__", []))
    assert ch.result(ch.send(("echo", "still open"))) == "still open"


def test_a_wrong_key_is_refused_before_any_request_is_read(served):
    h, key, srv = served
    with pytest.raises(ChannelClosed, match="handshake failed"):
        Channel(srv.address, new_key())
    assert h.calls == 0


def test_a_timeout_closes_the_channel_and_a_lost_server_is_named(served):
    h, key, srv = served
    ch = Channel(srv.address, key)
    with pytest.raises(ChannelTimeout, match="no answer in 0.2s"):
        ch.result(ch.send(("block", None)), timeout=0.2)
    with pytest.raises(ChannelClosed, match="is closed"):
        ch.send(("echo", 1))
    # the other end goes away while a caller waits
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def accept_then_drop():
        conn, _ = lsock.accept()
        conn.sendall(b"\x00" * 32)          # a nonce
        conn.recv(32)
        conn.sendall(b"\x01")
        conn.recv(1024)
        conn.close()

    t = threading.Thread(target=accept_then_drop)
    t.start()
    ch2 = Channel(("127.0.0.1", port), key)
    with pytest.raises(ChannelClosed, match="connection lost"):
        ch2.result(ch2.send(("echo", 1)), timeout=10)
    t.join()
    lsock.close()


def test_a_pool_gives_each_thread_its_own_channel_and_falls_back_with_one_warning(served):
    h, key, srv = served
    pool = ChannelPool(srv.address, key, "the server", "its calls")
    mine = pool.get()
    assert pool.get() is mine
    other = []
    t = threading.Thread(target=lambda: other.append(pool.get()))
    t.start()
    t.join()
    assert other[0] is not None and other[0] is not mine and pool.opened == 2
    assert other[0].result(other[0].send(("echo", 3))) == 3 and mine.result(mine.send(("echo", 4))) == 4
    refused = ChannelPool(srv.address, new_key(), "the server", "its calls")     # a wrong key
    with pytest.warns(RuntimeWarning, match="no direct channel to the server .*its calls go through Ray"):
        assert refused.get() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                     # no second warning, no retry
        assert refused.get() is None
    assert refused.failed and refused.opened == 0 and h.calls == 2
