"""The server's handshake limits: a deadline for the whole handshake counted
from accept, and clients that never authenticate (slow loris) cannot take
the connection slots of consumers that do. Loopback only; every loop is
bounded in time."""
import os
import socket
import threading
import time

import pytest

from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf.errors import ConnectionLostError, ProtocolError, RemoteError
from pyflowbuf.net import NetworkServer, new_secret
from pyflowbuf.net import frames as F
from pipeline_helpers import wait_for

pytestmark = pytest.mark.timeout(60)


def auth_response_prefix():
    """A well-formed AuthResponse but its last byte: the server never sees a
    bad frame, it just never gets the whole of one."""
    return F.encode_auth_response(F.MODE_CREDIT, os.urandom(F.NONCE_SIZE), os.urandom(32))[:-1]


@pytest.fixture
def env(loopback_network):
    net = loopback_network(256)
    return net.secret, net.nbp, net.server, net.manager, net.stops


def export(srv, nbp, pid, n):
    """A producer thread writing ``n`` int64 records to ``pid`` subpartition 0."""
    pool = nbp.create_pool(8, 8)
    q = BufferQueue(nbp)
    writer = RecordWriter(pool, [q], kind="int64", request_timeout=30)
    srv.export(pid, 0, q, kind="int64", on_release=lambda exc: writer.cancel())

    def run():
        try:
            writer.write_batch(list(range(n)))
            writer.end_input()
        except Exception:
            pass   # cancelled: the test reports what the consumer saw
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def consume(mgr, nbp, addr, pid, timeout):
    excl, fl = mgr.create_input_pools(nbp, 1, 2, 4)
    q = BufferQueue(nbp)
    ch = mgr.create_channel(addr, pid, 0, q, excl[0], fl, kind="int64")
    gate = InputGate([q])
    ch.attach_gate(gate)
    reader = RecordReader(gate, kind="int64")
    out = []
    deadline = time.monotonic() + timeout
    while not reader.finished:
        assert time.monotonic() < deadline, f"the consumer got {len(out)} records in {timeout} s"
        out += reader.read_batch(8192, timeout=0.2)
    return out


class SlowLoris:
    """``n`` clients that connect and trickle an AuthResponse one byte per
    ``tick`` without ever finishing it. With ``reconnect`` each one dropped
    by the server connects again at once. Runs in one thread until stopped
    (and never longer than ``limit`` s)."""

    def __init__(self, addr, n, tick=0.2, reconnect=False, limit=30):
        self.addr, self.tick, self.reconnect, self.limit = addr, tick, reconnect, limit
        self.frame = auth_response_prefix()
        self.socks = [self._connect() for _ in range(n)]
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _connect(self):
        s = socket.create_connection(self.addr, timeout=1)
        s.setblocking(False)
        return [s, 0]

    def _alive(self, entry):
        s, sent = entry
        try:
            if s.recv(4096) == b"":   # the challenge, or EOF once the server dropped us
                return False
        except BlockingIOError:
            pass
        except OSError:
            return False
        if sent < len(self.frame):
            try:
                entry[1] += s.send(self.frame[sent:sent + 1])
            except BlockingIOError:
                pass
            except OSError:
                return False
        return True

    def _run(self):
        end = time.monotonic() + self.limit
        while not self._stop.wait(self.tick) and time.monotonic() < end:
            for i, entry in enumerate(self.socks):
                if entry is not None and not self._alive(entry):
                    entry[0].close()
                    self.socks[i] = None
                if self.socks[i] is None and self.reconnect:
                    try:
                        self.socks[i] = self._connect()
                        self.reconnects += 1
                    except OSError:
                        pass   # the listen backlog is full: try again next tick

    def stop(self):
        self._stop.set()
        self._thread.join(5)
        for entry in self.socks:
            if entry is not None:
                entry[0].close()


