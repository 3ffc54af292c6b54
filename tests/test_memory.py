"""NetworkBufferPool, LocalBufferPool, Buffer and Notifier (pyflowbuf._core.memory)."""
import gc
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pyflowbuf import errors
from pyflowbuf._core.memory import Buffer, LocalBufferPool, NetworkBufferPool, Notifier
from pyflowbuf._core.memory import _bench_pool_ops

from reference_model import RefNetworkPool
from strategies import pool_shapes, segment_sizes


def held_segments(buffers):
    return sorted(b.segment_index for b in buffers)


# ----------------------------------------------------------------- NetworkBufferPool


@given(segment_sizes, st.integers(1, 64))
def test_arena_shape(segment_size, n):
    nbp = NetworkBufferPool(n, segment_size)
    assert nbp.total_segments == n
    assert nbp.segment_size == segment_size
    assert nbp.total_bytes == n * segment_size
    assert nbp.available_segments == n
    assert nbp.unreserved_segments == n
    assert nbp.in_use_segments == 0
    assert nbp.live_pools == 0
    assert repr(nbp) == f"NetworkBufferPool(total={n}, segment_size={segment_size}, available={n})"


def test_default_segment_size_is_32k():
    assert NetworkBufferPool(1).segment_size == 32 * 1024


def test_segments_are_disjoint_slices_of_one_arena():
    nbp = NetworkBufferPool(8, 256)
    pool = nbp.create_pool(8, 8)
    bufs = [pool.request() for _ in range(8)]
    assert held_segments(bufs) == list(range(8))
    for i, b in enumerate(bufs):
        assert b.capacity == 256 and b.size == 0 and len(b) == 0
        mem = b.memory()
        assert len(mem) == 256 and not mem.readonly
        mem[:] = bytes([i]) * 256
        del mem
    for i, b in enumerate(bufs):
        b.set_meta(256)
        assert bytes(memoryview(b)) == bytes([i]) * 256  # no segment overlaps another
    for b in bufs:
        b.recycle()
    assert nbp.available_segments == 8


# ----------------------------------------------------------------- LocalBufferPool


def test_create_pool_reserves_min():
    nbp = NetworkBufferPool(10, 256)
    pool = nbp.create_pool(3, 5)
    assert (pool.min_size, pool.max_size, pool.in_use) == (3, 5, 0)
    assert nbp.unreserved_segments == 7
    assert nbp.available_segments == 10
    assert nbp.live_pools == 1
    assert pool.segment_size == 256
    assert pool.available is True
    assert pool.usage == 0.0
    assert not pool.destroyed
    assert repr(pool) == "LocalBufferPool(in_use=0, min=3, max=5)"
    assert pool.network_pool is nbp


def test_request_up_to_max_then_none():
    nbp = NetworkBufferPool(10, 256)
    pool = nbp.create_pool(2, 4)
    bufs = [pool.request() for _ in range(4)]
    assert all(isinstance(b, Buffer) for b in bufs)
    assert len(set(b.segment_index for b in bufs)) == 4
    assert pool.in_use == 4 and pool.usage == 1.0
    assert pool.available is False
    assert pool.request() is None
    assert pool.in_use == 4
    # two beyond the minimum came out of the unreserved tokens
    assert nbp.unreserved_segments == 10 - 2 - 2
    assert nbp.available_segments == 6
    bufs.pop().recycle()
    assert pool.in_use == 3 and nbp.unreserved_segments == 7
    bufs.pop().recycle()
    assert pool.in_use == 2 and nbp.unreserved_segments == 8  # back to the minimum: no token returned twice
    bufs.pop().recycle()
    assert pool.in_use == 1 and nbp.unreserved_segments == 8
    assert pool.requested_total == 4


