"""pytest-benchmark versions of the core benchmark's operations, each next to
its peer in the same group (bench_core.py holds the workloads).

    pytest benchmarks/test_bench_core.py --benchmark-only
    pytest benchmarks/test_bench_core.py --benchmark-only --benchmark-group-by=group

``benchmarks/`` is outside the test suite's testpaths, so a plain ``pytest``
does not run these. Compare rows within a group only; the machine is noisy.
"""
from __future__ import annotations

import queue

import numpy as np
import pytest

import bench_core as bc
from pyflowbuf._core.memory import NetworkBufferPool, _bench_pool_ops

CHUNK = bc.CHUNK_BYTES  # 4 MiB per write_array call


@pytest.fixture(scope="module")
def src_1k():
    return bc.make_1k(CHUNK // bc.DT_1K.itemsize)


@pytest.fixture(scope="module")
def src_16b():
    return bc.make_16b(CHUNK // bc.DT_16.itemsize)


@pytest.fixture
def pipe():
    return bc.Pipe(CHUNK)


# ---------------------------------------------------------------- bulk 1 KiB


@pytest.mark.benchmark(group="bulk-1k (4 MiB)")
def test_bulk_1k_views(benchmark, pipe, src_1k):
    n = benchmark(pipe.bulk_views, src_1k)
    assert n == len(src_1k)


@pytest.mark.benchmark(group="bulk-1k (4 MiB)")
def test_bulk_1k_copyout(benchmark, pipe, src_1k):
    out = np.empty_like(src_1k)
    n = benchmark(pipe.bulk_copyout, src_1k, out)
    assert n == len(src_1k)
    assert out.tobytes() == src_1k.tobytes()


@pytest.mark.benchmark(group="bulk-1k (4 MiB)")
def test_bulk_1k_peer_memcpy(benchmark, src_1k):
    dst = np.empty_like(src_1k)
    benchmark(bc.memcpy_case(src_1k, dst, 1))
    assert dst.tobytes() == src_1k.tobytes()


# ---------------------------------------------------------------- bulk 16 B


@pytest.mark.benchmark(group="bulk-16b (4 MiB)")
def test_bulk_16b_views(benchmark, pipe, src_16b):
    n = benchmark(pipe.bulk_views, src_16b)
    assert n == len(src_16b)


@pytest.mark.benchmark(group="bulk-16b (4 MiB)")
def test_bulk_16b_peer_memcpy(benchmark, src_16b):
    dst = np.empty_like(src_16b)
    benchmark(bc.memcpy_case(src_16b, dst, 1))
    assert dst.tobytes() == src_16b.tobytes()


@pytest.mark.benchmark(group="bulk-16b 2 threads (8 MiB, 8 segments in flight)")
def test_bulk_16b_threads(benchmark, src_16b):
    chunk = src_16b[: 64 * 1024]
    out = benchmark.pedantic(bc.threaded_bulk, args=(chunk, 8), kwargs={"pool_segments": 8},
                             rounds=5, warmup_rounds=1)
    assert out["rate"] > 0


@pytest.mark.benchmark(group="bulk-16b 2 threads (8 MiB, 8 segments in flight)")
def test_bulk_16b_threads_peer_queue(benchmark, src_16b):
    chunk = src_16b[: 64 * 1024]
    out = benchmark.pedantic(bc.threaded_queue_peer, args=(chunk, 8), kwargs={"maxsize": 8},
                             rounds=5, warmup_rounds=1)
    assert out["rate"] > 0


# ---------------------------------------------------------------- per record


@pytest.fixture(scope="module")
def records():
    return bc.make_records(1024, 16)


@pytest.mark.benchmark(group="per-record (1024 x 16 B write+read)")
def test_per_record_pyflowbuf(benchmark, records):
    p = bc.Pipe(64 * 1024)
    bc._verify_records(p, records)
    benchmark(p.records, records, range(len(records)))


@pytest.mark.benchmark(group="per-record (1024 x 16 B write+read)")
def test_per_record_peer_queue(benchmark, records):
    benchmark(bc.queue_case(queue.Queue(maxsize=1024), records, 1))


@pytest.mark.benchmark(group="per-record (1024 x 16 B write+read)")
def test_per_record_peer_simplequeue(benchmark, records):
    benchmark(bc.queue_case(queue.SimpleQueue(), records, 1))


# ---------------------------------------------------------------- pool


POOL_OPS = 100_000


@pytest.fixture
def cpool():
    net = NetworkBufferPool(64, bc.SEGMENT)
    pool = net.create_pool(8, 32)
    yield pool
    assert pool.in_use == 0


@pytest.mark.benchmark(group="pool (100k request+recycle)")
def test_pool_ops_c(benchmark, cpool):
    benchmark(_bench_pool_ops, cpool, POOL_OPS)


@pytest.mark.benchmark(group="pool (100k request+recycle)")
def test_pool_ops_c_2threads(benchmark, cpool):
    benchmark(bc.c_pool_two_threads, cpool, POOL_OPS // 2)


@pytest.mark.benchmark(group="pool (100k request+recycle)")
def test_pool_ops_peer_lock_deque(benchmark):
    benchmark(bc.LockDequePool(64).ops, POOL_OPS)


@pytest.mark.benchmark(group="pool (100k request+recycle)")
def test_pool_ops_peer_lock_deque_2threads(benchmark):
    benchmark(bc.py_pool_threads, bc.LockDequePool(64), POOL_OPS // 2, 2)
