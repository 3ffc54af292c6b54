"""Mutual TLS on the exchange (pyflowbuf.net.tls): hostile peers are refused
with a TLSError naming the peer and the reason, the server keeps serving the
others, and no relay thread or descriptor stays behind. Loopback only; every
wait is for a condition, bounded in time."""
import os
import socket
import ssl
import threading
import time
import datetime

import pytest

from pyflowbuf._core.channel import BufferQueue
from pyflowbuf.errors import (AuthenticationError, ConfigurationError, ConnectionLostError, ProtocolError, TLSError,
                              TLSUnavailableError)
from pyflowbuf.net import tls as T
from pyflowbuf.net import TLSConfig
from pipeline_helpers import open_sockets, tls_relay_threads, wait_for
from test_net_handshake import consume, export

pytestmark = pytest.mark.timeout(90)

HANDSHAKE_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def certs():
    return T.JobCertificates("test job")


@pytest.fixture
def net(loopback_network, certs):
    """A TLS server of attempt 0 (handshake timeout 1 s), its config, and a
    check at the end that no relay thread or descriptor stayed behind."""
    net = loopback_network(256)
    cfg = certs.for_attempt(0)
    fds = open_sockets()
    net.tls = cfg
    net.srv = net.server(tls=cfg, handshake_timeout=HANDSHAKE_TIMEOUT)
    net.addr = net.srv.address
    yield net
    net.close()
    wait_for(lambda: not tls_relay_threads(), lambda: f"relay threads left: {tls_relay_threads()}", timeout=20)
    wait_for(lambda: open_sockets() <= fds, lambda: f"sockets: {open_sockets()} now, {fds} before", timeout=20)




def serves(net, pid, n=20000, tls=None):
    """A good TLS consumer still gets all of ``pid`` from the server."""
    mgr = net.manager(tls=tls or net.tls)
    export(net.srv, net.nbp, pid, n)
    assert consume(mgr, net.nbp, net.addr, pid, 30) == list(range(n))
    mgr.close()


def refused(net, match, what=TLSError):
    """The server recorded a refusal of type ``what`` whose message matches."""
    def found():
        return [e for _, e in list(net.srv.errors) if isinstance(e, what) and match in str(e)]
    hit = wait_for(found, lambda: f"no {what.__name__} matching {match!r} in {list(net.srv.errors)}")
    return hit[0]


def client_hello(cfg):
    """The first flight of a real TLS client (its ClientHello)."""
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = cfg.context(False).wrap_bio(inc, out, server_side=False)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def tls_client(net, cfg=None):
    """A client that finished the TLS handshake with the server and stops
    there: the test writes to its TCP socket by hand."""
    sock = socket.create_connection(net.addr, timeout=5)
    relay = T.TLSRelay(sock, cfg or net.tls, server_side=False, peer=net.addr)
    relay.handshake(time.monotonic() + 5)
    # the server's challenge, sent once its side of the TLS handshake is done:
    # what the test sends next arrives after the handshake, however loaded the machine
    while True:
        try:
            if relay.obj.read(1024):
                return relay
        except ssl.SSLWantReadError:
            relay._in.write(sock.recv(65536))


def channel(mgr, net, pid="x"):
    excl, fl = mgr.create_input_pools(net.nbp, 1, 2, 4)
    return mgr.create_channel(net.addr, pid, 0, BufferQueue(net.nbp), excl[0], fl, kind="int64")


# ---------------------------------------------------------------- the good path

def test_records_cross_a_tls_connection_exactly(net):
    serves(net, "good", 200_000)
    assert net.srv.stats()["buffers_sent"] > 0


class _Tap:
    """A TCP proxy in front of ``target`` that keeps every byte it forwards,
    both ways: what anyone on the network path would see."""

    def __init__(self, target):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.seen = []
        self.socks = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self):
        try:
            a, _ = self.listener.accept()
        except OSError:
            return
        b = socket.create_connection(self.target)
        self.socks += [a, b]
        for src, dst in ((a, b), (b, a)):
            buf = bytearray()
            self.seen.append(buf)
            t = threading.Thread(target=self._pipe, args=(src, dst, buf), daemon=True)
            self.threads.append(t)
            t.start()

    @staticmethod
    def _pipe(src, dst, buf):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                buf.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self):
        self.listener.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(10)
        for s in self.socks:
            s.close()
        return b"".join(bytes(b) for b in self.seen)