def test_trickling_client_is_cut_off_at_the_deadline(env):
    secret, nbp, server, manager, stops = env
    srv = server(handshake_timeout=0.6)
    frame = auth_response_prefix()
    s = socket.create_connection(srv.address)
    t0 = time.monotonic()
    s.settimeout(0.2)   # each read waits less than the handshake timeout
    cut = None
    try:
        for i in range(len(frame)):   # would take about 12 s if nobody stopped it
            if time.monotonic() - t0 > 4:
                break
            try:
                s.sendall(frame[i:i + 1])
                if s.recv(4096) == b"":
                    cut = time.monotonic() - t0
                    break
            except socket.timeout:
                continue
            except OSError:
                cut = time.monotonic() - t0
                break
    finally:
        s.close()
    assert cut is not None, "a client trickling one byte per 0.2 s was never cut off"
    assert 0.5 <= cut < 2.5, cut
    wait_for(lambda: any(isinstance(e, ProtocolError) and "did not authenticate within 0.6 s" in str(e)
                         for _, e in srv.errors))


def test_slow_loris_clients_do_not_take_the_connection_slots(env):
    secret, nbp, server, manager, stops = env
    srv = server(max_connections=8, handshake_timeout=30)
    loris = SlowLoris(srv.address, 8)
    stops.append(loris.stop)
    wait_for(lambda: srv.connections == 8)
    export(srv, nbp, "p", 20_000)
    t0 = time.monotonic()
    assert consume(manager(), nbp, srv.address, "p", timeout=10) == list(range(20_000))
    assert time.monotonic() - t0 < 10
    assert srv.stats()["pending_handshakes"] == 8   # they are still there, trickling
    assert sum(e is not None for e in loris.socks) == 8


def test_reconnecting_slow_loris_cannot_starve_a_consumer(env):
    secret, nbp, server, manager, stops = env
    srv = server(max_connections=8, max_pending_handshakes=4, handshake_timeout=30)
    loris = SlowLoris(srv.address, 12, tick=0.05, reconnect=True)
    stops.append(loris.stop)
    wait_for(lambda: loris.reconnects >= 4)   # the server is evicting them
    export(srv, nbp, "p", 20_000)
    seen = []
    sampling = threading.Event()

    def sample():
        while not sampling.wait(0.01):
            st = srv.stats()
            seen.append(st["pending_handshakes"])
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        assert consume(manager(), nbp, srv.address, "p", timeout=15) == list(range(20_000))
        assert time.monotonic() - t0 < 15
    finally:
        sampling.set()
        sampler.join(5)
    assert seen and max(seen) <= 4
    assert any("max_pending_handshakes=4" in str(e) for _, e in srv.errors)


def test_oldest_pending_handshake_is_evicted_for_a_newcomer(env):
    secret, nbp, server, manager, stops = env
    srv = server(max_pending_handshakes=3, handshake_timeout=30)
    silent = []
    try:
        for _ in range(3):
            silent.append(socket.create_connection(srv.address, timeout=5))
            time.sleep(0.05)   # a definite accept order
        wait_for(lambda: srv.stats()["pending_handshakes"] == 3)
        t0 = time.monotonic()
        newcomer = socket.create_connection(srv.address, timeout=5)
        silent.append(newcomer)
        oldest = silent[0]
        oldest.settimeout(5)
        while oldest.recv(4096):   # the challenge, then EOF when it is evicted
            pass
        assert time.monotonic() - t0 < 3
        assert newcomer.recv(4096)[8] == F.CHALLENGE   # the newcomer got its challenge
        for s in silent[1:3]:   # the others are still pending
            s.setblocking(False)
            assert s.recv(4096)   # their challenge, no EOF
        assert srv.stats()["pending_handshakes"] == 3
    finally:
        for s in silent:
            s.close()
    wait_for(lambda: any(isinstance(e, ProtocolError) and "max_pending_handshakes=3" in str(e)
                         for _, e in srv.errors))


