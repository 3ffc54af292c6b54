"""Segments, the NetworkBufferPool (arena), LocalBufferPools and Buffers."""
cimport cython
from cpython.buffer cimport PyBUF_WRITABLE
from cpython.memoryview cimport PyMemoryView_FromObject
from libc.stdint cimport int64_t, uint32_t, uint64_t

from pyflowbuf._core.errors cimport check, raise_error
from pyflowbuf.includes.arena cimport *
from pyflowbuf.includes.errors cimport *
from pyflowbuf.includes.park cimport *
from pyflowbuf.includes.ring cimport FB_DATA_EVENT, FB_DATA_FIXED, FB_DATA_RECORDS, fb_bufdesc

from pyflowbuf import errors as _errors

# defined once, in csrc/fb_arena.h; every default segment size in the package is this one
DEFAULT_SEGMENT_SIZE = FB_DEFAULT_SEGMENT_SIZE
MIN_SEGMENT_SIZE = FB_MIN_SEGMENT_SIZE
MAX_SEGMENT_SIZE = FB_MAX_SEGMENT_SIZE
_DATA_TYPES = {FB_DATA_RECORDS: "records", FB_DATA_FIXED: "fixed", FB_DATA_EVENT: "event"}


cdef inline int64_t _timeout_ns(object timeout) except? -2:
    if timeout is None:
        return -1
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
    return <int64_t>(timeout * 1e9)


def _check_count(name, value, minimum=0):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value >= 1 << 31:
        raise ValueError(f"{name} must be < 2**31, got {value}")


@cython.final
cdef class Notifier:
    """An availability notification a task can park on.

    Give the same Notifier to several InputGates and LocalBufferPools and one
    ``wait`` covers them all. The pattern that loses no wake-up is::

        token = notifier.prepare()
        if something_ready():
            notifier.cancel()
        else:
            notifier.wait(token, timeout)
    """

    def __cinit__(self):
        check(fb_event_init(&self.ev), "Notifier")
        self._ready = True

    def __dealloc__(self):
        if self._ready:
            fb_event_destroy(&self.ev)

    def prepare(self):
        return fb_event_prepare(&self.ev)

    def cancel(self):
        fb_event_cancel(&self.ev)

    def wait(self, uint32_t token, timeout=None):
        """Park (GIL released) until notified after ``prepare`` or ``timeout`` s.

        Returns True when notified, False on timeout."""
        cdef int64_t t = _timeout_ns(timeout)
        cdef int rc
        with nogil:
            rc = fb_event_wait(&self.ev, token, t)
        return rc == FB_OK

    def notify(self):
        fb_event_notify_all(&self.ev)

    @property
    def waiters(self):
        return self.ev.waiters


