"""Remote exchange end to end on loopback: threads in one process, and
across processes (multiprocessing 'spawn'), including killed and corrupt peers."""
import multiprocessing as mp
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf._core.channel import BARRIER
from pyflowbuf.errors import (AuthenticationError, CancelledError, ConnectionLostError,
                              PartitionNotFoundError, ProtocolError, RemoteError)
from pyflowbuf.net import ConnectionManager, NetworkServer, new_secret
from pyflowbuf.net import frames as F
from pyflowbuf.net import protocol as P
from pipeline_helpers import wait_for

pytestmark = pytest.mark.timeout(90)

SEG = 32 * 1024


class Producer:
    """A RecordWriter feeding one exported subpartition from its own thread."""

    def __init__(self, server, nbp, pid, sub=0, n=None, kind="int64", batch=2000, buffers=8,
                 allow_pickle=False, records=None):
        self.pool = nbp.create_pool(buffers, buffers)
        self.queue = BufferQueue(nbp)
        self.writer = RecordWriter(self.pool, [self.queue], kind=kind, request_timeout=60)
        self.n, self.batch, self.records = n, batch, records
        self.released = []
        self.cancelled = threading.Event()
        self.stop = threading.Event()
        server.export(pid, sub, self.queue, kind=kind, allow_pickle=allow_pickle, on_release=self._on_release)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _on_release(self, exc):
        self.released.append(exc)
        self.writer.cancel()

    def start(self):
        self.thread.start()
        return self

    def _run(self):
        try:
            if self.records is not None:
                self.writer.write_batch(self.records)
            else:
                i = 0
                while (self.n is None or i < self.n) and not self.stop.is_set():
                    k = self.batch if self.n is None else min(self.batch, self.n - i)
                    self.writer.write_batch(list(range(i, i + k)))
                    i += k
            self.writer.end_input()
        except CancelledError:
            self.cancelled.set()


def open_channel(mgr, nbp, addr, pid, sub=0, kind="int64", exclusive=2, floating=8, **kw):
    excl, fl = mgr.create_input_pools(nbp, 1, exclusive, floating)
    q = BufferQueue(nbp)
    ch = mgr.create_channel(addr, pid, sub, q, excl[0], fl, kind=kind, **kw)
    gate = InputGate([q])
    ch.attach_gate(gate)
    return ch, RecordReader(gate, kind=kind), (excl[0], fl)


def read_all(reader, timeout=30):
    out, events = [], []
    deadline = time.monotonic() + timeout
    while not reader.finished:
        assert time.monotonic() < deadline, "stream did not finish in time"
        out += reader.read_batch(8192, timeout=0.5)
        ev = reader.take_event()
        if ev is not None:
            events.append(ev)
    return out, events


@pytest.fixture
def env(loopback_network):
    net = loopback_network(512)
    return net.secret, net.nbp, net.server, net.manager


# ------------------------------------------------------------ one process, threads

def test_many_channels_one_connection_records_and_events(env):
    secret, nbp, server, manager = env
    srv = server()
    assert srv.address[0] == "127.0.0.1"
    mgr = manager()
    n = 300_000
    prods = [Producer(srv, nbp, "job/map", sub, n) for sub in range(3)]
    prods[1].queue.push_event(BARRIER, 42)       # an event before any data
    chans = [open_channel(mgr, nbp, srv.address, "job/map", sub) for sub in range(3)]
    for p in prods:
        p.start()
    for ch, reader, pools in chans:
        recs, events = read_all(reader)
        assert recs == list(range(n))
        assert ch.state == "finished"
    assert chans[1][0].events_received == 2 and read_all(chans[1][1])[1] == []
    assert mgr.connections == 1 and srv.connections == 1
    for ch, reader, (excl, fl) in chans:
        del reader
        wait_for(lambda: excl.in_use == 0 and fl.in_use == 0)   # reserved buffers given back
    for sub, p in enumerate(prods):
        wait_for(lambda: p.pool.in_use == 0)   # the sender recycles after its send returns
        wait_for(lambda: srv.export_state("job/map", sub) == "finished")
        assert not p.released


