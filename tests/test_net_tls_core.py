"""TLS inside the exchange's own loops (libssl in the compiled core,
csrc/fb_tls.h, netio.TLSSocket): no relay thread, AES-128-GCM, batches of
frames byte-exact through Wire and the readers, and the relay fallback."""
import fcntl
import socket
import struct
import termios
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from pyflowbuf._core import netio
from pyflowbuf.errors import TLSError
from pyflowbuf.net import tls as T
from pipeline_helpers import wait_for
from test_net_handshake import consume, export

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(not netio.HAVE_TLS, reason="the core was built without libssl")]


@pytest.fixture(scope="module")
def cfg():
    return T.JobCertificates("core test").for_attempt(0)


def _pair(cfg):
    ls = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(ls.getsockname())
    b, _ = ls.accept()
    ls.close()
    client = T.CoreTLS(a, cfg, server_side=False, peer="server")
    server = T.CoreTLS(b, cfg, server_side=True, peer="client")
    t = threading.Thread(target=server.handshake, args=(time.monotonic() + 10,))
    t.start()
    client.handshake(time.monotonic() + 10)
    t.join()
    return client, server


def _tls_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("pyflowbuf-tls")]


def test_exchange_runs_tls_in_the_core_with_aes128(loopback_network, cfg):
    """No relay thread while records cross; the suite is AES-128-GCM (the relay had AES-256)."""
    net = loopback_network(256)
    srv = net.server(tls=cfg)
    mgr = net.manager(tls=cfg)
    export(srv, net.nbp, "p", 50_000)
    seen = []
    real = T.CoreTLS.handshake

    def spy(self, deadline=None):
        real(self, deadline)
        seen.append((self.server_side, self.cipher, _tls_threads()))
    T.CoreTLS.handshake = spy
    try:
        assert consume(mgr, net.nbp, srv.address, "p", 30) == list(range(50_000))
    finally:
        T.CoreTLS.handshake = real
    assert _tls_threads() == []
    assert {s for s, _, _ in seen} == {True, False}
    assert all(c == "TLS_AES_128_GCM_SHA256" for _, c, _ in seen)
    mgr.close()
    net.close()


def test_relay_fallback_when_asked(loopback_network, cfg, monkeypatch):
    """PYFLOWBUF_TLS_RELAY=1 (as a core without libssl): the relay carries the same records."""
    monkeypatch.setenv("PYFLOWBUF_TLS_RELAY", "1")
    assert not T.in_core()
    net = loopback_network(256)
    srv = net.server(tls=cfg)
    mgr = net.manager(tls=cfg)
    export(srv, net.nbp, "p", 20_000)
    assert consume(mgr, net.nbp, srv.address, "p", 30) == list(range(20_000))
    mgr.close()
    net.close()


@settings(max_examples=25, deadline=None)
@given(pieces=st.lists(st.lists(st.integers(0, 70_000), min_size=1, max_size=20), min_size=1, max_size=6),
       split=st.integers(1, 60_000))
def test_batches_cross_byte_exact(cfg, pieces, split):
    """Wire.sendmsg batches (small headers staged into short records, large
    pieces encrypted in place, flushed every 256 KiB) arrive as the same
    byte stream, read back in two-buffer recvmsg_into calls of any split."""
    client, server = _pair(cfg)
    try:
        wire = netio.Wire(client.sock)
        want = bytearray()
        batches = []
        for sizes in pieces:
            parts = [bytes([(len(want) + i) % 251]) * n for i, n in enumerate(sizes)]
            batches.append(parts)
            for p in parts:
                want += p
        t = threading.Thread(target=lambda: [wire.sendmsg(b) for b in batches])
        t.start()
        got = bytearray()
        a, b = bytearray(split), bytearray(49)
        while len(got) < len(want):
            n = server.sock.recvmsg_into([a, b])[0]
            assert n > 0
            got += (a + b)[:n] if n > split else a[:n]
        t.join()
        assert got == want
    finally:
        client.release()
        server.release()


def _queued(sock) -> int:
    """Bytes waiting in the socket's receive queue."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_queued_ciphertext_is_taken_in_few_system_calls(cfg):
    """Ciphertext already on the socket is received in large reads, not one
    recv per 16 KiB record (libssl asks for one record at a time): system
    calls were a large share of the receiver's CPU per byte."""
    client, server = _pair(cfg)
    try:
        server.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        data = bytes(range(256)) * 512                  # 128 KiB: 8 full records
        client.sock.sendall(data)
        wait_for(lambda: _queued(server.tcp) >= len(data) + 8 * 22, "all the ciphertext queued at the receiver")
        before = server.sock.stats()["recv_calls"]
        got = bytearray()
        buf = bytearray(len(data))
        while len(got) < len(data):
            n = server.sock.recv_into(buf)
            assert n > 0
            got += buf[:n]
        assert got == data
        assert server.sock.stats()["recv_calls"] - before <= 2
    finally:
        client.release()
        server.release()


def test_close_notify_then_end_of_stream(cfg):
    client, server = _pair(cfg)
    client.sock.sendall(b"last words")
    client.release()
    buf = bytearray(64)
    assert server.sock.recv_into(buf) == 10 and bytes(buf[:10]) == b"last words"
    assert server.sock.recv_into(buf) == 0
    assert server.peer_closed
    server.release()


def test_garbage_record_is_a_typed_error_naming_the_peer(cfg):
    client, server = _pair(cfg)
    try:
        client.tcp.sendall(b"\x17\x03\x03\x00\x40" + bytes(64))
        server.sock.settimeout(10)
        with pytest.raises(TLSError, match="client.*not valid"):
            server.sock.recv_into(bytearray(100))
        assert isinstance(server.error, TLSError)
        with pytest.raises(TLSError):     # sticky: the connection is over
            server.sock.sendall(b"x")
    finally:
        client.release()
        server.release()


def test_recv_timeout(cfg):
    client, server = _pair(cfg)
    try:
        server.sock.settimeout(0.05)
        with pytest.raises(socket.timeout):
            server.sock.recv_into(bytearray(10))
    finally:
        client.release()
        server.release()


def test_files_with_the_key_inside_the_certificate(cfg, tmp_path):
    """The user's own files, read where the connection is made: a PEM holding
    certificate and key (key=None), and the CA."""
    both, ca = tmp_path / "node.pem", tmp_path / "ca.pem"
    both.write_bytes(cfg.cert + cfg.key)
    ca.write_bytes(cfg.ca)
    own = T.TLSConfig(str(both), None, str(ca), fingerprint=next(iter(cfg.fingerprints)))
    client, server = _pair(own)
    try:
        client.sock.sendall(b"hello")
        buf = bytearray(5)
        assert server.sock.recv_into(buf) == 5 and buf == b"hello"
    finally:
        client.release()
        server.release()


def test_a_key_that_does_not_match_is_refused_when_loaded(cfg):
    other = T.JobCertificates("other").for_attempt(0)
    from pyflowbuf.errors import TLSUnavailableError
    with pytest.raises(TLSUnavailableError, match="cannot use the private key: key values mismatch"):
        T.TLSConfig(cfg.cert, other.key, cfg.ca).core_context(True)