def test_min_is_guaranteed_even_when_others_took_everything():
    nbp = NetworkBufferPool(6, 256)
    a = nbp.create_pool(2, 6)
    b = nbp.create_pool(0, 6)
    taken = []
    while (buf := b.request()) is not None:
        taken.append(buf)
    assert len(taken) == 4  # everything but a's guarantee
    assert nbp.unreserved_segments == 0
    assert a.available is True
    got = [a.request(), a.request()]
    assert all(g is not None for g in got)
    assert a.request() is None  # beyond its min, a competes for tokens: none left
    assert a.available is False
    taken.pop().recycle()
    third = a.request()
    assert third is not None and a.in_use == 3
    assert b.request() is None


def test_insufficient_buffers_for_min():
    nbp = NetworkBufferPool(4, 256)
    first = nbp.create_pool(3, 3)
    with pytest.raises(errors.InsufficientBuffersError, match=r"required 2, but only 1 of 4") as ei:
        nbp.create_pool(2, 2)
    assert isinstance(ei.value, MemoryError)
    assert nbp.unreserved_segments == 1
    assert nbp.live_pools == 1
    second = nbp.create_pool(1, 1)
    assert nbp.unreserved_segments == 0 and nbp.live_pools == 2
    assert first.min_size + second.min_size == 4


@given(pool_shapes())
def test_single_pool_grants_min_of_max_and_total(shape):
    total, mn, mx = shape
    nbp = NetworkBufferPool(total, 256)
    if mn > total:
        with pytest.raises(errors.InsufficientBuffersError):
            nbp.create_pool(mn, mx)
        assert nbp.unreserved_segments == total
        return
    pool = nbp.create_pool(mn, mx)
    bufs = []
    while (b := pool.request()) is not None:
        bufs.append(b)
        assert pool.in_use <= mx
    assert len(bufs) == min(mx, total)
    assert len(set(b.segment_index for b in bufs)) == len(bufs)
    assert nbp.available_segments == total - len(bufs)
    for b in bufs:
        b.recycle()
    assert nbp.available_segments == total
    assert nbp.unreserved_segments == total - mn
    pool.destroy()
    assert nbp.unreserved_segments == total


def test_destroy_returns_reservation_now_and_in_use_segments_on_recycle():
    nbp = NetworkBufferPool(10, 256)
    pool = nbp.create_pool(4, 8)
    held = [pool.request() for _ in range(2)]
    assert nbp.unreserved_segments == 6
    pool.destroy()
    assert pool.destroyed
    assert nbp.live_pools == 0
    assert nbp.unreserved_segments == 8  # the two unused guaranteed segments
    assert nbp.available_segments == 8
    assert (pool.in_use, pool.min_size, pool.max_size, pool.usage, pool.available) == (0, 0, 0, 0.0, False)
    assert repr(pool) == "LocalBufferPool(destroyed)"
    with pytest.raises(errors.PoolDestroyedError):
        pool.request()
    with pytest.raises(errors.PoolDestroyedError):
        pool.request_blocking(0)
    with pytest.raises(errors.PoolDestroyedError):
        pool.set_size(1, 2)
    pool.destroy()  # idempotent
    # the buffers handed out are still good and come home one by one
    held[0].write(b"still mine")
    assert bytes(memoryview(held[0])) == b"still mine"
    held.pop().recycle()
    assert nbp.available_segments == 9 and nbp.unreserved_segments == 9
    held.pop().recycle()
    assert nbp.available_segments == 10 and nbp.unreserved_segments == 10


def test_dropped_pool_is_destroyed():
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(3, 4)
    b = pool.request()
    assert nbp.unreserved_segments == 1
    del pool
    gc.collect()
    assert nbp.live_pools == 0
    assert nbp.unreserved_segments == 3
    b.recycle()
    assert nbp.unreserved_segments == 4 and nbp.available_segments == 4


def test_arena_outlives_its_owner_while_buffers_live():
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(1, 2)
    b = pool.request()
    b.write(b"abc")
    del nbp, pool
    gc.collect()
    assert bytes(memoryview(b)) == b"abc"
    b.recycle()