@cython.final
cdef class NetworkBufferPool:
    """The process-wide arena: ``num_segments`` segments of ``segment_size`` bytes
    in one aligned allocation, with a lock-free free list of segment indices.

    Parameters
    ----------
    num_segments : int
        Total number of segments; memory used is ``num_segments * segment_size``.
    segment_size : int
        A power of two from 256 B to 1 MiB (default 32 KiB, as in Flink).
    """

    def __cinit__(self, num_segments, segment_size=DEFAULT_SEGMENT_SIZE):
        _check_count("num_segments", num_segments, 1)
        _check_count("segment_size", segment_size, 1)
        if segment_size & (segment_size - 1) or not MIN_SEGMENT_SIZE <= segment_size <= MAX_SEGMENT_SIZE:
            raise ValueError(
                f"segment_size must be a power of two between {MIN_SEGMENT_SIZE} and "
                f"{MAX_SEGMENT_SIZE}, got {segment_size}")
        check(fb_arena_create(num_segments, segment_size, &self.a),
              f"allocating {num_segments} x {segment_size} B")

    def __dealloc__(self):
        if self.a is not NULL:
            fb_arena_decref(self.a)
            self.a = NULL

    def create_pool(self, min_size, max_size, Notifier notifier=None):
        """Create a LocalBufferPool that is guaranteed ``min_size`` segments and
        may hold up to ``max_size``. Raises InsufficientBuffersError when the
        guarantee cannot be given."""
        _check_count("min_size", min_size, 0)
        _check_count("max_size", max_size, 1)
        if min_size > max_size:
            raise ValueError(f"min_size ({min_size}) must be <= max_size ({max_size})")
        cdef LocalBufferPool pool = LocalBufferPool.__new__(LocalBufferPool)
        cdef int rc = fb_pool_create(self.a, min_size, max_size, &pool.p)
        if rc == FB_E_INSUFFICIENT:
            raise _errors.InsufficientBuffersError(
                f"insufficient number of network buffers: required {min_size}, but only "
                f"{self.unreserved_segments} of {self.total_segments} are not promised to other pools")
        check(rc, "create_pool")
        pool.a = self.a
        pool.network_pool = self
        if notifier is not None:
            pool._listener = notifier
            pool.p.listener = &notifier.ev
        return pool

    @property
    def total_segments(self):
        return self.a.num_segments

    @property
    def segment_size(self):
        return self.a.segment_size

    @property
    def total_bytes(self):
        return self.a.num_segments * self.a.segment_size

    @property
    def available_segments(self):
        """Segments in the free list right now (a snapshot under concurrency)."""
        return fb_arena_available(self.a)

    @property
    def unreserved_segments(self):
        """Free segments not promised to any pool's guaranteed minimum."""
        return self.a.unreserved

    @property
    def in_use_segments(self):
        return self.a.num_segments - fb_arena_available(self.a)

    @property
    def live_pools(self):
        return self.a.live_pools

    def release_memory(self, keep_bytes=0):
        """Give the kernel back the pages of every unpromised free segment
        past its first ``keep_bytes`` (rounded up to a page), so that the
        process's resident memory shrinks while buffers are debloated: a
        writer capped at ``keep_bytes`` never touches the rest again. Safe
        while pools run (those segments are taken off the free list for the
        moment it takes). Returns the bytes advised away."""
        _check_count("keep_bytes", keep_bytes, 0)
        cdef uint64_t keep = keep_bytes, n
        with nogil:
            n = fb_arena_release(self.a, keep)
        return n

    @property
    def resident_bytes(self):
        """Bytes of the arena resident in memory now (None if unknown)."""
        cdef int64_t r
        with nogil:
            r = fb_arena_resident(self.a)
        return None if r < 0 else r

    def __repr__(self):
        return (f"NetworkBufferPool(total={self.total_segments}, segment_size={self.segment_size}, "
                f"available={self.available_segments})")