def test_capture_shows_no_record_payload_in_clear(net):
    """Every byte between the consumer and the server, both ways, taken on
    the network path: the records' bytes never appear, the TLS records do."""
    tap = _Tap(net.addr)
    marker = 0x5EC2E7_0DD_F00D      # an int64 record value easy to spot
    n = 5000
    mgr = net.manager(tls=net.tls)
    pool = net.nbp.create_pool(8, 8)
    q = BufferQueue(net.nbp)
    from pyflowbuf._core.serde import RecordWriter
    writer = RecordWriter(pool, [q], kind="int64", request_timeout=30)
    net.srv.export("cap", 0, q, kind="int64")
    done = threading.Thread(target=lambda: (writer.write_batch([marker] * n), writer.end_input()), daemon=True)
    done.start()
    got = consume(mgr, net.nbp, tap.address, "cap", 30)
    assert got == [marker] * n
    mgr.close()
    wire = tap.close()
    assert len(wire) > 8 * n                         # the records did cross, encrypted
    for order in ("little", "big"):
        assert marker.to_bytes(8, order) not in wire
    assert b"cap" not in wire                         # nor the partition id of the request


def test_without_ssl_a_clear_typed_error(monkeypatch, net):
    monkeypatch.setattr(T, "ssl", None)
    with pytest.raises(TLSUnavailableError, match="no ssl module"):
        net.manager(tls=net.tls)
    with pytest.raises(TLSUnavailableError, match="no ssl module"):
        T.TLSRelay(socket.socket(), net.tls, server_side=False, peer=("x", 1))


def test_repr_and_pickle_keep_the_key_out_of_logs(certs):
    import pickle
    cfg = certs.for_attempt(0)
    assert "PRIVATE" not in repr(cfg) and "<PEM in memory>" in repr(cfg)
    twin = pickle.loads(pickle.dumps(cfg))
    assert twin.fingerprints == cfg.fingerprints
    with pytest.raises(TypeError, match="stays in the driver"):
        pickle.dumps(certs)


def test_config_is_checked():
    # ConfigurationError, the job API's error for a bad setting (a ValueError too)
    with pytest.raises(ConfigurationError, match="ca is required"):
        TLSConfig("c.pem", "k.pem")
    with pytest.raises(ConfigurationError, match="64 hex digits"):
        TLSConfig("c.pem", "k.pem", "ca.pem", fingerprint="abc")
    with pytest.raises(ConfigurationError, match="64 hex digits"):      # a SHA-1 fingerprint
        TLSConfig("c.pem", "k.pem", "ca.pem", fingerprint="e9:f3:1e:d2" + "00" * 16)
    with pytest.raises(ConfigurationError, match="must be PEM"):
        TLSConfig(b"not pem", "k.pem", "ca.pem")
    with pytest.raises(TypeError, match="TLSConfig"):
        from pyflowbuf.net import NetworkServer
        NetworkServer(os.urandom(32), tls=True)


# ---------------------------------------------------------------- hostile peers

def test_plaintext_client_on_a_tls_port(net):
    mgr = net.manager(connect_timeout=5)            # no tls=
    with pytest.raises((ConnectionLostError, ProtocolError)):
        channel(mgr, net)
    e = refused(net, "without tls=")
    assert e.peer[0] == "127.0.0.1" and "did not finish in time" in e.reason
    serves(net, "after-plain")


def test_tls_client_on_a_plaintext_port(loopback_network, certs):
    net = loopback_network(64)
    srv = net.server()
    mgr = net.manager(tls=certs.for_attempt(0), connect_timeout=5)
    excl, fl = mgr.create_input_pools(net.nbp, 1, 2, 4)
    with pytest.raises(TLSError, match="does not speak TLS.*without tls=") as info:
        mgr.create_channel(srv.address, "x", 0, BufferQueue(net.nbp), excl[0], fl, kind="int64")
    assert info.value.peer == tuple(srv.address)
    wait_for(lambda: any("speaks TLS" in str(e) for _, e in srv.errors), lambda: list(srv.errors))