def test_set_size_raises_and_lowers_min():
    nbp = NetworkBufferPool(10, 256)
    pool = nbp.create_pool(2, 4)
    pool.set_size(6, 8)
    assert (pool.min_size, pool.max_size) == (6, 8)
    assert nbp.unreserved_segments == 4
    pool.set_size(min_size=1)
    assert (pool.min_size, pool.max_size) == (1, 8)
    assert nbp.unreserved_segments == 9
    pool.set_size(max_size=3)
    assert (pool.min_size, pool.max_size) == (1, 3)
    held = [pool.request() for _ in range(3)]
    assert nbp.unreserved_segments == 7
    # raising min below what is in use takes no extra tokens
    pool.set_size(3, 3)
    assert nbp.unreserved_segments == 7
    pool.set_size(0, 3)
    assert nbp.unreserved_segments == 7
    for b in held:
        b.recycle()
    assert nbp.unreserved_segments == 10


def test_set_size_lower_cap_below_in_use_takes_effect_as_buffers_return():
    nbp = NetworkBufferPool(8, 256)
    pool = nbp.create_pool(0, 6)
    held = [pool.request() for _ in range(5)]
    pool.set_size(0, 2)
    assert pool.in_use == 5 and pool.max_size == 2
    assert pool.request() is None
    for _ in range(3):
        held.pop().recycle()
        assert pool.request() is None
    held.pop().recycle()
    assert pool.in_use == 1
    held.append(pool.request())
    assert pool.in_use == 2 and pool.request() is None


def test_set_size_failure_leaves_pool_unchanged():
    nbp = NetworkBufferPool(8, 256)
    pool = nbp.create_pool(2, 4)
    with pytest.raises(errors.InsufficientBuffersError, match="min_size=100"):
        pool.set_size(100, 200)
    assert (pool.min_size, pool.max_size) == (2, 4)
    assert nbp.unreserved_segments == 6
    bufs = [pool.request() for _ in range(4)]
    assert pool.request() is None  # still capped at 4
    for b in bufs:
        b.recycle()


def test_set_size_validation():
    nbp = NetworkBufferPool(8, 256)
    pool = nbp.create_pool(2, 4)
    with pytest.raises(ValueError, match=r"min_size \(5\) must be <= max_size \(4\)"):
        pool.set_size(min_size=5)
    with pytest.raises(ValueError, match="max_size must be >= 1, got 0"):
        pool.set_size(0, 0)
    with pytest.raises(ValueError, match="min_size must be >= 0, got -1"):
        pool.set_size(-1, 4)
    with pytest.raises(TypeError, match="max_size must be an int"):
        pool.set_size(1, 2.0)
    assert (pool.min_size, pool.max_size) == (2, 4)
    assert nbp.unreserved_segments == 6


# ----------------------------------------------------------------- Buffer


def test_buffer_write_and_meta():
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(1, 1)
    b = pool.request()
    assert (b.size, b.capacity, b.data_type, b.width, b.flags, b.views, b.recycled) == (
        0, 256, "records", 0, 0, 0, False)
    assert b.write(b"x" * 100) == 100
    assert b.write(bytearray(b"y" * 200)) == 156  # only what fits
    assert b.size == 256 and len(b) == 256
    assert b.write(b"z") == 0
    assert bytes(memoryview(b)) == b"x" * 100 + b"y" * 156
    b.set_meta(10, "fixed", width=5, flags=3)
    assert (b.size, b.data_type, b.width, b.flags) == (10, "fixed", 5, 3)
    assert bytes(memoryview(b)) == b"x" * 10
    with pytest.raises(ValueError, match="size must be in 0..256, got 257"):
        b.set_meta(257)
    with pytest.raises(ValueError, match="data_type must be one of"):
        b.set_meta(1, "nonsense")
    assert repr(b) == f"Buffer(segment={b.segment_index}, size=10, type=fixed, live)"
    b.recycle()
    assert b.recycled
    assert repr(b) == f"Buffer(segment={b.segment_index}, size=10, type=fixed, recycled)"


def test_buffer_recycle_exactly_once():
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 2)
    b = pool.request()
    b.recycle()
    assert pool.in_use == 0 and nbp.available_segments == 2
    with pytest.raises(errors.BufferRecycledError, match="double release"):
        b.recycle()
    with pytest.raises(errors.BufferRecycledError):
        b.release()
    assert pool.in_use == 0 and nbp.available_segments == 2  # nothing returned twice
    for use in (lambda: b.write(b"x"), b.memory, lambda: b.set_meta(0), lambda: memoryview(b)):
        with pytest.raises(errors.BufferRecycledError):
            use()