@cython.final
cdef class LocalBufferPool:
    """A bounded share of a NetworkBufferPool: ``min_size`` segments guaranteed,
    at most ``max_size`` in use. Create with ``NetworkBufferPool.create_pool``."""

    def __init__(self, *args, **kwargs):
        raise TypeError("create a LocalBufferPool with NetworkBufferPool.create_pool()")

    def __dealloc__(self):
        if self.p is not NULL:
            fb_pool_destroy(self.p)
            self.p = NULL

    cdef int request_wait(self, uint32_t *seg, int64_t timeout_ns) except? -1 nogil:
        """Request a segment, parking (GIL released by the caller) until one is
        recycled. Returns FB_OK or a negative code; never spins."""
        cdef fb_pool *p = self.p
        if p is NULL:
            return FB_E_DESTROYED
        cdef int rc = fb_pool_request(p, seg)
        if rc != FB_E_UNAVAILABLE:
            return rc
        cdef fb_event *ev = &self.a.available
        cdef int64_t deadline = fb_monotonic_ns() + timeout_ns if timeout_ns >= 0 else -1
        cdef int64_t left = -1
        cdef uint32_t token
        while True:
            token = fb_event_prepare(ev)
            rc = fb_pool_request(p, seg)
            if rc != FB_E_UNAVAILABLE:
                fb_event_cancel(ev)
                return rc
            if self.cancelled:
                fb_event_cancel(ev)
                return FB_E_CANCELLED
            if deadline >= 0:
                left = deadline - fb_monotonic_ns()
                if left <= 0:
                    fb_event_cancel(ev)
                    return FB_E_TIMEOUT
            fb_event_wait(ev, token, left)

    cdef int _alive(self) except -1:
        if self.p is NULL or self._destroy_pending:
            raise _errors.PoolDestroyedError("the LocalBufferPool was destroyed")
        return 0

    def request(self):
        """Non-blocking: a Buffer, or None when the pool is at its cap or the
        arena has nothing to spare."""
        self._alive()
        cdef uint32_t seg
        cdef int rc = fb_pool_request(self.p, &seg)
        if rc == FB_E_UNAVAILABLE:
            return None
        check(rc, "request")
        cdef fb_bufdesc d
        d.pool = self.p
        d.seg = seg
        d.size = 0
        d.width = 0
        d.type = FB_DATA_RECORDS
        d.flags = 0
        d.aux = 0
        return Buffer.wrap(&d, self.network_pool)

    cdef int leave_wait(self) except -1:
        """Called (GIL held) by every thread that leaves request_wait; the last
        one carries out a destroy() that came while it waited, so the C pool
        is never freed under a waiter."""
        self._waiters -= 1
        if self._waiters == 0 and self._destroy_pending and self.p is not NULL:
            fb_pool_destroy(self.p)
            self.p = NULL
        return 0

    def request_blocking(self, timeout=None):
        """Wait (GIL released, thread parked) for a Buffer. Raises
        BufferRequestTimeout after ``timeout`` seconds, CancelledError after
        ``cancel_waiters()``, PoolDestroyedError after ``destroy()``."""
        self._alive()
        cdef int64_t t = _timeout_ns(timeout)
        cdef uint32_t seg
        cdef int rc
        cdef fb_pool *p = self.p
        self._waiters += 1
        try:
            with nogil:
                rc = self.request_wait(&seg, t)
        finally:
            self.leave_wait()
        if rc == FB_E_CANCELLED and self._destroy_pending:
            raise _errors.PoolDestroyedError("the LocalBufferPool was destroyed while waiting")
        if rc == FB_E_TIMEOUT:
            raise _errors.BufferRequestTimeout(f"no buffer within {timeout} s ({self!r})")
        check(rc, "request_blocking")
        cdef fb_bufdesc d
        d.pool = p
        d.seg = seg
        d.size = 0
        d.width = 0
        d.type = FB_DATA_RECORDS
        d.flags = 0
        d.aux = 0
        return Buffer.wrap(&d, self.network_pool)

    def cancel_waiters(self):
        """Make every blocked request on this pool raise CancelledError."""
        self.cancelled = 1
        fb_event_notify_all(&self.a.available)

    def set_size(self, min_size=None, max_size=None):
        """Change the guaranteed minimum and/or the cap at run time (debloating,
        redistribution). Lowering the cap below what is in use takes effect as
        buffers come back."""
        self._alive()
        cdef uint64_t s = self.p.state
        new_min = FB_POOL_MIN(s) if min_size is None else min_size
        new_max = self.p.max if max_size is None else max_size
        _check_count("min_size", new_min, 0)
        _check_count("max_size", new_max, 1)
        if new_min > new_max:
            raise ValueError(f"min_size ({new_min}) must be <= max_size ({new_max})")
        old_max = self.p.max
        if new_max >= FB_POOL_MIN(s):
            fb_pool_set_max(self.p, new_max)
            rc = fb_pool_set_min(self.p, new_min)
            if rc != FB_OK:
                fb_pool_set_max(self.p, old_max)  # a failed resize changes nothing
        else:
            rc = fb_pool_set_min(self.p, new_min)
            if rc == FB_OK:
                fb_pool_set_max(self.p, new_max)
        if rc == FB_E_INSUFFICIENT:
            raise _errors.InsufficientBuffersError(
                f"insufficient number of network buffers to guarantee min_size={new_min}")
        check(rc, "set_size")

    def destroy(self):
        """Return the unused reservation now and every in-use segment as it is
        recycled. Further requests raise PoolDestroyedError."""
        if self.p is NULL or self._destroy_pending:
            return
        if self._waiters:
            # threads are parked on this pool: wake them; the last to leave frees it
            self._destroy_pending = True
            self.cancelled = 1
            fb_event_notify_all(&self.a.available)
            return
        fb_pool_destroy(self.p)
        self.p = NULL

    @property
    def destroyed(self):
        return self.p is NULL or self._destroy_pending

    @property
    def in_use(self):
        return 0 if self.p is NULL else FB_POOL_INUSE(self.p.state)

    @property
    def min_size(self):
        return 0 if self.p is NULL else FB_POOL_MIN(self.p.state)

    @property
    def max_size(self):
        return 0 if self.p is NULL else self.p.max

    @property
    def usage(self):
        """Fraction of the cap in use: Flink's in/outPoolUsage."""
        if self.p is NULL:
            return 0.0
        return FB_POOL_INUSE(self.p.state) / <double>self.p.max

    @property
    def available(self):
        """Whether a request would succeed now (a snapshot)."""
        if self.p is NULL:
            return False
        cdef uint64_t s = self.p.state
        if FB_POOL_INUSE(s) >= self.p.max:
            return False
        return FB_POOL_INUSE(s) < FB_POOL_MIN(s) or self.a.unreserved > 0

    @property
    def segment_size(self):
        return self.a.segment_size

    @property
    def requested_total(self):
        return 0 if self.p is NULL else self.p.requested

    def __repr__(self):
        if self.p is NULL:
            return "LocalBufferPool(destroyed)"
        return f"LocalBufferPool(in_use={self.in_use}, min={self.min_size}, max={self.max_size})"