def test_certificate_of_another_ca(net):
    stranger = T.JobCertificates("another job").for_attempt(0)
    mgr = net.manager(tls=stranger)
    with pytest.raises(TLSError, match="this side refused the peer's certificate"):
        channel(mgr, net)
    refused(net, "the peer refused our certificate")
    serves(net, "after-ca")


def test_expired_certificate(net, certs):
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    old = certs.for_attempt(0, not_before=past, not_after=past + datetime.timedelta(days=1))
    # the same CA and no pin: only its dates are wrong
    expired = TLSConfig(old.cert, old.key, old.ca)
    mgr = net.manager(tls=expired)
    with pytest.raises(TLSError):
        channel(mgr, net)
    e = refused(net, "expired")
    assert "this side refused the peer's certificate" in e.reason
    serves(net, "after-expired")


def test_certificate_of_another_attempt(net, certs):
    mgr = net.manager(tls=certs.for_attempt(1))     # the same job's CA, the next attempt
    with pytest.raises(TLSError, match="fingerprint.*another job or attempt"):
        channel(mgr, net)
    refused(net, "another job or attempt")
    serves(net, "after-attempt")


def test_wrong_pinned_fingerprint(net):
    c = net.tls
    pinned_wrong = TLSConfig(c.cert, c.key, c.ca, fingerprint="00" * 32)
    mgr = net.manager(tls=pinned_wrong)
    with pytest.raises(TLSError, match="not the pinned one") as info:
        channel(mgr, net)
    assert info.value.peer == tuple(net.addr)
    serves(net, "after-pin")