def test_buffer_cannot_recycle_with_live_view():
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 2)
    b = pool.request()
    b.write(b"hello")
    mv = memoryview(b)
    mem = b.memory()
    assert b.views == 2
    with pytest.raises(BufferError, match="2 live view"):
        b.recycle()
    assert not b.recycled and pool.in_use == 1
    mv.release()
    with pytest.raises(BufferError, match="1 live view"):
        b.recycle()
    del mem
    assert b.views == 0
    b.recycle()
    assert pool.in_use == 0


def test_release_defers_until_views_are_gone():
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 2)
    b = pool.request()
    b.write(b"keep me")
    seg = b.segment_index
    mv = memoryview(b)
    b.release()
    assert not b.recycled
    assert repr(b).endswith("release-pending)")
    assert pool.in_use == 1 and nbp.available_segments == 1
    # nobody else can get that segment while the view lives
    other = pool.request()
    assert other.segment_index != seg
    other.recycle()
    assert bytes(mv) == b"keep me"
    with pytest.raises(errors.BufferRecycledError):
        b.write(b"x")
    with pytest.raises(errors.BufferRecycledError, match="already"):
        b.release()  # releasing twice is a double release, view or not
    assert not b.recycled
    mv.release()
    assert b.recycled
    assert pool.in_use == 0 and nbp.available_segments == 2


def test_dropped_buffer_is_recycled():
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 2)
    pool.request()  # dropped at once
    assert pool.in_use == 0
    b = pool.request()
    mv = memoryview(b)
    del b
    assert pool.in_use == 1  # the view keeps it
    del mv
    gc.collect()
    assert pool.in_use == 0 and nbp.available_segments == 2


def test_objects_are_not_user_constructible():
    with pytest.raises(TypeError, match="create_pool"):
        LocalBufferPool()
    with pytest.raises(TypeError, match="Buffers come from"):
        Buffer()


# ----------------------------------------------------------------- blocking requests


def test_request_blocking_returns_at_once_when_available():
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(1, 2)
    b = pool.request_blocking(0)
    assert isinstance(b, Buffer) and pool.in_use == 1
    b2 = pool.request_blocking(None)
    assert pool.in_use == 2
    b.recycle(), b2.recycle()


@pytest.mark.timeout(30)
def test_blocking_request_times_out_without_spinning():
    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(1, 1)
    held = pool.request()
    cpu0, t0 = time.process_time(), time.monotonic()
    with pytest.raises(errors.BufferRequestTimeout, match="no buffer within 0.5 s") as ei:
        pool.request_blocking(0.5)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert isinstance(ei.value, TimeoutError)
    assert 0.45 <= wall < 3.0
    assert cpu < 0.15, f"a parked request burned {cpu:.3f} s of CPU in {wall:.3f} s"
    with pytest.raises(errors.BufferRequestTimeout):
        pool.request_blocking(0)
    assert pool.in_use == 1
    held.recycle()


def test_request_blocking_rejects_negative_timeout():
    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(0, 1)
    with pytest.raises(ValueError, match="timeout must be >= 0 or None, got -1"):
        pool.request_blocking(-1)


@pytest.mark.timeout(30)
def test_blocked_request_wakes_on_recycle(threads):
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 1)
    held = pool.request()
    t = threads.start(pool.request_blocking, 10)
    time.sleep(0.2)
    assert t.is_alive()
    cpu0 = time.process_time()
    time.sleep(0.3)
    assert time.process_time() - cpu0 < 0.1  # the waiter is parked
    held.recycle()
    threads.join(5)
    got = t.result["value"]
    assert isinstance(got, Buffer) and pool.in_use == 1
    got.recycle()