def test_events_reach_the_reader(env):
    secret, nbp, server, manager = env
    srv = server()
    p = Producer(srv, nbp, "p", 0, records=[1, 2, 3])
    p.writer.write_batch([1, 2])
    p.writer.broadcast_event(BARRIER, 7)
    p.records = [3]
    ch, reader, _ = open_channel(manager(), nbp, srv.address, "p")
    p.start()
    recs, events = read_all(reader)
    assert recs == [1, 2, 3]
    assert events == [(0, BARRIER, 7, 0)]


@pytest.mark.parametrize("credit_based", [True, False])
def test_tcp_only_and_credit_modes_deliver_everything(env, credit_based):
    secret, nbp, server, manager = env
    srv = server()
    mgr = manager(credit_based=credit_based)
    p = Producer(srv, nbp, "p", 0, 200_000).start()
    ch, reader, _ = open_channel(mgr, nbp, srv.address, "p")
    assert read_all(reader)[0] == list(range(200_000))
    wait_for(lambda: p.pool.in_use == 0)


def test_zero_exclusive_buffers_backlog_announcement(env):
    secret, nbp, server, manager = env
    srv = server()
    p = Producer(srv, nbp, "p", 0, 100_000).start()
    ch, reader, (excl, fl) = open_channel(manager(), nbp, srv.address, "p", exclusive=0, floating=1)
    assert excl is None and ch.credit.initial_credit == 0
    assert read_all(reader)[0] == list(range(100_000))
    wait_for(lambda: p.pool.in_use == 0)
    assert srv.stats()["backlog_announcements"] > 0     # the only way it got credit


def test_fixed_width_buffers_keep_their_width(env):
    secret, nbp, server, manager = env
    srv = server()
    pool = nbp.create_pool(4, 4)
    q = BufferQueue(nbp)
    srv.export("arr", 0, q)
    w = RecordWriter(pool, [q])
    ch, reader, _ = open_channel(manager(), nbp, srv.address, "arr", kind="bytes")
    a = np.arange(10_000, dtype=np.int64)
    w.write_array(a)
    w.end_input()
    got = []
    while not reader.finished:
        arr = reader.read_array(np.int64, timeout=5)
        if arr is not None:
            got.append(arr.copy())
    assert np.array_equal(np.concatenate(got), a)


def test_priority_event_overtakes_data_without_credit(env):
    secret, nbp, server, manager = env
    srv = server()
    pool = nbp.create_pool(4, 4)
    q = BufferQueue(nbp)
    srv.export("p", 0, q, kind="bytes")
    for i in range(3):
        b = pool.request()
        b.write(struct.pack("<I", 8) + struct.pack("<q", i))
        q.push_buffer(b)
    q.push_event(BARRIER, 99, 0, True)    # an unaligned barrier
    mgr = manager()
    excl, _ = mgr.create_input_pools(nbp, 1, 1, 0)
    rq = BufferQueue(nbp)
    ch = mgr.create_channel(srv.address, "p", 0, rq, excl[0], None, kind="bytes")
    wait_for(lambda: len(rq) >= 2)
    assert rq.pop_buffer() == (BARRIER, 99, 0)      # ahead of the data it overtook
    first = rq.pop_buffer()
    assert struct.unpack_from("<q", memoryview(first), 4)[0] == 0
    first.recycle()
    ch.cancel()


def test_wrong_secret_is_refused_and_server_stays_healthy(env):
    secret, nbp, server, manager = env
    srv = server()
    Producer(srv, nbp, "p", 0, 1000).start()
    bad = manager(secret=new_secret())
    with pytest.raises(AuthenticationError):
        open_channel(bad, nbp, srv.address, "p")
    wait_for(lambda: any(isinstance(e, AuthenticationError) for _, e in srv.errors))
    assert srv.export_state("p", 0) == "ready"
    ch, reader, _ = open_channel(manager(), nbp, srv.address, "p")
    assert read_all(reader)[0] == list(range(1000))


def test_bad_secret_values_rejected():
    with pytest.raises(ValueError):
        NetworkServer(b"short")
    with pytest.raises(TypeError):
        ConnectionManager(12345)


