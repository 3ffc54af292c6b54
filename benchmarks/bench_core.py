"""Core benchmark: pools, RecordWriter/RecordReader, against peers in the same run.

Every ratio is the median of per-repetition ratios, ours and the peer run
interleaved in each repetition (see ``common.interleaved``). Figures:

bulk (NumPy fixed-width records, ``write_array`` + ``read_array``)
  bulk_vs_memcpy_1k            1 KiB records: bytes/s of write_array (one copy
                               into segments) + read_array (a view per buffer)
                               / bytes/s of ``numpy.copyto`` of the same bytes
  bulk_vs_memcpy_1k_copyout    same, but the consumer copies every view out
                               into its own array (two copies against one)
  bulk_records_per_s_16b       16-byte records/s, one thread
  bulk_records_per_s_16b_threads  16-byte records/s, writer and reader in two
                               threads over an 8-segment pool (backpressure)
per record (Python API, 16-byte ``bytes``, one thread)
  per_record_vs_queue          write()+poll() records/s / queue.Queue(1024) put+get
  per_record_vs_simplequeue    same / queue.SimpleQueue put+get
pool
  pool_ops_per_s_c             request+recycle/s, nogil C loop, one thread
  pool_ops_per_s_c_2threads    the same loop in two threads on one pool
  pool_contended_vs_lock_deque that / a threading.Lock + collections.deque pool
                               driven the same way from two threads
"""
from __future__ import annotations

import collections
import queue
import threading

import numpy as np

import common
from common import Goal, perf_counter, rate
from pyflowbuf._core.channel import BufferQueue
from pyflowbuf._core.memory import NetworkBufferPool, _bench_pool_ops
from pyflowbuf._core.serde import RecordReader, RecordWriter

SEGMENT = 32 * 1024
DT_1K = np.dtype((np.void, 1024))
DT_16 = np.dtype([("key", "<i8"), ("value", "<f8")])
BIG_SEGMENT = 256 * 1024
CHUNK_BYTES = 4 * 1024 * 1024  # one write_array call; the pool holds it whole

GOALS = {
    "bulk_records_per_s_16b": Goal(">=", 100e6, "records/s"),
    "per_record_vs_queue": Goal(">=", 10.0, "x"),
    "per_record_vs_simplequeue": Goal(">=", 0.5, "x"),
    "pool_ops_per_s_c": Goal(">=", 20e6, "ops/s"),
}


def params(quick: bool) -> dict:
    if quick:
        return dict(repeats=5, bulk_rounds=8, bulk16_rounds=8, thread_rounds=16,
                    record_rounds=150, pool_ops=2_000_000, pool_ops_py=150_000)
    return dict(repeats=21, bulk_rounds=16, bulk16_rounds=16, thread_rounds=32,
                record_rounds=300, pool_ops=10_000_000, pool_ops_py=400_000)


# --------------------------------------------------------------------------- workloads
# Small classes so test_bench_core.py drives exactly the same code.