@pytest.mark.timeout(30)
def test_blocked_request_wakes_when_another_pool_frees_a_token(threads):
    nbp = NetworkBufferPool(2, 256)
    a = nbp.create_pool(0, 2)
    b = nbp.create_pool(0, 2)
    held = [a.request(), a.request()]
    t = threads.start(b.request_blocking, 10)
    time.sleep(0.2)
    assert t.is_alive()
    held.pop().recycle()
    threads.join(5)
    assert b.in_use == 1 and a.in_use == 1
    t.result["value"].recycle()
    held.pop().recycle()
    assert nbp.available_segments == 2


@pytest.mark.timeout(30)
def test_blocked_request_wakes_on_raised_cap(threads):
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(0, 1)
    held = pool.request()
    t = threads.start(pool.request_blocking, 10)
    time.sleep(0.2)
    assert t.is_alive()
    pool.set_size(max_size=2)
    threads.join(5)
    assert pool.in_use == 2
    t.result["value"].recycle()
    held.recycle()


@pytest.mark.timeout(30)
def test_cancel_waiters_raises_cancelled(threads):
    nbp = NetworkBufferPool(1, 256)
    pool = nbp.create_pool(1, 1)
    held = pool.request()
    waiters = [threads.start(pool.request_blocking, None) for _ in range(2)]
    time.sleep(0.2)
    assert all(t.is_alive() for t in waiters)
    t0 = time.monotonic()
    pool.cancel_waiters()
    for t in waiters:
        t.join(5)
    assert time.monotonic() - t0 < 2
    for t in waiters:
        assert isinstance(t.result.get("error"), errors.CancelledError)
    assert pool.in_use == 1
    # cancellation is sticky until reset; a free segment is still handed out
    with pytest.raises(errors.CancelledError):
        pool.request_blocking(1)
    held.recycle()
    pool.request_blocking(1).recycle()


# ----------------------------------------------------------------- Notifier


@pytest.mark.timeout(30)
def test_notifier_hears_recycles_of_its_pool(threads):
    note = Notifier()
    nbp = NetworkBufferPool(2, 256)
    pool = nbp.create_pool(0, 1, notifier=note)
    held = pool.request()
    token = note.prepare()
    assert note.waiters == 1
    t = threads.start(note.wait, token, 10)
    time.sleep(0.1)
    assert t.is_alive()
    held.recycle()
    threads.join(5)
    assert t.result["value"] is True
    assert note.waiters == 0


def test_destroyed_pool_no_longer_notifies_its_notifier():
    """The task that owned the pool (and its Notifier) may be gone while its
    buffers are still downstream; their recycle must not touch the Notifier
    (with PYFLOWBUF_SANITIZE=1 the second half is a use-after-free check)."""
    note = Notifier()
    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(0, 4, notifier=note)
    a, b, c = pool.request(), pool.request(), pool.request()
    token = note.prepare()
    a.recycle()
    assert note.wait(token, 0) is True  # a live pool tells its task
    pool.destroy()
    token = note.prepare()
    b.recycle()
    assert note.wait(token, 0) is False
    del pool, note
    gc.collect()
    c.recycle()  # the Notifier is freed by now
    assert nbp.available_segments == 4 and nbp.unreserved_segments == 4


def test_notifier_wait_times_out_and_cancel():
    note = Notifier()
    token = note.prepare()
    t0 = time.monotonic()
    assert note.wait(token, 0.05) is False
    assert time.monotonic() - t0 >= 0.04
    assert note.waiters == 0
    token = note.prepare()
    note.cancel()
    assert note.waiters == 0
    token = note.prepare()
    note.notify()  # a notification between prepare and wait is not lost
    assert note.wait(token, 5) is True
    with pytest.raises(ValueError):
        note.wait(note.prepare(), -1)


# ----------------------------------------------------------------- stateful / differential


