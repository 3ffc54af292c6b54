"""RecordWriter and RecordReader: records serialized straight into segments.

Records are a 4-byte little-endian length and the payload, spanning buffers
freely. Fixed-width records (NumPy arrays) go into their own buffers, back to
back, one memcpy per buffer, and come back as NumPy views. Every batch API
crosses from Python into C once per call.
"""
cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.float cimport PyFloat_AsDouble, PyFloat_FromDouble
from cpython.list cimport PyList_Append, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsLongLong, PyLong_FromLongLong
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from cpython.memoryview cimport PyMemoryView_FromMemory
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

from pyflowbuf._core.channel cimport EVT_END_OF_PARTITION, BufferQueue, InputGate
from pyflowbuf._core.errors cimport check
from pyflowbuf._core.memory cimport Buffer, LocalBufferPool, NetworkBufferPool, RecordView
from pyflowbuf.includes.arena cimport fb_pool_recycle, fb_pool_request, fb_segment_ptr
from pyflowbuf.includes.errors cimport *
from pyflowbuf.includes.park cimport fb_monotonic_ns
from pyflowbuf.includes.ring cimport FB_DATA_EVENT, FB_DATA_FIXED, FB_DATA_RECORDS, fb_bufdesc
from pyflowbuf.includes.serde cimport *

import pickle

import numpy as np

cimport numpy as cnp
from cpython.object cimport PyTypeObject

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    object PyArray_NewFromDescr(PyTypeObject *subtype, cnp.dtype descr, int nd, cnp.npy_intp *dims,
                                cnp.npy_intp *strides, void *data, int flags, object obj)

from pyflowbuf import errors as _errors

cdef extern from "Python.h":
    PyObject *PyBytes_FromStringAndSize_raw "PyBytes_FromStringAndSize"(const char *, Py_ssize_t) except NULL
    char *PyBytes_AS_STRING_raw "PyBytes_AS_STRING"(PyObject *) nogil

DEFAULT_MAX_RECORD_SIZE = 64 * 1024 * 1024
DEFAULT_ZERO_COPY_MIN = 4096
KINDS = {"bytes": KIND_BYTES, "int64": KIND_INT64, "float64": KIND_FLOAT64,
         "str": KIND_STR, "pickle": KIND_PICKLE}
_KIND_NAMES = {v: k for k, v in KINDS.items()}
cdef object _NEED_MORE = object()
cdef object _pickle_dumps = pickle.dumps
cdef object _pickle_loads = pickle.loads


cdef int _kind_code(object kind) except -1:
    if isinstance(kind, int) and kind in _KIND_NAMES:
        return kind
    try:
        return KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}") from None


cdef inline uint64_t _stable_hash(object key) except? 0:
    cdef const char *p
    cdef Py_ssize_t n
    if isinstance(key, int):
        return fb_mix64(<uint64_t>PyLong_AsLongLong(key) if -(1 << 63) <= key < (1 << 63) else <uint64_t>hash(key))
    if isinstance(key, str):
        p = PyUnicode_AsUTF8AndSize(key, &n)
        return fb_hash_bytes(p, n)
    if isinstance(key, bytes):
        return fb_hash_bytes(PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))
    if isinstance(key, tuple):
        h = <uint64_t>0x9e3779b97f4a7c15
        for item in key:
            h = fb_mix64(h ^ _stable_hash(item))
        return h
    return fb_mix64(<uint64_t>hash(key))


cdef int64_t _timeout_ns(object timeout, str name="timeout") except? -2:
    """None: no limit (-1); otherwise seconds >= 0 as nanoseconds."""
    if timeout is None:
        return -1
    if not timeout >= 0:
        raise ValueError(f"{name} must be >= 0 or None, got {timeout!r}")
    return <int64_t>(timeout * 1e9)


def stable_hash(key):
    """The process-independent hash used for key partitioning."""
    return _stable_hash(key)