def test_pickle_needs_opt_in_on_both_sides(env):
    secret, nbp, server, manager = env
    srv = server()
    q = BufferQueue(nbp)
    with pytest.raises(ValueError, match="allow_pickle"):
        srv.export("py", 0, q, kind="pickle")
    mgr = manager()
    excl, fl = mgr.create_input_pools(nbp, 1)
    with pytest.raises(ValueError, match="allow_pickle"):
        mgr.create_channel(srv.address, "py", 0, BufferQueue(nbp), excl[0], fl, kind="pickle")
    objs = [{"a": 1}, (2, "x"), None]
    Producer(srv, nbp, "py", 0, kind="pickle", allow_pickle=True, records=objs).start()
    ch, reader, _ = open_channel(mgr, nbp, srv.address, "py", kind="pickle", allow_pickle=True)
    assert read_all(reader)[0] == objs


def test_kind_mismatch_fails_the_channel_with_a_clear_error(env):
    secret, nbp, server, manager = env
    srv = server()
    Producer(srv, nbp, "p", 0, 10, kind="int64")
    errors = []
    ch, reader, _ = open_channel(manager(), nbp, srv.address, "p", kind="str",
                                 on_error=lambda c, e: errors.append(e))
    with pytest.raises(CancelledError):
        read_all(reader, timeout=10)
    assert isinstance(ch.error, RemoteError) and ch.error.error_kind == "KindMismatch"
    assert "int64" in str(ch.error) and errors == [ch.error]
    with pytest.raises(RemoteError):
        ch.check()


def test_partition_request_retried_until_exported(env):
    secret, nbp, server, manager = env
    srv = server()
    ch, reader, _ = open_channel(manager(), nbp, srv.address, "late", 0)
    time.sleep(0.3)
    Producer(srv, nbp, "late", 0, 5000).start()
    assert read_all(reader)[0] == list(range(5000))


def test_partition_never_exported_fails_in_bounded_time(env):
    secret, nbp, server, manager = env
    srv = server()
    t0 = time.monotonic()
    ch, reader, _ = open_channel(manager(partition_request_timeout=0.5), nbp, srv.address, "nope")
    with pytest.raises(CancelledError):
        read_all(reader, timeout=10)
    assert isinstance(ch.error, PartitionNotFoundError)
    assert time.monotonic() - t0 < 5


def test_cancel_one_channel_others_continue(env):
    secret, nbp, server, manager = env
    srv = server()
    mgr = manager()
    endless = Producer(srv, nbp, "p", 0).start()
    finite = Producer(srv, nbp, "p", 1, 200_000)
    ch0, r0, (excl0, fl0) = open_channel(mgr, nbp, srv.address, "p", 0)
    ch1, r1, _ = open_channel(mgr, nbp, srv.address, "p", 1)
    got = []
    while len(got) < 50_000:
        got += r0.read_batch(8192, timeout=5)
    ch0.cancel()
    wait_for(lambda: endless.released and endless.cancelled.is_set())
    assert isinstance(endless.released[0], CancelledError)
    finite.start()
    assert read_all(r1)[0] == list(range(200_000))
    assert mgr.connections == 1


@pytest.mark.parametrize("credit_based", [True, False])
def test_head_of_line_blocking_only_without_credit(env, credit_based):
    """Two channels on one connection; channel A's consumer stalls. With credit
    B finishes regardless; with the TCP window only, B stalls with A."""
    secret, nbp, server, manager = env
    srv = server()
    mgr = manager(credit_based=credit_based)
    Producer(srv, nbp, "p", 0, 500_000, buffers=16).start()
    pb = Producer(srv, nbp, "p", 1, 300_000)
    cha, ra, _ = open_channel(mgr, nbp, srv.address, "p", 0)
    chb, rb, _ = open_channel(mgr, nbp, srv.address, "p", 1)
    wait_for(lambda: len(cha.queue) >= 2)        # A is receiving; its consumer never reads yet
    time.sleep(0.2)
    pb.start()
    got, deadline = 0, time.monotonic() + (20 if credit_based else 1.5)
    while not rb.finished and time.monotonic() < deadline:
        got += len(rb.read_batch(8192, timeout=0.1))
    if credit_based:
        assert rb.finished and got == 300_000
    else:
        assert not rb.finished and got < 300_000     # B waits behind A's stalled buffers
        rest = []
        t = threading.Thread(target=lambda: rest.append(len(read_all(rb)[0])))
        t.start()
        assert len(read_all(ra)[0]) == 500_000      # A's consumer wakes: both drain
        t.join(30)
        assert got + rest[0] == 300_000