class PoolMachine(RuleBasedStateMachine):
    """Random request/recycle/resize/destroy against the core and the
    deque+Lock reference model side by side."""

    TOTAL = 12

    def __init__(self):
        super().__init__()
        self.nbp = NetworkBufferPool(self.TOTAL, 256)
        self.ref = RefNetworkPool(self.TOTAL, 256)
        self.pools = []  # (core, ref)
        self.held = []  # (core Buffer, ref buffer, pool index)
        self.pending = []  # (view, core Buffer, ref buffer): released, waiting on a view

    def _pool(self, i):
        return self.pools[i % len(self.pools)]

    @rule(mn=st.integers(0, 8), extra=st.integers(-1, 6))
    def create_pool(self, mn, extra):
        mx = mn + extra
        outcome = []
        for make in (self.nbp.create_pool, self.ref.create_pool):
            try:
                outcome.append(make(mn, mx))
            except (ValueError, errors.InsufficientBuffersError) as exc:
                outcome.append(type(exc))
        core, ref = outcome
        if isinstance(core, LocalBufferPool):
            assert not isinstance(ref, type), ref
            self.pools.append((core, ref))
        else:
            assert core is ref

    @precondition(lambda self: self.pools)
    @rule(i=st.integers(0, 100), blocking=st.booleans())
    def request(self, i, blocking):
        idx = i % len(self.pools)
        core, ref = self.pools[idx]
        if ref.destroyed:
            with pytest.raises(errors.PoolDestroyedError):
                core.request_blocking(0) if blocking else core.request()
            return
        expect = ref.request()
        if blocking:
            try:
                got = core.request_blocking(0)
            except errors.BufferRequestTimeout:
                got = None
        else:
            got = core.request()
        assert (got is None) == (expect is None), (core, ref.in_use_, ref.min, ref.max, self.ref.unreserved)
        if got is not None:
            assert core.in_use <= core.max_size
            self.held.append((got, expect, idx))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), how=st.sampled_from(["recycle", "release", "drop", "view"]))
    def give_back(self, i, how):
        got, ref_buf, _ = self.held.pop(i % len(self.held))
        if how == "recycle":
            got.recycle()
            with pytest.raises(errors.BufferRecycledError):
                got.recycle()
        elif how == "release":
            got.release()
        elif how == "drop":
            del got
        else:
            before = self.nbp.available_segments
            view = memoryview(got)
            got.release()
            assert not got.recycled
            assert self.nbp.available_segments == before
            self.pending.append((view, got, ref_buf))
            return
        ref_buf.recycle()

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100))
    def drop_view(self, i):
        view, got, ref_buf = self.pending.pop(i % len(self.pending))
        view.release()
        assert got.recycled
        ref_buf.recycle()

    @precondition(lambda self: self.pools)
    @rule(i=st.integers(0, 100), mn=st.one_of(st.none(), st.integers(0, 10)),
          mx=st.one_of(st.none(), st.integers(0, 12)))
    def set_size(self, i, mn, mx):
        core, ref = self._pool(i)
        outcome = []
        for target in (core, ref):
            try:
                target.set_size(mn, mx)
                outcome.append(None)
            except (ValueError, errors.InsufficientBuffersError, errors.PoolDestroyedError) as exc:
                outcome.append(type(exc))
        assert outcome[0] is outcome[1], outcome

    @precondition(lambda self: self.pools)
    @rule(i=st.integers(0, 100))
    def destroy(self, i):
        core, ref = self._pool(i)
        core.destroy()
        ref.destroy()

    @invariant()
    def same_as_reference(self):
        nbp, ref = self.nbp, self.ref
        ref.check_invariant()
        assert nbp.available_segments == ref.available_segments
        assert nbp.unreserved_segments == ref.unreserved_segments
        assert nbp.live_pools == ref.live_pools
        assert 0 <= nbp.unreserved_segments <= nbp.available_segments <= self.TOTAL
        for core, r in self.pools:
            assert core.destroyed == r.destroyed
            assert (core.in_use, core.min_size, core.max_size) == (r.in_use, r.min_size, r.max_size)
            if not r.destroyed:
                assert core.available == r.would_grant()
        # no segment is handed out twice, none is lost
        outstanding = [b.segment_index for b, _, _ in self.held] + [b.segment_index for _, b, _ in self.pending]
        assert len(set(outstanding)) == len(outstanding)
        assert all(0 <= s < self.TOTAL for s in outstanding)
        assert nbp.in_use_segments == len(outstanding)

    def teardown(self):
        for view, _, _ in self.pending:
            view.release()
        for got, _, _ in self.held:
            got.recycle()
        for core, _ in self.pools:
            core.destroy()
        assert self.nbp.available_segments == self.TOTAL
        assert self.nbp.unreserved_segments == self.TOTAL
        assert self.nbp.live_pools == 0