@cython.final
cdef class RecordWriter:
    """Serializes records into buffers of a LocalBufferPool and hands finished
    buffers to one BufferQueue per subpartition.

    A buffer is handed over when it is full, on ``flush()`` (the runtime calls
    it on the buffer timeout and before it idles) and before events. When the
    pool is dry the writer parks (GIL released) until the consumer recycles a
    buffer: that is the backpressure; the time is counted in
    ``backpressure_ns``.
    """

    def __cinit__(self, LocalBufferPool pool not None, queues, kind="bytes",
                  max_record_size=DEFAULT_MAX_RECORD_SIZE, request_timeout=None):
        queues = list(queues)
        if not queues:
            raise ValueError("a RecordWriter needs at least one subpartition queue")
        for q in queues:
            if not isinstance(q, BufferQueue):
                raise TypeError(f"queues must be BufferQueues, got {type(q).__name__}")
            if (<BufferQueue>q).network_pool is not pool.network_pool:
                raise ValueError("queues must belong to the pool's NetworkBufferPool")
        if not isinstance(max_record_size, int) or not 0 < max_record_size < (1 << 32):
            raise ValueError(f"max_record_size must be in 1..2**32-1, got {max_record_size!r}")
        self.kind = _kind_code(kind)
        self.pool = pool
        self.p = pool.p
        self.a = pool.a
        if self.p is NULL:
            raise _errors.PoolDestroyedError("the LocalBufferPool was destroyed")
        self.queues = queues
        self.num_channels = len(queues)
        self.max_record_size = max_record_size
        self.request_timeout_ns = _timeout_ns(request_timeout, "request_timeout")
        self.builders = <Builder *>PyMem_Calloc(self.num_channels, sizeof(Builder))
        if self.builders is NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef int i
        if self.builders is not NULL:
            for i in range(self.num_channels):
                if self.builders[i].active:
                    fb_pool_recycle(self.p, self.builders[i].seg)
            PyMem_Free(self.builders)

    cdef int _new_segment(self, int ch, uint16_t type, uint32_t width) except -1:
        cdef uint32_t seg
        cdef int rc
        cdef int64_t t0
        cdef LocalBufferPool pool = self.pool
        if pool.p is NULL or pool._destroy_pending:  # destroyed: self.p may already be freed
            raise _errors.PoolDestroyedError("the writer's LocalBufferPool was destroyed")
        rc = fb_pool_request(self.p, &seg)
        if rc == FB_E_UNAVAILABLE:
            t0 = fb_monotonic_ns()
            pool._waiters += 1
            try:
                with nogil:
                    rc = pool.request_wait(&seg, self.request_timeout_ns)
            finally:
                pool.leave_wait()
            self.backpressure_ns += fb_monotonic_ns() - t0
            if rc == FB_E_CANCELLED and pool._destroy_pending:
                raise _errors.PoolDestroyedError("the writer's LocalBufferPool was destroyed while it waited")
        if rc != FB_OK:
            check(rc, "requesting an output buffer")
        cdef Builder *b = &self.builders[ch]
        b.seg = seg
        b.base = fb_segment_ptr(self.a, seg)
        b.pos = 0
        b.cap = <uint32_t>self.a.segment_size
        b.type = type
        b.width = width
        b.active = 1
        return 0

    cdef int _finish(self, int ch) except -1:
        cdef Builder *b = &self.builders[ch]
        if not b.active:
            return 0
        b.active = 0
        if b.pos == 0:
            fb_pool_recycle(self.p, b.seg)
            return 0
        cdef fb_bufdesc d
        d.pool = self.p
        d.seg = b.seg
        d.size = b.pos
        d.width = b.width
        d.type = b.type
        d.flags = 0
        d.aux = 0
        cdef BufferQueue q = <BufferQueue>self.queues[ch]
        cdef int rc
        rc = q.push(&d, False)
        if rc != 0:
            fb_pool_recycle(self.p, d.seg)
            check(rc, "handing a buffer to its subpartition")
        self.buffers_out += 1
        return 0

    cdef int _copy_chunks(self, int ch, const char *src, uint32_t n) except -1:
        cdef Builder *b = &self.builders[ch]
        cdef uint32_t k
        while n > 0:
            if not b.active:
                self._new_segment(ch, FB_DATA_RECORDS, 0)
            k = b.cap - b.pos
            if k > n:
                k = n
            memcpy(b.base + b.pos, src, k)
            b.pos += k
            src += k
            n -= k
            self._copied += k
            if b.pos == b.cap:
                self._finish(ch)
        return 0

    cdef int _write_span(self, int ch, const char *data, uint32_t n) except -1:
        cdef Builder *b = &self.builders[ch]
        cdef char hdr[4]
        if self._is_broken:
            raise _errors.ChannelClosedError(self.broken)
        if b.active and b.type != FB_DATA_RECORDS:
            self._finish(ch)
        fb_store_le32(hdr, n)
        self._copied = 0
        try:
            self._copy_chunks(ch, hdr, 4)
            self._copy_chunks(ch, data, n)
        except BaseException as exc:
            if self._copied:
                # Part of the record is already in buffers (maybe shipped): later
                # records would be read as its rest. Refuse them; end_input()
                # still works, so the consumer sees a truncated stream, not garbage.
                self._is_broken = True
                self.broken = (f"subpartition {ch} holds a half-written record ({self._copied} of "
                               f"{n + 4} bytes) after {type(exc).__name__}: {exc}; the writer cannot "
                               "take more records")
            raise
        self.records_out += 1
        self.bytes_out += n
        return 0

    cdef inline int _write_raw(self, int ch, const char *data, uint32_t n) except -1:
        cdef Builder *b = &self.builders[ch]
        if b.active and b.type == FB_DATA_RECORDS and b.cap - b.pos > n + 4 and not self._is_broken:
            fb_store_le32(b.base + b.pos, n)
            memcpy(b.base + b.pos + 4, data, n)
            b.pos += n + 4
            self.records_out += 1
            self.bytes_out += n
            return 0
        return self._write_span(ch, data, n)

    cdef int _write_obj(self, int ch, object rec) except -1:
        cdef Py_buffer view
        cdef Py_ssize_t n
        cdef const char *p
        cdef char tmp[8]
        cdef long long iv
        cdef double dv
        if self.kind == KIND_BYTES:
            if PyBytes_CheckExact(rec):
                n = PyBytes_GET_SIZE(rec)
                if n > self.max_record_size:
                    self._too_large(n)
                return self._write_raw(ch, PyBytes_AS_STRING(rec), <uint32_t>n)
            if isinstance(rec, str):
                raise TypeError("a bytes stream got a str record; encode it or use kind='str'")
            PyObject_GetBuffer(rec, &view, PyBUF_SIMPLE)
            try:
                if view.len > self.max_record_size:
                    self._too_large(view.len)
                self._write_raw(ch, <const char *>view.buf, <uint32_t>view.len)
            finally:
                PyBuffer_Release(&view)
            return 0
        if self.kind == KIND_INT64:
            if isinstance(rec, float) or isinstance(rec, bool):
                raise TypeError(f"an int64 stream got a {type(rec).__name__} record")
            iv = PyLong_AsLongLong(rec)
            fb_store_le64(tmp, <uint64_t>iv)
            return self._write_raw(ch, tmp, 8)
        if self.kind == KIND_FLOAT64:
            dv = PyFloat_AsDouble(rec)
            memcpy(tmp, &dv, 8)
            return self._write_raw(ch, tmp, 8)
        if self.kind == KIND_STR:
            if not isinstance(rec, str):
                raise TypeError(f"a str stream got a {type(rec).__name__} record")
            p = PyUnicode_AsUTF8AndSize(rec, &n)
            if n > self.max_record_size:
                self._too_large(n)
            return self._write_raw(ch, p, <uint32_t>n)
        data = _pickle_dumps(rec, 5)
        n = PyBytes_GET_SIZE(data)
        if n > self.max_record_size:
            self._too_large(n)
        return self._write_raw(ch, PyBytes_AS_STRING(data), <uint32_t>n)

    def _too_large(self, Py_ssize_t n):
        raise _errors.RecordTooLargeError(
            f"record of {n} bytes exceeds max_record_size={self.max_record_size}")

    cdef int _channel(self, int ch) except -1:
        if not 0 <= ch < self.num_channels:
            raise IndexError(f"subpartition {ch} out of range (writer has {self.num_channels})")
        return ch

    def write(self, record):
        """Write one record to subpartition 0."""
        return self._write_obj(0, record)

    def write_to(self, record, int channel):
        """Write one record to ``channel``."""
        return self._write_obj(self._channel(channel), record)

    def write_batch(self, records, int channel=0):
        """Write a list of records to one subpartition in a single call.

        On a bad record the records before it are written, nothing of it is,
        and the error says which index failed."""
        self._channel(channel)
        return self._write_many(records, 0, channel, None)

    def write_batch_rebalance(self, records):
        """Round-robin over subpartitions, record by record (Flink's rebalance)."""
        return self._write_many(records, 1, 0, None)

    def write_batch_keyed(self, records, keys):
        """Send each record to ``stable_hash(key) % num_channels``."""
        return self._write_many(records, 2, 0, keys)

    def write_batch_broadcast(self, records):
        """Write every record to every subpartition."""
        return self._write_many(records, 3, 0, None)

    def write_batch_to(self, records, channels):
        """Write record i to subpartition ``channels[i]``."""
        return self._write_many(records, 4, 0, channels)

    cdef object _write_many(self, records, int mode, int channel, object keys):
        if not isinstance(records, list):
            records = list(records)
        cdef Py_ssize_t i = 0, n = PyList_GET_SIZE(records)
        cdef int ch = channel, j
        cdef int nch = self.num_channels
        if keys is not None:
            if not isinstance(keys, list):
                keys = list(keys)
            if len(keys) != n:
                raise ValueError(f"got {n} records but {len(keys)} keys/channels")
        try:
            for i in range(n):
                rec = <object>PyList_GET_ITEM(records, i)
                if mode == 1:
                    ch = self.rr_next
                    self.rr_next = ch + 1 if ch + 1 < nch else 0
                elif mode == 2:
                    ch = <int>(_stable_hash(<object>PyList_GET_ITEM(keys, i)) % <uint64_t>nch)
                elif mode == 4:
                    ch = self._channel(<object>PyList_GET_ITEM(keys, i))
                if mode == 3:
                    for j in range(nch):
                        self._write_obj(j, rec)
                else:
                    self._write_obj(ch, rec)
        except Exception as exc:
            if isinstance(exc, _errors.FlowBufError) and not isinstance(exc, ValueError):
                raise  # no buffer / cancelled / destroyed: not about this record
            msg = f"record {i} of the batch ({i} written before it): {exc}"
            try:
                new = type(exc)(msg)
            except Exception:  # e.g. UnicodeEncodeError takes 5 arguments
                new = (TypeError if isinstance(exc, TypeError) else ValueError)(msg)
            raise new from exc
        return n

    def write_array(self, arr, int channel=0):
        """Write the rows of a NumPy array (any fixed-width dtype, structured
        ones too) as fixed-width records: one memcpy per buffer, GIL released."""
        self._channel(channel)
        if self._is_broken:
            raise _errors.ChannelClosedError(self.broken)
        a = np.ascontiguousarray(arr)
        cdef Py_ssize_t w = a.itemsize
        cdef Py_ssize_t count = a.size if a.ndim <= 1 else a.shape[0]
        if a.ndim > 1:
            w = a.itemsize * (a.size // a.shape[0]) if a.shape[0] else a.itemsize
        if w <= 0 or w > self.a.segment_size:
            raise ValueError(f"fixed-width record of {w} bytes does not fit a {self.a.segment_size} B segment; "
                             "use write_batch for variable-size records")
        cdef const unsigned char[::1] src = a.reshape(-1).view(np.uint8) if a.size else np.empty(0, np.uint8)
        cdef const char *p = <const char *>&src[0] if src.shape[0] else NULL
        cdef Builder *b = &self.builders[channel]
        cdef Py_ssize_t left = count, k
        while left > 0:
            if b.active and (b.type != FB_DATA_FIXED or b.width != w or b.cap - b.pos < w):
                self._finish(channel)
            if not b.active:
                self._new_segment(channel, FB_DATA_FIXED, <uint32_t>w)
            k = (b.cap - b.pos) // w
            if k > left:
                k = left
            with nogil:
                memcpy(b.base + b.pos, p, k * w)
            b.pos += <uint32_t>(k * w)
            p += k * w
            left -= k
            if b.cap - b.pos < w:
                self._finish(channel)
        self.records_out += count
        self.bytes_out += count * w
        return count

    def flush(self, int channel=-1):
        """Hand every partly filled buffer to its consumer now."""
        cdef int i
        if channel >= 0:
            self._finish(self._channel(channel))
        else:
            for i in range(self.num_channels):
                self._finish(i)

    def broadcast_event(self, int kind, long long aux=0, int flags=0, bint priority=False):
        """Flush, then send an event to every subpartition. A priority event
        (unaligned barrier) overtakes buffers already queued."""
        if self.ended:
            raise _errors.ChannelClosedError("end_input() was called: the subpartitions have ended")
        if not priority:
            self.flush()
        for q in self.queues:
            (<BufferQueue>q).push_event(kind, aux, flags, priority)

    def end_input(self):
        """Flush and send end-of-partition to every consumer."""
        if self.ended:
            return
        self.broadcast_event(EVT_END_OF_PARTITION)
        self.ended = True
        if not self._is_broken:
            # the same flag as a cut record: refuses writes at no cost on the fast path
            self._is_broken = True
            self.broken = "end_input() was called: the subpartitions have ended"

    def cancel(self):
        """Wake a writer parked on a dry pool or full queue; it raises CancelledError."""
        self.pool.cancel_waiters()
        for q in self.queues:
            (<BufferQueue>q).cancel()

    @property
    def pending_bytes(self):
        """Bytes written into buffers not yet handed over."""
        cdef int i
        cdef uint64_t t = 0
        for i in range(self.num_channels):
            if self.builders[i].active:
                t += self.builders[i].pos
        return t


@cython.final
cdef class RecordReader:
    """Reads records from an InputGate, one deserializer per channel.

    A record that lies inside one buffer is read in place: at least
    ``zero_copy_min`` bytes come back as a read-only memoryview over the
    segment (the segment is not recycled while the view lives), smaller ones as
    ``bytes`` because copying a few bytes costs less than creating a view. A
    record spanning buffers is assembled once into a new ``bytes``.
    """

    def __cinit__(self, gate, kind="bytes", zero_copy_min=DEFAULT_ZERO_COPY_MIN,
                  max_record_size=DEFAULT_MAX_RECORD_SIZE):
        if isinstance(gate, BufferQueue):
            gate = InputGate([gate])
        if not isinstance(gate, InputGate):
            raise TypeError(f"gate must be an InputGate or BufferQueue, got {type(gate).__name__}")
        if zero_copy_min < 0:
            raise ValueError(f"zero_copy_min must be >= 0, got {zero_copy_min}")
        self.gate = gate
        self.kind = _kind_code(kind)
        if not isinstance(max_record_size, int) or not 0 < max_record_size < (1 << 32):
            raise ValueError(f"max_record_size must be in 1..2**32-1, got {max_record_size!r}")
        self.zero_copy_min = zero_copy_min
        self.max_record_size = max_record_size
        self.nch = self.gate.num_channels
        q0 = self.gate.channels[0]
        self.arena_owner = (<BufferQueue>q0).network_pool
        for q in self.gate.channels:
            if (<BufferQueue>q).network_pool is not self.arena_owner:
                raise ValueError("all channels of a RecordReader's gate must share one NetworkBufferPool")
        self.a = self.arena_owner.a
        self.chs = <ChanState *>PyMem_Calloc(self.nch, sizeof(ChanState))
        if self.chs is NULL:
            raise MemoryError()
        self.cur_ch = -1

    def __dealloc__(self):
        cdef int i
        cdef ChanState *c
        if self.chs is NULL:
            return
        for i in range(self.nch):
            c = &self.chs[i]
            Py_XDECREF(c.partial)
            if c.has_cur:
                if c.cur_buf is not NULL:
                    Py_DECREF(<object>c.cur_buf)  # its dealloc recycles once views are gone
                elif c.cur.pool is not NULL:
                    fb_pool_recycle(c.cur.pool, c.cur.seg)
        PyMem_Free(self.chs)

    cdef int _release_current(self, ChanState *c) except -1:
        cdef PyObject *b = c.cur_buf
        c.has_cur = 0
        if b is not NULL:
            c.cur_buf = NULL
            (<Buffer>b).release_or_defer()
            Py_DECREF(<object>b)
        elif c.cur.pool is not NULL:
            fb_pool_recycle(c.cur.pool, c.cur.seg)
        return 0

    cdef object _make(self, ChanState *c, const char *p, uint32_t n):
        cdef Buffer buf
        cdef double dv
        if self.kind == KIND_BYTES:
            if n >= self.zero_copy_min:
                if c.cur_buf is NULL:
                    buf = Buffer.wrap(&c.cur, self.arena_owner)
                    Py_INCREF(buf)
                    c.cur_buf = <PyObject *>buf
                return RecordView.memoryview_of(<Buffer>c.cur_buf, <char *>p, n)
            return PyBytes_FromStringAndSize(p, n)
        if self.kind == KIND_INT64:
            if n != 8:
                raise _errors.CorruptRecordError(f"int64 record of {n} bytes")
            return PyLong_FromLongLong(<long long>fb_load_le64(p))
        if self.kind == KIND_FLOAT64:
            if n != 8:
                raise _errors.CorruptRecordError(f"float64 record of {n} bytes")
            memcpy(&dv, p, 8)
            return PyFloat_FromDouble(dv)
        if self.kind == KIND_STR:
            return PyUnicode_DecodeUTF8(p, n, "strict")
        mv = PyMemoryView_FromMemory(<char *>p, n, 0x100)
        try:
            return _pickle_loads(mv)
        finally:
            mv.release()

    cdef int _check_len(self, uint32_t n) except -1:
        if n > self.max_record_size:
            raise _errors.CorruptRecordError(
                f"record length {n} exceeds max_record_size={self.max_record_size}")
        return 0

    cdef object _decode_one(self, ChanState *c):
        cdef uint32_t size = c.cur.size, rem, n, take
        cdef const char *p
        if c.pos >= size:
            return _NEED_MORE
        rem = size - c.pos
        if c.cur.type == FB_DATA_FIXED:
            n = c.cur.width
            if rem < n:
                raise _errors.CorruptRecordError(f"fixed-width buffer ends inside a {n}-byte record")
            p = c.base + c.pos
            c.pos += n
            return self._make(c, p, n)
        if c.partial is NULL and c.hdr_have == 0:
            if rem >= 4:
                n = fb_load_le32(c.base + c.pos)
                self._check_len(n)
                if rem - 4 >= n:
                    p = c.base + c.pos + 4
                    c.pos += 4 + n
                    return self._make(c, p, n)
                return self._start_partial(c, n, c.base + c.pos + 4, rem - 4)
            memcpy(c.hdr, c.base + c.pos, rem)
            c.hdr_have = rem
            c.pos = size
            return _NEED_MORE
        if c.hdr_have > 0:
            take = 4 - c.hdr_have
            if take > rem:
                take = rem
            memcpy(c.hdr + c.hdr_have, c.base + c.pos, take)
            c.hdr_have += take
            c.pos += take
            rem -= take
            if c.hdr_have < 4:
                return _NEED_MORE
            c.hdr_have = 0
            n = fb_load_le32(c.hdr)
            self._check_len(n)
            if rem >= n:
                p = c.base + c.pos
                c.pos += n
                return self._make(c, p, n)
            return self._start_partial(c, n, c.base + c.pos, rem)
        take = c.partial_len - c.partial_have
        if take > rem:
            take = rem
        memcpy(PyBytes_AS_STRING_raw(c.partial) + c.partial_have, c.base + c.pos, take)
        c.partial_have += take
        c.pos += take
        if c.partial_have < c.partial_len:
            return _NEED_MORE
        obj = <object>c.partial
        Py_DECREF(obj)  # drop the reference the state held; `obj` keeps one
        c.partial = NULL
        if self.kind == KIND_BYTES:
            return obj
        return self._make_from_assembled(obj)

    cdef object _start_partial(self, ChanState *c, uint32_t n, const char *src, uint32_t have):
        c.partial = PyBytes_FromStringAndSize_raw(NULL, n)
        memcpy(PyBytes_AS_STRING_raw(c.partial), src, have)
        c.partial_len = n
        c.partial_have = have
        c.pos = c.cur.size
        return _NEED_MORE

    cdef object _make_from_assembled(self, object b):
        # only for typed kinds: _make decodes them without looking at the channel
        cdef ChanState tmp
        tmp.cur_buf = NULL
        return self._make(&tmp, PyBytes_AS_STRING(b), <uint32_t>PyBytes_GET_SIZE(b))

    cdef int _next_buffer(self, int64_t timeout_ns) except -2:
        """Take the next buffer from the gate. Returns 1 with cur_ch set, 0 when
        nothing came (timeout, event pending, or all channels finished)."""
        cdef fb_bufdesc d
        cdef int ch = -1, rc
        cdef ChanState *c
        cdef InputGate gate = self.gate
        cdef int64_t deadline = fb_monotonic_ns() + timeout_ns if timeout_ns > 0 else -1
        while True:
            if self._event is not None or self.finished_count >= self.nch:
                return 0
            rc = gate.poll(&d, &ch)
            if rc == FB_E_UNAVAILABLE and timeout_ns != 0:
                if deadline >= 0:
                    timeout_ns = deadline - fb_monotonic_ns()
                    if timeout_ns < 0:
                        timeout_ns = 0
                with nogil:
                    rc = gate.poll_wait(&d, &ch, timeout_ns)
            if rc == FB_E_UNAVAILABLE or rc == FB_E_TIMEOUT:
                return 0
            check(rc, "reading the input gate")
            c = &self.chs[ch]
            if d.type != FB_DATA_EVENT:
                break
            if d.width != EVT_END_OF_PARTITION:
                self._event = (ch, d.width, d.aux, d.flags)
                return 0
            if c.partial is not NULL or c.hdr_have:
                raise _errors.CorruptRecordError(
                    f"channel {ch} ended inside a record (truncated stream)")
            if not c.finished:  # a repeated end-of-partition must not end another channel
                c.finished = 1
                self.finished_count += 1
            # one channel ended: go on with the others (the loop top stops after the last)
        self.buffers_in += 1
        self.bytes_in += d.size
        c.cur = d
        c.base = fb_segment_ptr(self.a, d.seg)
        c.pos = 0
        c.has_cur = 1
        c.cur_buf = NULL
        self.cur_ch = ch
        return 1

    cdef object _next_record(self, int64_t timeout_ns):
        """A record, or _NEED_MORE when none is available within the timeout."""
        cdef ChanState *c
        cdef int64_t deadline = -1
        while True:
            if self.cur_ch >= 0:
                c = &self.chs[self.cur_ch]
                rec = self._decode_one(c)
                if rec is not _NEED_MORE:
                    self.records_in += 1
                    if c.pos >= c.cur.size:
                        # consumed: give the segment back now, not at the next read
                        self._release_current(c)
                        self.cur_ch = -1
                    return rec
                self._release_current(c)
                self.cur_ch = -1
            if not self._next_buffer(timeout_ns):
                return _NEED_MORE

    def poll(self):
        """The next record if one is available now, else None."""
        rec = self._next_record(0)
        return None if rec is _NEED_MORE else rec

    def read(self, timeout=None):
        """The next record, waiting up to ``timeout`` s (None: until one comes).
        Returns None on timeout, at an event (see ``take_event``) and at the end."""
        rec = self._next_record(_timeout_ns(timeout))
        return None if rec is _NEED_MORE else rec

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            rec = self._next_record(-1)
            if rec is not _NEED_MORE:
                return rec
            if self.finished_count >= self.nch:
                raise StopIteration
            if self._event is not None:
                self._event = None  # plain iteration skips events

    def read_batch(self, Py_ssize_t max_records=4096, timeout=None):
        """Up to ``max_records`` records in one call. Blocks (GIL released) for
        the first one up to ``timeout`` s; returns early, possibly empty, at an
        event or the end of input."""
        cdef list out = []
        cdef int64_t t = _timeout_ns(timeout)
        cdef ChanState *c
        while PyList_GET_SIZE(out) < max_records:
            if self.cur_ch >= 0:
                c = &self.chs[self.cur_ch]
                rec = self._decode_one(c)
                if rec is not _NEED_MORE:
                    PyList_Append(out, rec)
                    if c.pos < c.cur.size:
                        continue
                    rec = _NEED_MORE
                self._release_current(c)
                self.cur_ch = -1
            if not self._next_buffer(0 if PyList_GET_SIZE(out) else t):
                break
        self.records_in += PyList_GET_SIZE(out)
        return out

    def read_array(self, dtype, timeout=None):
        """The rest of the next fixed-width buffer as a read-only NumPy view
        (zero copy; the segment is held until the array is gone). None on
        timeout, at an event or at the end."""
        cdef cnp.dtype dt = dtype if type(dtype) is not type and isinstance(dtype, np.dtype) else np.dtype(dtype)
        cdef ChanState *c
        cdef int64_t t = _timeout_ns(timeout)
        cdef Buffer buf
        while True:
            if self.cur_ch >= 0:
                c = &self.chs[self.cur_ch]
                if c.pos < c.cur.size:
                    break
                self._release_current(c)
                self.cur_ch = -1
            if not self._next_buffer(t):
                return None
        if c.cur.type != FB_DATA_FIXED:
            raise TypeError("read_array() got a buffer of variable-size records; use read_batch()")
        if c.cur.width != dt.itemsize:
            raise ValueError(f"buffer holds {c.cur.width}-byte records, dtype {dt} has itemsize {dt.itemsize}")
        if c.cur_buf is NULL:
            buf = Buffer.wrap(&c.cur, self.arena_owner)
            Py_INCREF(buf)
            c.cur_buf = <PyObject *>buf
        # A NumPy array straight over the segment, its base the view that keeps
        # the segment from being recycled: no memoryview, no np.frombuffer.
        rv = RecordView.new(<Buffer>c.cur_buf, c.base + c.pos, c.cur.size - c.pos)
        cdef cnp.npy_intp dims[1]
        dims[0] = (c.cur.size - c.pos) // c.cur.width
        Py_INCREF(dt)  # NewFromDescr steals a reference
        arr = PyArray_NewFromDescr(<PyTypeObject *>np.ndarray, dt, 1, dims, NULL, c.base + c.pos, 0, None)
        Py_INCREF(rv)  # SetBaseObject steals one too
        cnp.PyArray_SetBaseObject(arr, rv)
        self.records_in += (c.cur.size - c.pos) // c.cur.width
        c.pos = c.cur.size
        self._release_current(c)
        self.cur_ch = -1
        return arr

    def set_kind(self, kind):
        """Set the record kind before the first record is decoded (the runtime
        learns an inferred kind from the producer)."""
        self.kind = _kind_code(kind)

    def take_event(self):
        """The pending event as ``(channel, kind, aux, flags)``, or None."""
        ev = self._event
        self._event = None
        return ev

    @property
    def finished(self):
        """True once every channel delivered end-of-partition."""
        return self.finished_count >= self.nch

    @property
    def channels_finished(self):
        return tuple(bool(self.chs[i].finished) for i in range(self.nch))

    @property
    def held_buffers(self):
        """Buffers this reader holds (current ones, views not counted)."""
        return sum(1 for i in range(self.nch) if self.chs[i].has_cur)