def test_block_on_barrier_resume_and_buffer_size(env):
    secret, nbp, server, manager = env
    srv = server()
    sizes = []
    pool = nbp.create_pool(4, 4)
    q = BufferQueue(nbp)
    srv.export("p", 0, q, kind="int64", on_buffer_size=sizes.append)
    w = RecordWriter(pool, [q], kind="int64")
    ch, reader, _ = open_channel(manager(), nbp, srv.address, "p", block_on_barrier=True)
    w.write_batch([1, 2])
    w.broadcast_event(BARRIER, 5)
    w.write_batch([3])
    w.flush()
    got = []
    deadline = time.monotonic() + 10
    while reader.take_event() is None:
        got += reader.read_batch(100, timeout=0.1)
        assert time.monotonic() < deadline
    assert got == [1, 2]
    assert reader.read_batch(100, timeout=0.3) == []    # the producer holds back after the barrier
    ch.resume_consumption()
    assert reader.read_batch(100, timeout=5) == [3]
    ch.announce_buffer_size(4096)
    wait_for(lambda: sizes == [4096])
    assert srv.export_state("p", 0) == "consuming"
    w.end_input()
    read_all(reader)
    wait_for(lambda: srv.export_state("p", 0) == "finished")
    st = srv.stats()
    assert st["buffers_sent"] == 2 and st["bytes_sent"] == 36


def test_explicit_host_and_port(env):
    secret, nbp, server, manager = env
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    srv = server(host="127.0.0.1", port=port)
    assert srv.address == ("127.0.0.1", port)
    Producer(srv, nbp, "p", 0, 1000).start()
    ch, reader, _ = open_channel(manager(), nbp, ("127.0.0.1", port), "p")
    assert read_all(reader)[0] == list(range(1000))


# ------------------------------------------------------------ corrupt peers

def _corrupt_bytes(kind, rid):
    data = struct.pack("<I", 8) + struct.pack("<q", 1)
    good0 = F.encode_buffer_header(rid, 0, 0, 0, F.DATA_RECORDS, len(data)) + data
    if kind == "bad_magic":
        return good0[:4] + b"\xde\xad\xbe\xef" + good0[8:]
    if kind == "oversized":
        return F._BUFFER_FULL.pack(F.BUFFER_HEADER_SIZE + SEG + 1, F.MAGIC, 0, rid, 0, 0, 0, 0, 0, SEG + 1, 0, 0)
    if kind == "unknown_id":
        return struct.pack(">iIB", 9, F.MAGIC, 77)
    if kind == "seq_gap":
        return good0 + F.encode_buffer_header(rid, 0, 2, 0, F.DATA_RECORDS, len(data)) + data
    if kind == "truncated":
        return good0[:30]
    if kind == "no_credit":  # 2 exclusive + 8 floating buffers at most while nothing is consumed
        return b"".join(F.encode_buffer_header(rid, 0, s, 0, F.DATA_RECORDS, len(data)) + data for s in range(12))
    if kind == "priority_event_bad_size":
        return F.encode_buffer_header(rid, 0, 0, 0, F.DATA_EVENT | F.PRIORITY_BIT, 3) + b"abc"
    if kind == "unknown_receiver":
        return F.encode_buffer_header(os.urandom(16), 0, 0, 0, F.DATA_RECORDS, len(data)) + data
    raise ValueError(kind)


CORRUPT = ["bad_magic", "oversized", "unknown_id", "seq_gap", "truncated", "no_credit", "unknown_receiver",
           "priority_event_bad_size"]