TestPoolStateMachine = PoolMachine.TestCase
TestPoolStateMachine.settings = settings(stateful_step_count=40)


# ----------------------------------------------------------------- threads


@pytest.mark.timeout(60)
def test_threads_hammer_pools_in_c_without_gil(threads):
    """request+recycle loops that run with the GIL released, truly in
    parallel: tokens and the MPMC free list must stay consistent."""
    nbp = NetworkBufferPool(6, 256)
    a = nbp.create_pool(2, 4)  # 4 threads: 2 guaranteed + 2 tokens
    b = nbp.create_pool(0, 2)  # 2 threads: 2 tokens; 4 tokens exist, so no request fails
    n = 20000
    for pool, k in ((a, 4), (b, 2)):
        for _ in range(k):
            threads.start(_bench_pool_ops, pool, n)
    threads.join(50)
    assert a.in_use == 0 and b.in_use == 0
    # requested_total is a relaxed statistic: concurrent increments may be lost
    assert 0 < a.requested_total <= 4 * n and 0 < b.requested_total <= 2 * n
    assert nbp.available_segments == 6  # (checked first: a lost segment would make the loop below spin)
    assert nbp.unreserved_segments == 4
    a.destroy(), b.destroy()
    everything = nbp.create_pool(6, 6)
    got = [everything.request() for _ in range(6)]
    assert held_segments(got) == list(range(6))
    assert everything.request() is None


@pytest.mark.timeout(60)
def test_resize_races_parallel_requests(threads):
    """set_size moves tokens between the pool and the arena while four
    threads request/recycle with the GIL released."""
    nbp = NetworkBufferPool(8, 256)
    pool = nbp.create_pool(0, 4)
    stop = threading.Event()
    rounds = [0] * 4

    def hammer(k):
        while not stop.is_set():
            _bench_pool_ops(pool, 2000)
            rounds[k] += 1

    for k in range(4):
        threads.start(hammer, k)
    rng = random.Random(5)
    try:
        for _ in range(2000):
            # max >= 4 threads and 8 - max(in_use, min) >= 4 tokens: no request may fail
            pool.set_size(rng.randint(0, 4), rng.randint(4, 8))
            assert pool.in_use <= 4
            # snapshots taken while segments move: each must still be possible
            assert 0 <= nbp.unreserved_segments <= 8
            assert 0 <= nbp.available_segments <= 8
            assert 0 <= nbp.in_use_segments <= 8
            time.sleep(0)
    finally:
        stop.set()
    threads.join(30)
    assert all(r > 0 for r in rounds)
    assert pool.in_use == 0
    assert nbp.available_segments == 8
    assert nbp.unreserved_segments == 8 - pool.min_size
    pool.destroy()
    assert nbp.unreserved_segments == 8


def _pool_worker(pool, rounds, seed, owners, lock, bound, stats):
    rng = random.Random(seed)
    mine = []
    for _ in range(rounds):
        op = rng.random()
        if op < 0.45 and len(mine) < 3:
            buf = pool.request() if rng.random() < 0.5 else _blocking(pool, 0.2)
            if buf is None:
                stats["misses"] += 1
                continue
            with lock:
                assert owners.get(buf.segment_index) is None, "segment handed out twice"
                owners[buf.segment_index] = seed
                stats["peak"] = max(stats["peak"], pool.in_use)
            assert pool.in_use <= bound[0]
            buf.write(seed.to_bytes(8, "little"))
            mine.append(buf)
        elif mine:
            buf = mine.pop(rng.randrange(len(mine)))
            assert bytes(memoryview(buf)) == seed.to_bytes(8, "little")  # nobody wrote into my segment
            with lock:
                del owners[buf.segment_index]
            buf.recycle()
    for buf in mine:
        with lock:
            del owners[buf.segment_index]
        buf.recycle()


