"""Remote exchange benchmark: two processes on loopback, against a raw socket.

A producer process (spawned once) serves subpartitions through a
NetworkServer; this process consumes them through a ConnectionManager. Every
ratio is the median of per-repetition ratios, both sides run interleaved
(``common.interleaved``). Figures:

remote_vs_raw_socket
    MB/s of 32 KiB buffers through the remote exchange (credit-based, 2
    exclusive + 8 floating buffers, the consumer recycles each buffer) / MB/s
    of a raw loopback stream between the same two processes (sendall of 32 KiB
    chunks, recv_into a 32 KiB bytearray).
remote_records_per_s_12b / remote_records_per_s_12b_per_record
    int64 records (8 bytes + 4-byte length = 12 bytes on the wire, as in
    Flink's network throughput benchmark) end to end: write_batch/read_batch,
    and write()/read() one record per call.
remote_tls_vs_plain
    MB/s of the same 32 KiB buffer stream over one mutual TLS 1.3 connection
    (``NetworkServer(tls=)``: the job's CA, ECDSA P-256, AES-GCM) / over a
    plain one, both to the same producer process.
remote_tls_records_vs_plain
    records/s of a per-record pipeline (``Environment(workers=2)``: a source,
    a map per record, a key_by to a keyed reduce, a sink) with ``tls=True`` /
    without: the exchange between the two worker processes is encrypted.
tls_loop_vs_plain_loop / remote_tls_vs_tls_loop
    the limit of this machine: MB/s of a bare TLS loop (Python's ssl, the
    same certificates, TLS 1.3, mutual, our cipher suite: one thread
    ``sendall`` of 1 MiB in the producer process, one thread ``recv_into`` a
    1 MiB buffer here) / a bare plain loop (the same on a plain socket); and
    ours with TLS / that bare TLS loop: below 1, our framing and credit cost
    more than TLS itself. All four run interleaved.
*_send_cpu_ns_per_byte / *_recv_cpu_ns_per_byte, remote_tls_cpu_vs_plain, tls_loop_cpu_vs_plain_loop
    CPU time per byte of the producer and of the consumer process (all
    their threads) in those four cases; the *_cpu_vs_* ratios (plain's CPU
    per byte / TLS's) are what the throughput ratios fall to when the CPUs
    are busy with other work (a shared machine), the ratios above being
    what they are with a core free for each side.
tls_handshake_ms
    one connection's TLS handshake (connect, both certificates checked, the
    pin), the median of several, on loopback.
hol_credit_other_channel_ratio / hol_tcp_other_channel_ratio
    two channels on one connection, endless 32 KiB buffers on both, each
    consumer taking at most 100 MB/s: the healthy channel's MB/s while the other
    channel's consumer is stalled / its MB/s while both are consumed;
    credit-based mode and TCP-window-only mode.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import socket
import sys
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import common  # noqa: E402
from common import Goal  # noqa: E402

SEG = 32 * 1024
LOOP_CHUNK = 1 << 20
LOOP_SUITES = b"TLS_AES_128_GCM_SHA256"   # what ours negotiates (fb_tls.h prefers it)
GOALS = {
    "remote_vs_raw_socket": Goal(">=", 0.7, "x"),
    "hol_credit_other_channel_ratio": Goal(">=", 0.8, "x"),
    "hol_tcp_other_channel_ratio": Goal("<=", 0.2, "x"),
    "remote_tls_vs_plain": Goal(">=", 0.5, "x"),
    "remote_tls_records_vs_plain": Goal(">=", 0.9, "x"),
}


def params(quick: bool) -> dict:
    if quick:
        return dict(repeats=5, stream_mb=128, batch_records=2_000_000, per_record=400_000,
                    hol_window_s=0.6, hol_repeats=3, hol_consumer_mb_per_s=100,
                    job_records=3_000_000, job_repeats=3, handshakes=20)
    return dict(repeats=11, stream_mb=512, batch_records=6_000_000, per_record=1_500_000,
                hol_window_s=1.5, hol_repeats=5, hol_consumer_mb_per_s=100,
                job_records=10_000_000, job_repeats=5, handshakes=50)


# --------------------------------------------------------------------------- the producer process

def _cpu_s():
    """CPU seconds of this process, all its threads (dead ones included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _producer_main(conn, secret, tls=None):
    """Serves commands from the benchmark process until told to quit."""
    from pyflowbuf._core.memory import NetworkBufferPool
    from pyflowbuf._core.channel import BufferQueue
    from pyflowbuf._core.serde import RecordWriter
    from pyflowbuf._core.channel import END_OF_PARTITION
    from pyflowbuf.errors import FlowBufError
    from pyflowbuf.net import NetworkServer

    nbp = NetworkBufferPool(1024)
    plain = srv = NetworkServer(secret)
    # the same exports, over TLS, for the commands that ask for it
    encrypted = NetworkServer(secret, tls=tls) if tls is not None else None
    conn.send((plain.start(), encrypted.start() if encrypted is not None else None))

    def buffers(pid, sub, n):
        """n (None: until released) full 32 KiB buffers, no record encoding."""
        pool = nbp.create_pool(16, 16)
        q = BufferQueue(nbp)
        srv.export(pid, sub, q, on_release=lambda exc: pool.cancel_waiters())

        def run():
            try:
                i = 0
                while n is None or i < n:
                    b = pool.request() or pool.request_blocking()   # as RecordWriter: wait only when dry
                    b.set_meta(SEG)
                    q.push_buffer(b)
                    i += 1
                q.push_event(END_OF_PARTITION)
            except FlowBufError:
                pass
            finally:
                pool.destroy()
        threading.Thread(target=run, daemon=True).start()

    def records(pid, n, per_record):
        pool = nbp.create_pool(16, 16)
        q = BufferQueue(nbp)
        w = RecordWriter(pool, [q], kind="int64")
        srv.export(pid, 0, q, kind="int64", on_release=lambda exc: w.cancel())

        def run():
            try:
                if per_record:
                    write = w.write
                    for i in range(n):
                        write(i)
                else:
                    for i in range(0, n, 8192):
                        w.write_batch(list(range(i, min(i + 8192, n))))
                w.end_input()
            except FlowBufError:
                pass
            finally:
                pool.destroy()
        threading.Thread(target=run, daemon=True).start()

    while True:
        cmd = conn.recv()
        op = cmd[0]
        if op == "quit":
            break
        if op == "raw":
            _, port, nbytes = cmd
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            chunk = bytearray(SEG)
            for _ in range(nbytes // SEG):
                s.sendall(chunk)
            s.close()
        elif op == "loop":
            _, port, nbytes, use_tls = cmd
            _loop_send(port, nbytes, tls if use_tls else None)
        elif op == "buffers":
            srv = encrypted if cmd[4:] and cmd[4] else plain
            buffers(cmd[1], cmd[2], cmd[3])
        elif op == "records":
            srv = plain
            records(cmd[1], cmd[2], cmd[3])
        elif op == "cpu":
            conn.send(_cpu_s())
            continue
        conn.send("ok")
    plain.close()
    if encrypted is not None:
        encrypted.close()


class Producer:
    def __init__(self, secret, tls=None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer_main, args=(child, secret, tls), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("the producer process did not start")
        self.address, self.tls_address = self.conn.recv()
        self._n = 0

    def call(self, *cmd):
        self.conn.send(cmd)
        return self.conn

    def pid(self):
        self._n += 1
        return f"bench/{self._n}"

    def cpu_s(self):
        return self.call("cpu").recv()

    def close(self):
        try:
            self.conn.send(("quit",))
            self.proc.join(10)
        finally:
            if self.proc.is_alive():
                self.proc.kill()


# --------------------------------------------------------------------------- the bare loops

def loop_context(tls, server_side):
    """Python's ssl context for the bare TLS loop: the same certificates,
    TLS 1.3 only and mutual as ours (``TLSConfig._make_context``), and our
    cipher suite. Python's ssl has no call for TLS 1.3's suites (its default
    prefers AES-256-GCM), so it is set on the context's SSL_CTX through
    libssl itself; ``bare_loop`` checks what was negotiated."""
    import ctypes
    import ssl
    import _ssl

    ctx = tls._make_context(ssl, server_side)
    # its libssl, the one the context lives in (None: _ssl is built into the interpreter)
    lib = ctypes.CDLL(getattr(_ssl, "__file__", None))
    lib.SSL_CTX_set_ciphersuites.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.SSL_CTX_set_ciphersuites.restype = ctypes.c_int
    # PySSLContext: the object's head, then its SSL_CTX *
    ptr = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    if not lib.SSL_CTX_set_ciphersuites(ptr, LOOP_SUITES):
        raise RuntimeError("cannot set the bare loop's TLS 1.3 cipher suites")
    return ctx


def _loop_send(port, nbytes, tls):
    """The bare loop's sender: ``sendall`` of LOOP_CHUNK bytes, over TLS
    (the TLS client) when ``tls`` is given."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        s = loop_context(tls, False).wrap_socket(s, server_side=False)
    chunk = bytearray(LOOP_CHUNK)
    for _ in range(nbytes // LOOP_CHUNK):
        s.sendall(chunk)
    s.close()


def _receive(c, mv, nbytes):
    """Read ``nbytes`` (or to EOF) into ``mv`` over and over: the bytes got
    and the seconds from the first byte."""
    got = 0
    t0 = None
    while got < nbytes:
        n = c.recv_into(mv)
        if n == 0:
            break
        if t0 is None:
            t0 = common.perf_counter()
        got += n
    return got, common.perf_counter() - t0


def bare_loop(prod, nbytes, tls=None):
    """Bytes/s of the bare loop: one sender thread (in the producer process)
    ``sendall`` of 1 MiB, one receiver thread (here) ``recv_into`` a 1 MiB
    buffer, over loopback; over Python's ssl (mutual TLS 1.3, our suite)
    when ``tls`` is given."""
    ls = socket.create_server(("127.0.0.1", 0))
    reply = prod.call("loop", ls.getsockname()[1], nbytes, tls is not None)
    c, _ = ls.accept()
    ls.close()
    if tls is not None:
        c = loop_context(tls, True).wrap_socket(c, server_side=True)
        if c.cipher()[0] != LOOP_SUITES.decode():
            raise RuntimeError(f"the bare TLS loop negotiated {c.cipher()[0]}, not {LOOP_SUITES.decode()}")
    mv = memoryview(bytearray(LOOP_CHUNK))
    got, dt = _receive(c, mv, nbytes)
    c.close()
    reply.recv()
    assert got == nbytes, (got, nbytes)
    return got / dt


# --------------------------------------------------------------------------- cases

def raw_stream(prod, nbytes):
    ls = socket.create_server(("127.0.0.1", 0))
    reply = prod.call("raw", ls.getsockname()[1], nbytes)
    c, _ = ls.accept()
    ls.close()
    buf = bytearray(SEG)
    mv = memoryview(buf)
    got, dt = _receive(c, mv, nbytes)
    c.close()
    reply.recv()
    assert got == nbytes
    return got / dt


def _pop_loop(q, notifier, stop=None, on_bytes=None, rate=None):
    """Pop and recycle buffers until end-of-partition (or ``stop``), at most
    ``rate`` bytes/s when given."""
    got = 0
    t0 = None
    while stop is None or not stop.is_set():
        token = notifier.prepare()
        x = q.pop_buffer()
        if x is None:
            notifier.wait(token, 0.1)
            continue
        notifier.cancel()
        if type(x) is tuple:
            break
        if t0 is None:
            t0 = common.perf_counter()
        got += x.size
        x.recycle()
        if on_bytes is not None:
            on_bytes(x.size)
        if rate is not None:
            ahead = got / rate - (common.perf_counter() - t0)
            if ahead > 0.002:
                time.sleep(ahead)
    return got, (common.perf_counter() - t0) if t0 else 0.0


def _destroy(excl, fl):
    for pool in [*excl, fl]:
        if pool is not None:
            pool.destroy()


def remote_stream(prod, nbp, secret, nbytes, tls=None):
    from pyflowbuf._core.channel import BufferQueue, InputGate
    from pyflowbuf.net import ConnectionManager

    pid = prod.pid()
    reply = prod.call("buffers", pid, 0, nbytes // SEG, tls is not None)
    reply.recv()
    with ConnectionManager(secret, tls=tls) as mgr:
        excl, fl = mgr.create_input_pools(nbp, 1)
        q = BufferQueue(nbp)
        gate = InputGate([q])
        mgr.create_channel(prod.tls_address if tls is not None else prod.address, pid, 0, q, excl[0], fl)
        got, dt = _pop_loop(q, gate.notifier)
    _destroy(excl, fl)
    assert got == nbytes
    return got / dt


def remote_records(prod, nbp, secret, n, per_record):
    from pyflowbuf._core.channel import BufferQueue, InputGate
    from pyflowbuf._core.serde import RecordReader
    from pyflowbuf.net import ConnectionManager

    pid = prod.pid()
    prod.call("records", pid, n, per_record).recv()
    with ConnectionManager(secret) as mgr:
        excl, fl = mgr.create_input_pools(nbp, 1)
        q = BufferQueue(nbp)
        gate = InputGate([q])
        mgr.create_channel(prod.address, pid, 0, q, excl[0], fl, kind="int64")
        reader = RecordReader(gate, kind="int64")
        count = 0
        first = reader.read(timeout=30)
        t0 = common.perf_counter()
        count = 1
        if per_record:
            read = reader.read
            while read(10) is not None:
                count += 1
        else:
            while not reader.finished:
                count += len(reader.read_batch(16384, timeout=10))
        dt = common.perf_counter() - t0
    del reader, gate, q
    _destroy(excl, fl)
    assert first == 0 and count == n, (first, count, n)
    return count / dt


def hol(prod, nbp, secret, credit_based, stalled, window, rate):
    """MB/s of channel B while channel A (same connection) is consumed or
    stalled. Both consumers take at most ``rate`` bytes/s, so B's rate measures
    whether A's stall reaches B, not how two channels share the CPU."""
    from pyflowbuf._core.channel import BufferQueue, InputGate
    from pyflowbuf.net import ConnectionManager

    pid = prod.pid()
    prod.call("buffers", pid, 0, None).recv()
    prod.call("buffers", pid, 1, None).recv()
    mgr = ConnectionManager(secret, credit_based=credit_based)
    stop = threading.Event()
    try:
        excl, fl = mgr.create_input_pools(nbp, 2)
        qa, qb = BufferQueue(nbp), BufferQueue(nbp)
        ga, gb = InputGate([qa]), InputGate([qb])
        mgr.create_channel(prod.address, pid, 0, qa, excl[0], fl)
        mgr.create_channel(prod.address, pid, 1, qb, excl[1], fl)
        if not stalled:
            threading.Thread(target=_pop_loop, args=(qa, ga.notifier, stop, None, rate), daemon=True).start()
        counted = [0]
        counting = threading.Event()

        def count(n):
            if counting.is_set():
                counted[0] += n
        tb = threading.Thread(target=_pop_loop, args=(qb, gb.notifier, stop, count, rate), daemon=True)
        tb.start()
        time.sleep(window / 2)           # let A's buffers pile up when it is stalled
        counting.set()
        t0 = common.perf_counter()
        time.sleep(window)
        counting.clear()
        dt = common.perf_counter() - t0
    finally:
        stop.set()
        mgr.close()
    _destroy(excl, fl)
    return counted[0] / dt


def with_cpu(prod, nbytes, fn):
    """``fn`` as a case that also says the CPU time per byte of each
    process: ``send_ns``, the producer's, ``recv_ns``, this one's (the
    receiving thread and the consumer's), all their threads."""
    def case():
        p0, c0 = prod.cpu_s(), _cpu_s()
        rate = fn()
        p1, c1 = prod.cpu_s(), _cpu_s()
        return {"rate": rate, "send_ns": (p1 - p0) / nbytes * 1e9, "recv_ns": (c1 - c0) / nbytes * 1e9}
    return case


def tls_handshake_s(prod, tls):
    """One TLS handshake with the producer's TLS server (connect included)."""
    from pyflowbuf.net.tls import wrap

    t0 = common.perf_counter()
    sock = socket.create_connection(prod.tls_address)
    conn = wrap(sock, tls, server_side=False, peer=prod.tls_address)   # as ConnectionManager does
    conn.handshake(time.monotonic() + 10)
    dt = common.perf_counter() - t0
    conn.close()
    conn.release()
    return dt


def job_records(n, tls):
    """records/s of a per-record pipeline over two worker processes."""
    import pyflowbuf as fb

    env = fb.Environment(workers=2, parallelism=2, tls=tls)
    # a sink that keeps nothing: the measurement is the records' way, not what a sink does
    (env.from_sequence(0, n, parallelism=2).map(lambda x: x + 1, kind="int64", parallelism=2)
        .key_by(lambda x: x % 64).reduce(lambda a, b: a + b, kind="int64", parallelism=2)
        .sink(lambda x: None, parallelism=2))
    t0 = common.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.errors.WorkerSideEffectWarning)
        env.execute(timeout=600)
    return n / (common.perf_counter() - t0)


# --------------------------------------------------------------------------- main

def main(quick: bool = False) -> dict:
    from pyflowbuf._core.memory import NetworkBufferPool
    from pyflowbuf.net import new_secret

    from pyflowbuf.net.tls import JobCertificates

    p = params(quick)
    rep = common.Report("remote", quick, p)
    secret = new_secret()
    tls = JobCertificates("bench").for_attempt(0)
    prod = Producer(secret, tls)
    nbp = NetworkBufferPool(256)
    try:
        nbytes = p["stream_mb"] * 1024 * 1024
        rep.section("throughput: 32 KiB buffers between two processes")
        s = common.interleaved({"remote": lambda: remote_stream(prod, nbp, secret, nbytes),
                                "raw": lambda: raw_stream(prod, nbytes)}, p["repeats"])
        rep.add("remote_mb_per_s", s.median("remote") / 1e6, "MB/s", spread=s.spread("remote"))
        rep.add("raw_socket_mb_per_s", s.median("raw") / 1e6, "MB/s", spread=s.spread("raw"))
        rep.add("remote_vs_raw_socket", s.ratio("remote", "raw"), "x", GOALS["remote_vs_raw_socket"])

        rep.section("mutual TLS 1.3: the same stream over one TLS connection, the bare loops, a per-record job, "
                    "handshakes")
        s = common.interleaved({
            "tls": with_cpu(prod, nbytes, lambda: remote_stream(prod, nbp, secret, nbytes, tls)),
            "plain": with_cpu(prod, nbytes, lambda: remote_stream(prod, nbp, secret, nbytes)),
            "loop_tls": with_cpu(prod, nbytes, lambda: bare_loop(prod, nbytes, tls)),
            "loop_plain": with_cpu(prod, nbytes, lambda: bare_loop(prod, nbytes))}, p["repeats"])
        rep.add("remote_tls_mb_per_s", s.median("tls") / 1e6, "MB/s", spread=s.spread("tls"))
        rep.add("remote_plain_mb_per_s", s.median("plain") / 1e6, "MB/s", spread=s.spread("plain"))
        rep.add("remote_tls_vs_plain", s.ratio("tls", "plain"), "x", GOALS["remote_tls_vs_plain"])
        rep.add("tls_loop_mb_per_s", s.median("loop_tls") / 1e6, "MB/s", spread=s.spread("loop_tls"),
                note=LOOP_SUITES.decode())
        rep.add("plain_loop_mb_per_s", s.median("loop_plain") / 1e6, "MB/s", spread=s.spread("loop_plain"))
        rep.add("tls_loop_vs_plain_loop", s.ratio("loop_tls", "loop_plain"), "x")
        rep.add("remote_tls_vs_tls_loop", s.ratio("tls", "loop_tls"), "x")
        names = {"tls": "remote_tls", "plain": "remote_plain", "loop_tls": "tls_loop", "loop_plain": "plain_loop"}
        for case, name in names.items():
            for side in ("send", "recv"):
                rep.add(f"{name}_{side}_cpu_ns_per_byte", s.median(case, f"{side}_ns"), "ns")
        cpu = {c: s.median(c, "send_ns") + s.median(c, "recv_ns") for c in ("tls", "plain", "loop_tls", "loop_plain")}
        rep.add("remote_tls_cpu_vs_plain", cpu["plain"] / cpu["tls"], "x")
        rep.add("tls_loop_cpu_vs_plain_loop", cpu["loop_plain"] / cpu["loop_tls"], "x")
        s = common.interleaved({"tls": lambda: job_records(p["job_records"], True),
                                "plain": lambda: job_records(p["job_records"], None)}, p["job_repeats"])
        rep.add("job_records_per_s_tls", s.median("tls"), "records/s", spread=s.spread("tls"))
        rep.add("job_records_per_s_plain", s.median("plain"), "records/s", spread=s.spread("plain"))
        rep.add("remote_tls_records_vs_plain", s.ratio("tls", "plain"), "x", GOALS["remote_tls_records_vs_plain"])
        s = common.interleaved({"hs": lambda: tls_handshake_s(prod, tls)}, p["handshakes"], warmup=2)
        rep.add("tls_handshake_ms", s.median("hs") * 1e3, "ms", spread=s.spread("hs"))

        rep.section("12-byte records (int64) between two processes")
        s = common.interleaved({
            "batch": lambda: remote_records(prod, nbp, secret, p["batch_records"], False),
            "per_record": lambda: remote_records(prod, nbp, secret, p["per_record"], True)},
            max(3, p["repeats"] // 2))
        rep.add("remote_records_per_s_12b", s.median("batch"), "records/s", spread=s.spread("batch"))
        rep.add("remote_records_per_s_12b_per_record", s.median("per_record"), "records/s",
                spread=s.spread("per_record"))

        rep.section("head-of-line blocking: two channels on one connection, one consumer stalled")
        w, r = p["hol_window_s"], p["hol_consumer_mb_per_s"] * 1e6
        for mode, credit in (("credit", True), ("tcp", False)):
            s = common.interleaved({
                "healthy": lambda c=credit: hol(prod, nbp, secret, c, False, w, r),
                "stalled": lambda c=credit: hol(prod, nbp, secret, c, True, w, r)}, p["hol_repeats"], warmup=0)
            rep.add(f"hol_{mode}_healthy_mb_per_s", s.median("healthy") / 1e6, "MB/s")
            rep.add(f"hol_{mode}_stalled_mb_per_s", s.median("stalled") / 1e6, "MB/s")
            key = f"hol_{mode}_other_channel_ratio"
            rep.add(key, s.ratio("stalled", "healthy"), "x", GOALS[key])
    finally:
        prod.close()
    return rep.as_dict()


if __name__ == "__main__":
    out = main(quick="--quick" in sys.argv)
    print(json.dumps(common.jsonable(out)))