def fake_server(secret, lsock, kind, done=None, told=None):
    """Authenticates like a real producer, then sends ``kind`` of garbage."""
    s, _ = lsock.accept()
    try:
        s.settimeout(10)
        reader = P.FrameReader(s, SEG)
        P.server_handshake(s, reader, secret, SEG)
        length, msg_id = reader.read_header()
        req = reader.read_control(length, msg_id)
        assert type(req) is F.PartitionRequest and req.credit == 2
        s.sendall(_corrupt_bytes(kind, req.receiver_id))
        if kind == "truncated":
            return
        dec = F.FrameDecoder(SEG)
        while True:              # until the client closes on us
            data = s.recv(4096)
            if not data:
                break
            if told is not None:
                told += [m for m in dec.feed(data) if type(m) is F.ErrorResponse]
    except OSError:
        pass
    finally:
        s.close()
        if done is not None:
            done.set()


@pytest.mark.parametrize("kind", CORRUPT)
def test_corrupt_producer_fails_only_its_connection(env, kind):
    secret, nbp, server, manager = env
    good = server()
    mgr = manager(credit_based=True)
    lsock = socket.create_server(("127.0.0.1", 0))
    done, told = threading.Event(), []
    threading.Thread(target=fake_server, args=(secret, lsock, kind, done, told), daemon=True).start()
    good_prod = Producer(good, nbp, "ok", 0, 100_000)
    chg, rg, _ = open_channel(mgr, nbp, good.address, "ok")
    errors = []
    ch, reader, (excl, fl) = open_channel(mgr, nbp, lsock.getsockname(), "p",
                                          on_error=lambda c, e: errors.append(e))
    wait_for(lambda: ch.state == "failed")       # detected before anything is consumed
    with pytest.raises(CancelledError):
        read_all(reader, timeout=10)
    assert isinstance(ch.error, ProtocolError), ch.error
    assert ch.state == "failed" and errors == [ch.error]
    assert done.wait(10)                         # the bad connection was closed
    if kind != "truncated":
        assert told and told[-1].error_kind == "ProtocolError"   # and we told the peer why
    lsock.close()
    wait_for(lambda: excl.in_use == 0 and fl.in_use == 0)
    good_prod.start()                            # the other connection is unaffected
    assert read_all(rg)[0] == list(range(100_000))
    assert chg.state == "finished" and chg.error is None


def raw_client(addr, secret, payload):
    s = socket.create_connection(addr, timeout=10)
    r = P.FrameReader(s, SEG)
    P.client_handshake(s, r, secret, F.MODE_CREDIT)
    s.sendall(payload)
    return s


@pytest.mark.parametrize("garbage", [
    b"\x00\x00\x00\x09\xde\xad\xbe\xef\x05",                       # bad magic
    struct.pack(">iIB", 10_000_000, F.MAGIC, F.ADD_CREDIT),       # oversized
    struct.pack(">iIB", 9, F.MAGIC, 99),                           # unknown id
    F.encode_buffer_header(b"r" * 16, 0, 0, 0, 0, 0),              # a consumer must not send data
], ids=["bad_magic", "oversized", "unknown_id", "data_from_consumer"])
def test_corrupt_consumer_fails_only_its_connection(env, garbage):
    secret, nbp, server, manager = env
    srv = server()
    victim = Producer(srv, nbp, "v", 0).start()
    ok = Producer(srv, nbp, "ok", 0, 100_000).start()
    s = raw_client(srv.address, secret, F.encode_partition_request("v", 0, b"q" * 16, 2, "int64"))
    wait_for(lambda: srv.export_state("v", 0) == "consuming")
    s.sendall(garbage)
    wait_for(lambda: victim.released)
    assert isinstance(victim.released[0], ProtocolError)
    assert victim.cancelled.wait(10)
    s.settimeout(5)
    dec, msgs = F.FrameDecoder(SEG), []
    try:
        while True:                # the server says why, then closes the connection
            data = s.recv(65536)
            if not data:
                break
            msgs += dec.feed(data)
    except (ConnectionResetError, ProtocolError):
        pass
    s.close()
    errs = [m for m in msgs if type(m) is F.ErrorResponse]
    assert errs and errs[-1].receiver_id is None and errs[-1].error_kind == "ProtocolError"
    ch, reader, _ = open_channel(manager(), nbp, srv.address, "ok")
    assert read_all(reader)[0] == list(range(100_000))
    assert not ok.released