def test_truncated_handshake(net):
    hello = client_hello(net.tls)
    s = socket.create_connection(net.addr, timeout=5)
    s.sendall(hello[:len(hello) // 2])
    s.close()
    e = refused(net, "closed in the middle of the TLS handshake")
    assert e.peer[0] == "127.0.0.1"
    serves(net, "after-truncated")


def test_handshake_that_never_finishes(net):
    hello = client_hello(net.tls)
    s = socket.create_connection(net.addr, timeout=5)
    try:
        s.sendall(hello[:20])
        refused(net, "did not finish in time")
        s.settimeout(5)
        assert s.recv(100) == b""                   # the server closed it
    finally:
        s.close()
    serves(net, "after-silent")


def test_handshake_flood_does_not_starve_a_consumer(loopback_network, certs):
    net = loopback_network(256)
    cfg = certs.for_attempt(0)
    srv = net.server(tls=cfg, handshake_timeout=5.0, max_pending_handshakes=8)
    hello = client_hello(cfg)
    flood = []
    for _ in range(24):                 # three times the pending limit, all stuck mid-handshake
        try:
            s = socket.create_connection(srv.address, timeout=5)
            s.sendall(hello[:30])
            flood.append(s)
        except OSError:
            pass
    try:
        assert srv.stats()["pending_handshakes"] <= 8
        mgr = net.manager(tls=cfg, connect_timeout=20)
        export(srv, net.nbp, "flood", 5000)
        assert consume(mgr, net.nbp, srv.address, "flood", 30) == list(range(5000))
        assert any(isinstance(e, (TLSError, ProtocolError)) for _, e in srv.errors)
    finally:
        for s in flood:
            s.close()


def test_tls12_client_cannot_renegotiate(net):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(net.addr, timeout=5) as raw:
        with pytest.raises(ssl.SSLError):
            ctx.wrap_socket(raw).do_handshake()
    refused(net, "no TLS 1.3")
    serves(net, "after-tls12")


def test_handshake_message_after_the_handshake(net):
    relay = tls_client(net)
    try:
        relay.tcp.sendall(client_hello(net.tls))    # a new ClientHello: renegotiation, refused in 1.3
        e = refused(net, "after the handshake")
        assert e.peer[0] == "127.0.0.1"
    finally:
        relay.release()
    serves(net, "after-reneg")


def test_garbage_after_the_handshake(net):
    relay = tls_client(net)
    try:
        relay.tcp.sendall(b"\x17\x03\x03\x00\x40" + os.urandom(64))   # an application record that is noise
        e = refused(net, "was not valid")
        assert "garbage or tampering" in e.reason
    finally:
        relay.release()
    serves(net, "after-garbage")


def test_tls_close_in_the_middle_of_a_frame(net):
    from pyflowbuf.net import frames as F
    relay = tls_client(net)
    try:
        relay.obj.write(F.encode_auth_response(F.MODE_CREDIT, os.urandom(F.NONCE_SIZE), os.urandom(32))[:-5])
        try:
            relay.obj.unwrap()      # close_notify right after part of a frame
        except ssl.SSLWantReadError:
            pass
        relay.tcp.sendall(relay._out.read())
        e = refused(net, "close_notify) in the middle of a frame")
        assert "truncated frame" in e.reason
    finally:
        relay.release()
    serves(net, "after-close")


def test_a_stale_attempt_is_refused_by_the_client_too(loopback_network, certs):
    """The consumer of attempt 1 refuses a producer still serving attempt 0."""
    net = loopback_network(64)
    srv = net.server(tls=certs.for_attempt(0))
    mgr = net.manager(tls=certs.for_attempt(1))
    excl, fl = mgr.create_input_pools(net.nbp, 1, 2, 4)
    with pytest.raises(TLSError, match="not the pinned one"):
        mgr.create_channel(srv.address, "x", 0, BufferQueue(net.nbp), excl[0], fl, kind="int64")
    assert not isinstance(TLSError(("h", 1), "r"), AuthenticationError)


@pytest.mark.parametrize("mutual", [True, False])
def test_https_context_for_the_web_view(certs, mutual):
    """The helper the web view uses for HTTPS: the job's certificate; with
    ``mutual`` a client without one of the job's is refused."""
    import http.server

    cfg = certs.for_attempt(0)
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    httpd.socket = T.https_context(cfg, mutual=mutual).wrap_socket(httpd.socket, server_side=True)
    t = threading.Thread(target=httpd.handle_request, daemon=True)
    t.start()
    try:
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        anonymous.load_verify_locations(cadata=cfg.ca.decode())
        anonymous.check_hostname = False
        with socket.create_connection(httpd.server_address, timeout=5) as raw:
            try:        # (TLS 1.3: the refusal of the client's certificate comes after its handshake)
                with anonymous.wrap_socket(raw) as s:
                    s.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
                    answer = s.recv(100)
            except (ssl.SSLError, ConnectionError):
                answer = b""
        assert answer.startswith(b"HTTP/") is (not mutual)
    finally:
        t.join(10)
        httpd.server_close()


def test_environment_tls_is_checked():
    import pyflowbuf as fb
    from pyflowbuf.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="tls"):
        fb.Environment(workers=2, tls="yes")
    assert fb.Environment(tls=True).configuration()["tls"] is True


def test_a_peer_that_stops_reading_does_not_hold_the_relay(certs, monkeypatch):
    """The local end closes while the relay still has bytes for a peer that
    reads nothing: the relay gives up after _FLUSH_S instead of waiting forever."""
    monkeypatch.setattr(T, "_FLUSH_S", 0.5)
    cfg = certs.for_attempt(0)
    ls = socket.create_server(("127.0.0.1", 0))
    client_sock = socket.create_connection(ls.getsockname())
    srv_sock, peer = ls.accept()
    ls.close()
    client = T.TLSRelay(client_sock, cfg, server_side=False, peer=peer)
    server = T.TLSRelay(srv_sock, cfg, server_side=True, peer=peer)
    t = threading.Thread(target=client.handshake, args=(time.monotonic() + 10,))
    t.start()
    server.handshake(time.monotonic() + 10)
    t.join()
    server.start()
    server.local.setblocking(False)
    chunk = bytes(1 << 16)
    stuck_since = None
    while stuck_since is None or time.monotonic() - stuck_since < 0.5:   # until the peer's window is full
        try:
            server.local.send(chunk)
            stuck_since = None
        except BlockingIOError:
            stuck_since = stuck_since or time.monotonic()
            time.sleep(0.05)
    server.local.close()
    wait_for(lambda: not server.alive, "the relay to give up on a peer that does not read", timeout=20)
    client_sock.close()
    client.release()
    server.release()