def _blocking(pool, timeout):
    try:
        return pool.request_blocking(timeout)
    except TimeoutError:
        return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", ["core", "reference"])
def test_threads_share_one_pool(impl, threads, fast_switching):
    """Several threads request, hold and recycle from one small pool while a
    resizer changes its bounds: no segment is handed out twice, the cap
    holds, nothing leaks. The same harness runs on the reference model."""
    nbp = NetworkBufferPool(8, 256) if impl == "core" else RefNetworkPool(8, 256)
    pool = nbp.create_pool(2, 5)
    owners, lock, stats = {}, threading.Lock(), {"misses": 0, "peak": 0}
    bound = [5]  # the largest cap ever set
    stop = threading.Event()
    def resizer():
        rng = random.Random(99)
        while not stop.is_set():
            mx = rng.randint(1, 6)
            bound[0] = max(bound[0], mx)
            pool.set_size(rng.randint(0, min(mx, 3)), mx)
            time.sleep(0.001)
        pool.set_size(2, 5)

    def sampler():
        while not stop.is_set():
            assert pool.in_use <= bound[0]
            assert nbp.available_segments >= 0
            time.sleep(0.0005)

    if impl == "core":
        workers = [threads.start(_pool_worker, pool, 1500, s, owners, lock, bound, stats) for s in range(4)]
    else:
        workers = [threads.start(_ref_worker, pool, 1500, s, owners, lock, bound, stats) for s in range(4)]
    side = [threads.start(resizer), threads.start(sampler)]
    for w in workers:
        w.join(50)
    stop.set()
    threads.join(10)
    assert not owners
    assert pool.in_use == 0
    assert stats["peak"] <= bound[0]
    assert nbp.available_segments == 8
    assert nbp.unreserved_segments == 6
    pool.destroy()
    assert nbp.unreserved_segments == 8


def _ref_worker(pool, rounds, seed, owners, lock, bound, stats):
    rng = random.Random(seed)
    mine = []
    for _ in range(rounds):
        if rng.random() < 0.45 and len(mine) < 3:
            buf = pool.request() if rng.random() < 0.5 else _blocking(pool, 0.2)
            if buf is None:
                continue
            with lock:
                assert owners.get(buf.segment_index) is None
                owners[buf.segment_index] = seed
                stats["peak"] = max(stats["peak"], pool.in_use)
            mine.append(buf)
        elif mine:
            buf = mine.pop(rng.randrange(len(mine)))
            with lock:
                del owners[buf.segment_index]
            buf.recycle()
    for buf in mine:
        with lock:
            del owners[buf.segment_index]
        buf.recycle()


@pytest.mark.timeout(60)
def test_producer_consumer_through_four_segments(threads):
    """Buffers (not records) move from a producer to a consumer through a pool
    of 4 segments: each sequence number arrives exactly once, in order."""
    from pyflowbuf._core.channel import BufferQueue

    nbp = NetworkBufferPool(4, 256)
    pool = nbp.create_pool(1, 4)
    q = BufferQueue(nbp)
    n = 3000
    peak = [0]

    def produce():
        for i in range(n):
            b = pool.request_blocking(10)
            b.write(i.to_bytes(4, "little") * 64)
            peak[0] = max(peak[0], pool.in_use)
            q.push_buffer(b)

    def consume():
        got = []
        while len(got) < n:
            b = q.pop_buffer()
            if b is None:
                time.sleep(0)  # the producer may be parked on the dry pool
                continue
            data = bytes(memoryview(b))
            assert data == data[:4] * 64
            got.append(int.from_bytes(data[:4], "little"))
            b.recycle()
        return got

    threads.start(produce)
    c = threads.start(consume)
    threads.join(50)
    assert c.result["value"] == list(range(n))
    assert peak[0] <= 4
    assert pool.in_use == 0
    assert nbp.available_segments == 4