def test_silent_client_times_out_in_handshake(env):
    secret, nbp, server, manager = env
    srv = server(handshake_timeout=0.3)
    s = socket.create_connection(srv.address)
    t0 = time.monotonic()
    s.settimeout(5)
    while s.recv(4096):            # the challenge, then EOF when the server gives up
        pass
    assert time.monotonic() - t0 < 3
    s.close()
    wait_for(lambda: any(isinstance(e, ProtocolError) for _, e in srv.errors))


# ------------------------------------------------------------ across processes

def _child_producer(secret, conn, n, mode):
    nbp = NetworkBufferPool(64)
    if mode == "corrupt":
        lsock = socket.create_server(("127.0.0.1", 0))
        conn.send(lsock.getsockname())
        fake_server(secret, lsock, "seq_gap")
        return
    srv = NetworkServer(secret)
    conn.send(srv.start())
    p = Producer(srv, nbp, "p", 0, n).start()
    conn.recv()            # the parent says when to stop (or kills us)
    p.stop.set()
    srv.close()


def _child_consumer(secret, addr, conn):
    nbp = NetworkBufferPool(64)
    mgr = ConnectionManager(secret)
    ch, reader, _ = open_channel(mgr, nbp, addr, "p")
    got = 0
    while True:
        got += len(reader.read_batch(8192, timeout=1))
        if got >= 100_000:
            conn.send(got)
            got = -10**12   # report once, then keep consuming until killed


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=target, args=args + (b,), daemon=True)
    proc.start()
    return proc, a


def _spawn_producer(secret, n, mode):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_child_producer, args=(secret, b, n, mode), daemon=True)
    proc.start()
    assert a.poll(60), "child did not start"
    return proc, a, a.recv()


def test_two_processes_stream(env):
    secret, nbp, server, manager = env
    proc, pipe, addr = _spawn_producer(secret, 500_000, "finite")
    try:
        ch, reader, _ = open_channel(manager(), nbp, addr, "p")
        recs, _ = read_all(reader, timeout=60)
        assert len(recs) == 500_000 and sum(recs) == 500_000 * 499_999 // 2
        pipe.send("stop")
        proc.join(20)
        assert proc.exitcode == 0
    finally:
        proc.kill()


def test_killed_producer_process_fails_the_channel_quickly(env):
    secret, nbp, server, manager = env
    proc, pipe, addr = _spawn_producer(secret, None, "endless")
    try:
        errors = []
        ch, reader, _ = open_channel(manager(), nbp, addr, "p", on_error=lambda c, e: errors.append(e))
        got = 0
        while got < 100_000:
            got += len(reader.read_batch(8192, timeout=5))
        proc.kill()
        t0 = time.monotonic()
        with pytest.raises(CancelledError):
            while True:
                reader.read_batch(8192, timeout=1)
                assert time.monotonic() - t0 < 10, "the reader did not notice the dead producer"
        assert time.monotonic() - t0 < 5
        assert isinstance(ch.error, (ConnectionLostError, ProtocolError)) and errors == [ch.error]
    finally:
        proc.kill()


def test_killed_consumer_process_releases_the_producer(env):
    secret, nbp, server, manager = env
    srv = server()
    p = Producer(srv, nbp, "p", 0).start()
    proc, pipe = _spawn(_child_consumer, secret, srv.address)
    try:
        assert pipe.poll(60) and pipe.recv() >= 100_000
        proc.kill()
        t0 = time.monotonic()
        wait_for(lambda: p.released, timeout=10)
        assert time.monotonic() - t0 < 5
        assert isinstance(p.released[0], (ConnectionLostError, ProtocolError, CancelledError))
        assert p.cancelled.wait(5)          # the producing task was woken, not left hanging
        assert srv.export_state("p", 0) == "released"
    finally:
        proc.kill()


def test_corrupt_producer_process(env):
    secret, nbp, server, manager = env
    proc, pipe, addr = _spawn_producer(secret, 0, "corrupt")
    try:
        ch, reader, _ = open_channel(manager(), nbp, tuple(addr), "p")
        with pytest.raises(CancelledError):
            read_all(reader, timeout=20)
        assert isinstance(ch.error, ProtocolError) and "sequence gap" in str(ch.error)
    finally:
        proc.kill()
