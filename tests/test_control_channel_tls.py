"""The driver <-> worker control channel with ``tls=``
(pyflowbuf.cluster.control_channel over pyflowbuf.net.tls.SSLStream):
Python's ssl on the TCP socket itself, no relay thread; one reader and
several writers at once; a readable socket still means a whole message (so
``poll`` and ``multiprocessing.connection.wait`` see every one); a foreign
certificate is refused with a TLSError naming the peer, and the listener goes
on. Every wait is for a condition, bounded in time."""
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import time

import numpy as np
import pytest

import pyflowbuf as fb
from pyflowbuf.cluster.control_channel import ControlListener, connect_control
from pyflowbuf.errors import TLSError, TLSUnavailableError
from pyflowbuf.net import TLSConfig
from pyflowbuf.net import tls as T
from pipeline_helpers import open_sockets, tls_relay_threads, wait_for

pytestmark = pytest.mark.timeout(120)

SECRET = b"s" * 32


@pytest.fixture(scope="module")
def certs():
    return T.JobCertificates("control tls job")


@pytest.fixture
def listener(certs):
    lis = ControlListener(SECRET, host="127.0.0.1", tls=certs.for_attempt(0), handshake_timeout=2)
    lis.start()
    yield lis
    lis.close()




def _pair(listener, tls):
    worker = connect_control(listener.address, SECRET, tls=tls, timeout=10)
    driver = listener.accept(time.monotonic() + 10)
    assert driver is not None
    return worker, driver


def _refusal(listener, match):
    hit = wait_for(lambda: [(p, e) for p, e in list(listener.errors) if isinstance(e, TLSError) and match in e.reason],
                   lambda: f"a TLSError with {match!r} in {listener.errors}")
    return hit[0]


@pytest.mark.parametrize("relay_env", [None, "1"], ids=["core", "exchange-relay-fallback"])
def test_messages_cross_without_a_relay_thread(listener, certs, relay_env, monkeypatch):
    """Whatever the exchange uses (the core's libssl, or the relay fallback
    PYFLOWBUF_TLS_RELAY=1 stands for), the control channel runs no thread."""
    if relay_env:
        monkeypatch.setenv("PYFLOWBUF_TLS_RELAY", relay_env)
    before = open_sockets()
    worker, driver = _pair(listener, certs.for_attempt(0))
    assert tls_relay_threads() == []
    big = np.arange(300_000, dtype=np.int64)             # many TLS records in one message
    for msg in [(0, ("hello", 1)), (0, ("metrics", "x" * 70_000)), (0, ("rows", big)), (1, ())]:
        worker.send(msg)
        got = driver.recv()
        if isinstance(msg[1], tuple) and msg[1] and isinstance(msg[1][-1], np.ndarray):
            assert got[1][0] == "rows" and np.array_equal(got[1][1], big)
        else:
            assert got == msg
        driver.send(msg[:1])
        assert worker.recv() == msg[:1]
    assert tls_relay_threads() == []
    worker.close()
    with pytest.raises(EOFError):
        driver.recv()
    driver.close()
    wait_for(lambda: open_sockets() <= before, lambda: f"sockets: {open_sockets()} now, {before} before")


def test_wait_sees_every_message_that_arrived(listener, certs):
    """Sent back to back, read one per wake-up of multiprocessing.connection.wait
    (what the driver's loop does): none stays behind in a TLS buffer unseen."""
    worker, driver = _pair(listener, certs.for_attempt(0))
    sizes = [10, 20_000, 5, 100_000, 1, 16_384, 16_385, 3]
    for i, n in enumerate(sizes):
        worker.send((i, "y" * n))
    for i, n in enumerate(sizes):
        assert multiprocessing.connection.wait([driver], timeout=10) == [driver]
        assert driver.recv() == (i, "y" * n)
    assert not driver.poll(0.05)
    worker.close()
    driver.close()