def test_authenticated_connections_beyond_max_connections_are_refused_clearly(env):
    secret, nbp, server, manager, stops = env
    srv = server(max_connections=1)
    export(srv, nbp, "a", 1000)
    export(srv, nbp, "b", 1000)
    first = manager()
    assert consume(first, nbp, srv.address, "a", timeout=10) == list(range(1000))
    second = manager()
    with pytest.raises(RemoteError) as ei:
        consume(second, nbp, srv.address, "b", timeout=10)
    assert ei.value.error_kind == "TooManyConnections" and "max_connections=1" in str(ei.value)
    first.close()
    wait_for(lambda: srv.connections == 0)
    assert consume(manager(), nbp, srv.address, "b", timeout=10) == list(range(1000))


@pytest.mark.parametrize("kw", [dict(max_pending_handshakes=0), dict(max_pending_handshakes=-1),
                                dict(max_pending_handshakes=2.5), dict(max_pending_handshakes=True),
                                dict(max_pending_handshakes="8"), dict(max_connections=0),
                                dict(handshake_timeout=0), dict(handshake_timeout=-1.0)])
def test_limits_are_validated(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        NetworkServer(new_secret(), **kw)


def test_no_handshake_deadline_still_bounded_by_eviction(env):
    secret, nbp, server, manager, stops = env
    srv = server(handshake_timeout=None, max_pending_handshakes=2)
    loris = SlowLoris(srv.address, 2)
    stops.append(loris.stop)
    wait_for(lambda: srv.stats()["pending_handshakes"] == 2)
    export(srv, nbp, "p", 1000)
    assert consume(manager(), nbp, srv.address, "p", timeout=10) == list(range(1000))


# ------------------------------------------------ the client's handshake deadline

class TricklingServer:
    """A fake producer for one client: it sends a well-formed Challenge (or,
    with ``phase="auth_ok"``, the Challenge at once and then an AuthOk) one
    byte per ``tick``, so every recv of the client's is answered well within
    any per-recv timeout. Never runs longer than ``limit`` s."""

    def __init__(self, phase, tick=0.2, limit=5.0):
        self.phase, self.tick, self.limit = phase, tick, limit
        self.lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(1)
        self.address = self.lsock.getsockname()
        self.frame = None
        self.sent = 0        # bytes of ``frame`` sent so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        end = time.monotonic() + self.limit
        self.lsock.settimeout(self.limit)
        try:
            conn, _ = self.lsock.accept()
        except OSError:
            return
        with conn:
            challenge = F.encode_challenge(32 * 1024, os.urandom(F.NONCE_SIZE))
            try:
                if self.phase == "auth_ok":
                    conn.sendall(challenge)
                    conn.settimeout(self.limit)
                    if not conn.recv(4096):   # the client's AuthResponse
                        return
                    self.frame = F.encode_auth_ok(os.urandom(32))
                else:
                    self.frame = challenge
                for i in range(len(self.frame)):
                    if self._stop.wait(self.tick) or time.monotonic() > end:
                        return
                    conn.sendall(self.frame[i:i + 1])
                    self.sent = i + 1
            except OSError:
                return   # the client gave up

    def stop(self):
        self._stop.set()
        self._thread.join(5)
        self.lsock.close()


@pytest.mark.parametrize("phase", ["challenge", "auth_ok"])
def test_trickling_server_cannot_hold_the_client_past_connect_timeout(env, phase):
    secret, nbp, server, manager, stops = env
    fake = TricklingServer(phase)
    stops.append(fake.stop)
    mgr = manager(connect_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(ConnectionLostError, match=r"did not complete the handshake within 1\.0 s"):
        mgr.create_channel(fake.address, "p", 0, BufferQueue(nbp))
    took = time.monotonic() - t0
    assert 0.8 <= took < 1.8, took   # a per-recv timeout would wait out the whole frame (8 s or more)
    assert fake.frame is not None and 0 < fake.sent < len(fake.frame)   # cut off mid-trickle
    assert mgr.connections == 0