@cython.final
@cython.freelist(64)
cdef class Buffer:
    """A segment plus writer/reader positions and a data type.

    1. ``recycle()`` returns the segment to its pool exactly once; a second call
       or any use afterwards raises BufferRecycledError.
    2. While a memoryview/NumPy view of it is alive it cannot be recycled:
       ``recycle()`` raises BufferError, ``release()`` defers until the last
       view is gone.
    3. A Buffer dropped without release is recycled when collected.
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("Buffers come from LocalBufferPool.request() or a RecordReader")

    @staticmethod
    cdef Buffer wrap(const fb_bufdesc *d, NetworkBufferPool arena):
        cdef Buffer b = Buffer.__new__(Buffer)
        b.d = d[0]
        b._arena_owner = arena
        b.base = fb_segment_ptr(arena.a, d.seg)
        b.capacity_ = arena.a.segment_size
        return b

    def __dealloc__(self):
        if self._state != 1 and self.d.pool is not NULL:
            fb_pool_recycle(self.d.pool, self.d.seg)

    cdef int _recycle_now(self) except -1:
        self._state = 1
        if self.d.pool is not NULL:
            fb_pool_recycle(self.d.pool, self.d.seg)
        return 0

    cdef int release_or_defer(self) except -1:
        if self._state == 1:
            raise _errors.BufferRecycledError("buffer already recycled")
        if self._state == 2:
            raise _errors.BufferRecycledError("buffer already released (double release)")
        if self._exports > 0:
            self._state = 2
            return 0
        return self._recycle_now()

    cdef int _view_done(self) except -1:
        self._exports -= 1
        if self._exports == 0 and self._state == 2:
            self._recycle_now()
        return 0

    cdef int _live(self) except -1:
        if self._state != 0:
            raise _errors.BufferRecycledError("buffer used after it was released")
        return 0

    def recycle(self):
        """Return the segment to its pool now."""
        if self._state == 1:
            raise _errors.BufferRecycledError("buffer already recycled (double release)")
        if self._exports > 0:
            raise BufferError(f"cannot recycle a buffer with {self._exports} live view(s)")
        self._recycle_now()

    def release(self):
        """Recycle now, or as soon as the last view of it is released."""
        self.release_or_defer()

    def write(self, data):
        """Append bytes at the writer index; returns the number written (may be
        less than len(data) when the buffer fills)."""
        self._live()
        cdef const unsigned char[::1] src = memoryview(data).cast("B")
        cdef Py_ssize_t n = min(<Py_ssize_t>(self.capacity_ - self.d.size), src.shape[0])
        if n > 0:
            memcpy(self.base + self.d.size, &src[0], n)
            self.d.size += <uint32_t>n
        return n

    def memory(self):
        """A writable memoryview over the whole segment (capacity bytes), e.g.
        for ``socket.recv_into``; set the written size with ``set_meta``."""
        self._live()
        return PyMemoryView_FromObject(_FullView.of(self))

    def set_meta(self, size, data_type="records", width=0, flags=0, aux=0):
        """Set the writer index and data type of a buffer filled through
        ``memory()`` (the network receiver does this)."""
        self._live()
        if not 0 <= size <= self.capacity_:
            raise ValueError(f"size must be in 0..{self.capacity_}, got {size}")
        codes = {"records": FB_DATA_RECORDS, "fixed": FB_DATA_FIXED, "event": FB_DATA_EVENT}
        if data_type not in codes:
            raise ValueError(f"data_type must be one of {sorted(codes)}, got {data_type!r}")
        self.d.size = size
        self.d.type = codes[data_type]
        self.d.width = width
        self.d.flags = flags
        self.d.aux = aux

    @property
    def width(self):
        return self.d.width

    @property
    def flags(self):
        return self.d.flags

    def __getbuffer__(self, Py_buffer *view, int flags):
        if self._state != 0:
            raise _errors.BufferRecycledError("buffer used after it was released")
        view.buf = self.base
        view.obj = self
        view.len = self.d.size
        view.readonly = 0
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = NULL
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL
        self._exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self._view_done()

    @property
    def size(self):
        """Bytes written (the writer index)."""
        return self.d.size

    @property
    def capacity(self):
        return self.capacity_

    @property
    def data_type(self):
        return _DATA_TYPES.get(self.d.type, "unknown")

    @property
    def segment_index(self):
        return self.d.seg

    @property
    def recycled(self):
        return self._state == 1

    @property
    def views(self):
        return self._exports

    def __len__(self):
        return self.d.size

    def __repr__(self):
        state = ("live", "recycled", "release-pending")[self._state]
        return f"Buffer(segment={self.d.seg}, size={self.d.size}, type={self.data_type}, {state})"


from libc.string cimport memcpy


@cython.final
@cython.freelist(256)
cdef class RecordView:
    """Exports one record's bytes inside a Buffer; keeps the Buffer from being
    recycled while any view of it lives."""

    def __init__(self, *args, **kwargs):
        raise TypeError("RecordViews come from a RecordReader")

    @staticmethod
    cdef RecordView new(Buffer buf, char *ptr, Py_ssize_t length):
        cdef RecordView rv = RecordView.__new__(RecordView)
        rv.buf = buf
        rv.ptr = ptr
        rv.length = length
        buf._exports += 1
        return rv

    @staticmethod
    cdef object memoryview_of(Buffer buf, char *ptr, Py_ssize_t length):
        return PyMemoryView_FromObject(RecordView.new(buf, ptr, length))

    def __dealloc__(self):
        if self.buf is not None:
            self.buf._view_done()

    def __getbuffer__(self, Py_buffer *view, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("record views are read-only")
        self.shape[0] = self.length
        view.buf = self.ptr
        view.obj = self
        view.len = self.length
        view.readonly = 1
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = self.shape
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass


@cython.final
cdef class _FullView:
    """Writable export of a Buffer's whole segment."""
    cdef Buffer buf
    cdef Py_ssize_t shape[1]

    @staticmethod
    cdef _FullView of(Buffer buf):
        cdef _FullView v = _FullView.__new__(_FullView)
        v.buf = buf
        buf._exports += 1
        return v

    def __dealloc__(self):
        if self.buf is not None:
            self.buf._view_done()

    def __getbuffer__(self, Py_buffer *view, int flags):
        self.shape[0] = <Py_ssize_t>self.buf.capacity_
        view.buf = self.buf.base
        view.obj = self
        view.len = self.shape[0]
        view.readonly = 0
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = self.shape
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass


def _bench_pool_ops(LocalBufferPool pool not None, Py_ssize_t n):
    """request+recycle ``n`` times in a nogil C loop; returns seconds taken.
    Benchmarks only (benchmarks/bench_core.py)."""
    pool._alive()
    cdef fb_pool *p = pool.p
    cdef uint32_t seg
    cdef Py_ssize_t i
    cdef int64_t t0, t1
    cdef int rc = 0
    with nogil:
        t0 = fb_monotonic_ns()
        for i in range(n):
            rc = fb_pool_request(p, &seg)
            if rc != FB_OK:
                break
            fb_pool_recycle(p, seg)
        t1 = fb_monotonic_ns()
    check(rc, "_bench_pool_ops")
    return (t1 - t0) / 1e9