class Pipe:
    """One RecordWriter -> BufferQueue -> RecordReader in one thread, over a
    pool big enough for ``capacity_bytes`` so the writer never blocks."""

    def __init__(self, capacity_bytes: int, segment_size: int = SEGMENT, kind: str = "bytes"):
        nseg = -(-capacity_bytes // segment_size) + 2
        self.net = NetworkBufferPool(nseg, segment_size)
        self.pool = self.net.create_pool(nseg, nseg)
        self.queue = BufferQueue(self.net)
        self.writer = RecordWriter(self.pool, [self.queue], kind=kind)
        self.reader = RecordReader(self.queue, kind=kind)

    # -- bulk
    def bulk_views(self, arr: np.ndarray) -> int:
        """write_array + flush, then read_array views until empty; returns records read."""
        self.writer.write_array(arr)
        self.writer.flush()
        read = self.reader.read_array
        dt = arr.dtype
        n = 0
        while True:
            v = read(dt, 0)
            if v is None:
                return n
            n += len(v)
            del v

    def bulk_copyout(self, arr: np.ndarray, out: np.ndarray) -> int:
        """As bulk_views, but every view is copied into ``out``."""
        self.writer.write_array(arr)
        self.writer.flush()
        read = self.reader.read_array
        dt = arr.dtype
        n = 0
        while True:
            v = read(dt, 0)
            if v is None:
                return n
            k = len(v)
            np.copyto(out[n:n + k], v)
            n += k
            del v

    # -- per record
    def records(self, chunk: list, rng: range) -> None:
        """write() every record of ``chunk``, flush, poll() as many back."""
        write = self.writer.write
        poll = self.reader.poll
        for rec in chunk:
            write(rec)
        self.writer.flush()
        for _ in rng:
            poll()


def bulk_case(pipe: Pipe, src: np.ndarray, rounds: int, copyout: np.ndarray | None = None):
    """A case for common.interleaved: bytes/s, records/s and the write / read split."""
    w = pipe.writer
    read = pipe.reader.read_array
    dt = src.dtype
    nrec = len(src)

    def run():
        t_write = t_read = 0.0
        total = 0
        for _ in range(rounds):
            t0 = perf_counter()
            w.write_array(src)
            w.flush()
            t1 = perf_counter()
            n = 0
            if copyout is None:
                while True:
                    v = read(dt, 0)
                    if v is None:
                        break
                    n += len(v)
                    del v
            else:
                while True:
                    v = read(dt, 0)
                    if v is None:
                        break
                    k = len(v)
                    np.copyto(copyout[n:n + k], v)
                    n += k
                    del v
            t2 = perf_counter()
            if n != nrec:
                raise AssertionError(f"read {n} records, wrote {nrec}")
            total += n
            t_write += t1 - t0
            t_read += t2 - t1
        t = t_write + t_read
        return {"rate": rate(total * dt.itemsize, t), "records_per_s": rate(total, t),
                "write_bytes_per_s": rate(total * dt.itemsize, t_write),
                "read_records_per_s": rate(total, t_read)}

    return run


def memcpy_case(src: np.ndarray, dst: np.ndarray, rounds: int):
    """numpy.copyto of the same bytes into a reused destination (as segments
    are reused). Copied as uint8 views: copyto of a structured dtype goes field
    by field (~10x slower than memcpy) and would flatter us."""
    s8 = src.reshape(-1).view(np.uint8)
    d8 = dst.reshape(-1).view(np.uint8)

    def run():
        t0 = perf_counter()
        for _ in range(rounds):
            np.copyto(d8, s8)
        t = perf_counter() - t0
        return {"rate": rate(rounds * src.nbytes, t), "records_per_s": rate(rounds * len(src), t)}

    return run


def threaded_bulk(chunk: np.ndarray, rounds: int, pool_segments: int = 8,
                  segment_size: int = SEGMENT) -> dict:
    """Writer thread: ``rounds`` x write_array(chunk), then end_input. Reader
    (this thread): read_array until the end. The pool has ``pool_segments``
    segments, far fewer than a chunk, so the writer parks on backpressure."""
    net = NetworkBufferPool(pool_segments, segment_size)
    pool = net.create_pool(pool_segments, pool_segments)
    q = BufferQueue(net)
    writer = RecordWriter(pool, [q])
    reader = RecordReader(q)
    start = threading.Barrier(2)
    failure: list[BaseException] = []

    def produce():
        try:
            start.wait()
            for _ in range(rounds):
                writer.write_array(chunk)
            writer.end_input()
        except BaseException as exc:  # surfaced below
            failure.append(exc)
            q.cancel()

    th = threading.Thread(target=produce, name="bench-writer", daemon=True)
    th.start()
    start.wait()
    t0 = perf_counter()
    read = reader.read_array
    dt = chunk.dtype
    n = 0
    deadline = t0 + 300.0
    while True:
        v = read(dt, 1.0)  # None on timeout, at an event or at the end
        if v is None:
            if reader.finished or failure:
                break
            reader.take_event()
            if perf_counter() > deadline:
                raise TimeoutError("threaded bulk benchmark made no progress")
            continue
        n += len(v)
        del v
    t = perf_counter() - t0
    th.join(10)
    if failure:
        raise failure[0]
    if n != rounds * len(chunk):
        raise AssertionError(f"reader got {n} records, writer wrote {rounds * len(chunk)}")
    return {"rate": rate(n, t), "seconds": t, "backpressure_s": writer.backpressure_ns / 1e9}


def threaded_queue_peer(chunk: np.ndarray, rounds: int, maxsize: int = 8,
                        segment_size: int = SEGMENT) -> dict:
    """The peer of threaded_bulk written in plain Python: the writer thread
    copies segment-sized slices into new arrays and puts them into a
    queue.Queue(maxsize) (the same bound: ``maxsize`` segments in flight); the
    reader (this thread) gets them until a None."""
    per = max(1, segment_size // chunk.dtype.itemsize)
    q: queue.Queue = queue.Queue(maxsize)
    start = threading.Barrier(2)

    def produce():
        start.wait()
        put = q.put
        for _ in range(rounds):
            for i in range(0, len(chunk), per):
                put(chunk[i:i + per].copy())
        put(None)

    th = threading.Thread(target=produce, name="bench-queue-writer", daemon=True)
    th.start()
    start.wait()
    t0 = perf_counter()
    get = q.get
    n = 0
    while True:
        a = get()
        if a is None:
            break
        n += len(a)
        del a
    t = perf_counter() - t0
    th.join(10)
    if n != rounds * len(chunk):
        raise AssertionError(f"queue peer got {n} records, wrote {rounds * len(chunk)}")
    return {"rate": rate(n, t)}


def per_record_case(pipe: Pipe, chunk: list, rounds: int):
    write = pipe.writer.write
    flush = pipe.writer.flush
    poll = pipe.reader.poll
    rng = range(len(chunk))

    def run():
        t_write = t_read = 0.0
        for _ in range(rounds):
            t0 = perf_counter()
            for rec in chunk:
                write(rec)
            flush()
            t1 = perf_counter()
            for _ in rng:
                poll()
            t2 = perf_counter()
            t_write += t1 - t0
            t_read += t2 - t1
        n = rounds * len(chunk)
        return {"rate": rate(n, t_write + t_read), "write_per_s": rate(n, t_write), "read_per_s": rate(n, t_read)}

    return run


def queue_case(q, chunk: list, rounds: int):
    put = q.put
    get = q.get
    rng = range(len(chunk))

    def run():
        t0 = perf_counter()
        for _ in range(rounds):
            for rec in chunk:
                put(rec)
            for _ in rng:
                get()
        return {"rate": rate(rounds * len(chunk), perf_counter() - t0)}

    return run


def c_pool_two_threads(pool, n: int, pool2=None) -> dict:
    """Two Python threads run _bench_pool_ops(pool, n) at once (the loop
    releases the GIL); total ops/s over the wall time of both. With ``pool2``
    the second thread uses that pool (same arena, own LocalBufferPool)."""
    start = threading.Barrier(3)
    errors: list[BaseException] = []
    spans: list[tuple[float, float]] = []

    def work(p):
        try:
            start.wait()
            t0 = perf_counter()
            _bench_pool_ops(p, n)
            spans.append((t0, perf_counter()))
        except BaseException as exc:
            errors.append(exc)

    ths = [threading.Thread(target=work, args=(p,)) for p in (pool, pool2 if pool2 is not None else pool)]
    for th in ths:
        th.start()
    start.wait()
    t0 = perf_counter()
    for th in ths:
        th.join()
    t = perf_counter() - t0
    if errors:
        raise errors[0]
    (a0, a1), (b0, b1) = spans
    # Fraction of the wall time both threads were inside the loop: on a busy
    # 2-core machine they may have run one after the other (no contention).
    overlap = max(0.0, min(a1, b1) - max(a0, b0)) / (max(a1, b1) - min(a0, b0))
    return {"rate": rate(2 * n, t), "overlap": overlap}


class LockDequePool:
    """The pure-Python peer: a free list in a deque behind a threading.Lock."""

    def __init__(self, num_segments: int):
        self.lock = threading.Lock()
        self.free = collections.deque(range(num_segments))

    def ops(self, n: int) -> None:
        """request+recycle ``n`` times, each taking the lock (inlined: the
        fastest way to write it in Python)."""
        lock = self.lock
        popleft = self.free.popleft
        append = self.free.append
        for _ in range(n):
            with lock:
                seg = popleft()
            with lock:
                append(seg)


def py_pool_threads(pool: LockDequePool, n: int, threads: int = 2) -> float:
    start = threading.Barrier(threads + 1)

    def work():
        start.wait()
        pool.ops(n)

    ths = [threading.Thread(target=work) for _ in range(threads)]
    for th in ths:
        th.start()
    start.wait()
    t0 = perf_counter()
    for th in ths:
        th.join()
    return rate(threads * n, perf_counter() - t0)


def make_records(n: int = 1024, size: int = 16) -> list[bytes]:
    return [i.to_bytes(8, "little") * (size // 8) for i in range(n)]


def make_16b(n: int) -> np.ndarray:
    a = np.empty(n, DT_16)
    a["key"] = np.arange(n)
    a["value"] = np.arange(n) * 0.5
    return a


def make_1k(n: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, n * DT_1K.itemsize, dtype=np.uint8).view(DT_1K)


# --------------------------------------------------------------------------- checks


def _verify(pipe: Pipe, src: np.ndarray) -> None:
    """Round-trip correctness once, outside the timed loops."""
    out = np.empty_like(src)
    if pipe.bulk_copyout(src, out) != len(src) or out.tobytes() != src.tobytes():
        raise AssertionError("bulk round trip corrupted data")


def _verify_records(pipe: Pipe, chunk: list) -> None:
    for rec in chunk:
        pipe.writer.write(rec)
    pipe.writer.flush()
    got = [pipe.reader.poll() for _ in chunk]
    if got != chunk or pipe.reader.poll() is not None:
        raise AssertionError("per-record round trip corrupted data")


# --------------------------------------------------------------------------- main


def main(quick: bool = False) -> dict:
    p = params(quick)
    reps = p["repeats"]
    rep = common.Report("core", quick, params={
        **p, "segment_size": SEGMENT, "chunk_bytes": CHUNK_BYTES,
        "dtype_16b": str(DT_16), "per_record_chunk": 1024, "thread_pool_segments": 8})

    # ---------------------------------------------------------------- bulk 1 KiB
    rep.section("bulk 1 KiB records: write_array + read_array vs numpy.copyto (4 MiB per call)")
    src = make_1k(CHUNK_BYTES // DT_1K.itemsize)
    pipe = Pipe(CHUNK_BYTES)
    _verify(pipe, src)
    dst = np.empty_like(src)
    out = np.empty_like(src)
    big = Pipe(CHUNK_BYTES, segment_size=BIG_SEGMENT)
    _verify(big, src)
    with common.progress("bulk 1 KiB", reps) as adv:
        s = common.interleaved({
            "views": bulk_case(pipe, src, p["bulk_rounds"]),
            "copyout": bulk_case(pipe, src, p["bulk_rounds"], copyout=out),
            "memcpy": memcpy_case(src, dst, p["bulk_rounds"]),
            "views_big": bulk_case(big, src, p["bulk_rounds"]),
        }, reps, advance=adv)
    rep.add("bulk_bytes_per_s_1k", s.median("views"), "B/s", spread=s.spread("views"))
    rep.add("bulk_bytes_per_s_1k_copyout", s.median("copyout"), "B/s", spread=s.spread("copyout"))
    rep.add("memcpy_bytes_per_s_1k", s.median("memcpy"), "B/s", spread=s.spread("memcpy"),
            note="numpy.copyto, 4 MiB into a reused array")
    rep.add("bulk_1k_write_bytes_per_s", s.median("views", "write_bytes_per_s"), "B/s",
            note="write_array+flush alone")
    rep.add("bulk_1k_read_records_per_s", s.median("views", "read_records_per_s"), "records/s",
            note="read_array views alone")
    rep.add("bulk_vs_memcpy_1k", s.ratio("views", "memcpy"), "x",
            note="limit ~1: write_array is one memcpy, reading is zero-copy")
    rep.add("bulk_vs_memcpy_1k_copyout", s.ratio("copyout", "memcpy"), "x",
            note="limit ~0.5: two copies against one")
    rep.add("bulk_vs_memcpy_1k_seg256k", s.ratio("views_big", "memcpy"), "x",
            note="same with 256 KiB segments: per-buffer cost amortized 8x more")
    del pipe, big

    # ---------------------------------------------------------------- bulk 16 B
    rep.section("bulk 16-byte records (int64 key, float64 value)")
    src16 = make_16b(CHUNK_BYTES // DT_16.itemsize)
    pipe = Pipe(CHUNK_BYTES)
    _verify(pipe, src16)
    dst16 = np.empty_like(src16)
    with common.progress("bulk 16 B", reps) as adv:
        s = common.interleaved({
            "views": bulk_case(pipe, src16, p["bulk16_rounds"]),
            "memcpy": memcpy_case(src16, dst16, p["bulk16_rounds"]),
        }, reps, advance=adv)
    rep.add("bulk_records_per_s_16b", s.median("views", "records_per_s"), "records/s",
            goal=GOALS["bulk_records_per_s_16b"], spread=s.spread("views"))
    rep.add("memcpy_records_per_s_16b", s.median("memcpy", "records_per_s"), "records/s",
            note="numpy.copyto of the same records")
    rep.add("bulk_vs_memcpy_16b", s.ratio("views", "memcpy"), "x")
    del pipe

    with common.progress("bulk 16 B, 2 threads", reps) as adv:
        chunk16 = src16[: 64 * 1024]  # 1 MiB per write_array call
        s = common.interleaved({
            "threads": lambda: threaded_bulk(chunk16, p["thread_rounds"], pool_segments=8),
            "queue": lambda: threaded_queue_peer(chunk16, p["thread_rounds"], maxsize=8),
        }, reps, advance=adv)
    rep.add("bulk_records_per_s_16b_threads", s.median("threads"), "records/s", spread=s.spread("threads"),
            note="writer + reader threads, 8-segment pool")
    rep.add("queue_of_arrays_records_per_s_16b_threads", s.median("queue"), "records/s",
            spread=s.spread("queue"), note="peer: 32 KiB array copies through queue.Queue(8)")
    rep.add("bulk_16b_threads_vs_queue_of_arrays", s.ratio("threads", "queue"), "x")
    rep.add("bulk_16b_threads_vs_one_thread", rep.figures["bulk_records_per_s_16b_threads"]
            / rep.figures["bulk_records_per_s_16b"], "x", note="not paired: two-thread cost incl. scheduling")

    # ---------------------------------------------------------------- per record
    rep.section("per-record Python API, 16-byte bytes, one thread, 1024 records per flush")
    chunk = make_records(1024, 16)
    pipe = Pipe(64 * 1024)
    _verify_records(pipe, chunk)
    rounds = p["record_rounds"]
    with common.progress("per record", reps) as adv:
        s = common.interleaved({
            "pyflowbuf": per_record_case(pipe, chunk, rounds),
            "queue": queue_case(queue.Queue(maxsize=1024), chunk, rounds),
            "simplequeue": queue_case(queue.SimpleQueue(), chunk, rounds),
        }, reps, advance=adv)
    rep.add("per_record_records_per_s", s.median("pyflowbuf"), "records/s", spread=s.spread("pyflowbuf"),
            note="write()+poll()")
    rep.add("per_record_write_per_s", s.median("pyflowbuf", "write_per_s"), "records/s", note="write() alone")
    rep.add("per_record_read_per_s", s.median("pyflowbuf", "read_per_s"), "records/s", note="poll() alone")
    rep.add("queue_records_per_s", s.median("queue"), "records/s", spread=s.spread("queue"),
            note="queue.Queue(maxsize=1024) put+get")
    rep.add("simplequeue_records_per_s", s.median("simplequeue"), "records/s",
            spread=s.spread("simplequeue"), note="queue.SimpleQueue put+get")
    rep.add("per_record_vs_queue", s.ratio("pyflowbuf", "queue"), "x", goal=GOALS["per_record_vs_queue"])
    rep.add("per_record_vs_simplequeue", s.ratio("pyflowbuf", "simplequeue"), "x",
            goal=GOALS["per_record_vs_simplequeue"])
    del pipe

    # ---------------------------------------------------------------- pool
    rep.section("pool request+recycle")
    net = NetworkBufferPool(64, SEGMENT)
    cpool = net.create_pool(8, 32)
    cpool2 = net.create_pool(8, 32)
    pypool = LockDequePool(64)
    n_c, n_py = p["pool_ops"], p["pool_ops_py"]
    with common.progress("pool ops", reps) as adv:
        s = common.interleaved({
            "c": lambda: rate(n_c, _bench_pool_ops(cpool, n_c)),
            "c2": lambda: c_pool_two_threads(cpool, n_c // 2),
            "c2pools": lambda: c_pool_two_threads(cpool, n_c // 2, cpool2),
            "py1": lambda: py_pool_threads(pypool, n_py, threads=1),
            "py2": lambda: py_pool_threads(pypool, n_py // 2, threads=2),
        }, reps, advance=adv)
    rep.add("pool_ops_per_s_c", s.median("c"), "ops/s", goal=GOALS["pool_ops_per_s_c"], spread=s.spread("c"),
            note="nogil C loop, one thread")
    rep.add("pool_ops_per_s_c_2threads", s.median("c2"), "ops/s", spread=s.spread("c2"),
            note="two threads, same pool, total")
    rep.add("pool_2threads_overlap", s.median("c2", "overlap"), "",
            note="fraction of the time both threads were in the loop (1 = fully concurrent)")
    rep.add("pool_ops_per_s_c_2pools", s.median("c2pools"), "ops/s", spread=s.spread("c2pools"),
            note="two threads, own LocalBufferPool each, one arena")
    rep.add("pool_ops_per_s_lock_deque", s.median("py1"), "ops/s", note="Lock+deque, one thread")
    rep.add("pool_ops_per_s_lock_deque_2threads", s.median("py2"), "ops/s", spread=s.spread("py2"),
            note="Lock+deque, two threads, total")
    rep.add("pool_contended_vs_lock_deque", s.ratio("c2", "py2"), "x")
    rep.add("pool_2threads_vs_1thread_c", s.ratio("c2", "c"), "x", note="contention cost (1.0 = none)")

    end = common.machine_info()
    rep.machine["loadavg_1m_end"] = end.get("loadavg_1m")
    rep.machine["cpu_busy_percent_end"] = end.get("cpu_busy_percent")
    return rep.as_dict()


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