def test_one_reader_and_several_writers_at_once(listener, certs):
    """Both ends read and write from several threads at once: every message
    arrives whole, in each writer's order."""
    worker, driver = _pair(listener, certs.for_attempt(0))
    per_writer, writers = 150, 3

    def write(ch, w):
        for i in range(per_writer):
            ch.send((w, i, "z" * (i * 997 % 40_000)))

    def read(ch, out):
        for _ in range(per_writer * writers):
            out.append(ch.recv())

    got_driver, got_worker = [], []
    threads = [threading.Thread(target=read, args=(driver, got_driver)),
               threading.Thread(target=read, args=(worker, got_worker))]
    threads += [threading.Thread(target=write, args=(worker, w)) for w in range(writers)]
    threads += [threading.Thread(target=write, args=(driver, w)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for got in (got_driver, got_worker):
        for w in range(writers):
            mine = [m for m in got if m[0] == w]
            assert [m[1] for m in mine] == list(range(per_writer))
            assert all(m[2] == "z" * (m[1] * 997 % 40_000) for m in mine)
    worker.close()
    driver.close()


def test_close_wakes_a_thread_blocked_in_recv(listener, certs):
    worker, driver = _pair(listener, certs.for_attempt(0))
    ended = threading.Event()

    def reader():
        try:
            worker.recv()
        except EOFError:
            ended.set()

    t = threading.Thread(target=reader)
    t.start()
    wait_for(lambda: t.is_alive(), "the reader to start")
    worker.close()
    t.join(10)
    assert ended.is_set()
    driver.close()


def test_a_client_certificate_of_another_ca_is_refused_naming_each_peer(listener, certs):
    """The worker trusts the driver but presents another CA's certificate:
    the driver refuses it, and the worker hears that it was its certificate."""
    stranger = T.JobCertificates("another job").for_attempt(0)
    wrong = TLSConfig(stranger.cert, stranger.key, certs.for_attempt(0).ca)
    with pytest.raises(TLSError) as info:
        connect_control(listener.address, SECRET, tls=wrong, timeout=10)
    assert info.value.peer == tuple(listener.address)
    assert "the peer refused our certificate" in info.value.reason
    peer, err = _refusal(listener, "this side refused the peer's certificate")
    assert peer[0] == "127.0.0.1" and err.peer == peer
    worker, driver = _pair(listener, certs.for_attempt(0))       # the listener goes on
    worker.send("after")
    assert driver.recv() == "after"
    worker.close()
    driver.close()


def test_a_driver_of_another_ca_is_refused_by_the_worker(listener):
    stranger = T.JobCertificates("another job").for_attempt(0)
    with pytest.raises(TLSError) as info:
        connect_control(listener.address, SECRET, tls=stranger, timeout=10)
    assert info.value.peer == tuple(listener.address)
    assert "this side refused the peer's certificate" in info.value.reason
    peer, err = _refusal(listener, "the peer refused our certificate")
    assert peer[0] == "127.0.0.1"


def test_a_certificate_of_another_attempt_is_refused(listener, certs):
    with pytest.raises(TLSError, match="not the pinned one"):
        connect_control(listener.address, SECRET, tls=certs.for_attempt(1), timeout=10)
    _refusal(listener, "not the pinned one")


def test_a_plaintext_worker_is_dropped_at_the_handshake_timeout(listener, certs):
    with pytest.raises((OSError, EOFError)):
        connect_control(listener.address, SECRET, timeout=10)
    _refusal(listener, "did not finish in time")
    worker, driver = _pair(listener, certs.for_attempt(0))
    worker.close()
    driver.close()


def test_garbage_after_the_handshake_ends_the_channel_with_the_reason(listener, certs):
    worker, driver = _pair(listener, certs.for_attempt(0))
    raw = socket.socket(fileno=os.dup(worker.fileno()))
    try:
        raw.sendall(b"\x17\x03\x03\x00\x40" + bytes(64))     # an application record nobody encrypted
    finally:
        raw.close()
    with pytest.raises(EOFError, match="not valid") as info:
        driver.recv()
    assert isinstance(info.value.__cause__, TLSError) and info.value.__cause__.peer[0] == "127.0.0.1"
    worker.close()
    driver.close()


def _thread_names(x):
    return [(os.getpid(), tuple(sorted(t.name for t in threading.enumerate())))]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork")
def test_a_tls_job_with_workers_runs_no_relay_thread():
    """workers=2, tls=True: no process of the job runs a relay thread
    (the forked workers' control is a pipe; their exchange is TLS in the core)."""
    env = fb.Environment(workers=2, parallelism=2, tls=True)
    seen = (env.from_sequence(0, 4000).rebalance().map(lambda x: x)
            .flat_map(lambda x: _thread_names(x) if x % 101 == 0 else []).collect())
    env.execute()
    names = dict(seen.result)
    assert len(names) == 2                      # both workers reported
    assert all(any(n.startswith("pyflowbuf-net") for n in ns) for ns in names.values())   # the exchange ran
    assert not [n for ns in names.values() for n in ns if n.startswith("pyflowbuf-tls")]
    assert tls_relay_threads() == []


def test_a_certificate_file_that_cannot_be_read_is_refused_at_once(tmp_path):
    """Not by the accept thread at the first worker's connection (it ended
    there, and the driver only learnt that no worker started)."""
    bad = TLSConfig(str(tmp_path / "missing.pem"), None, str(tmp_path / "missing-ca.pem"))
    with pytest.raises(TLSUnavailableError, match="missing.pem"):
        ControlListener(SECRET, host="127.0.0.1", tls=bad).start()
    lis = ControlListener(SECRET, host="127.0.0.1")
    lis.start()
    try:
        with pytest.raises(TLSUnavailableError, match="missing.pem"):
            lis.set_secret(b"t" * 32, tls=bad)          # as a SparkLauncher's next attempt does
        assert lis.tls is None and lis.secret == SECRET
    finally:
        lis.close()
