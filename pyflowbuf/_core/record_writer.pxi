# Part of serde.pyx (included; one module, pyflowbuf._core.serde): the
# RecordWriter. Uses the cimports at the top of serde.pyx and the struct codec
# (serde_struct.pxi) for struct and number records.


cdef object _too_large(Py_ssize_t n, uint32_t limit):
    return _errors.RecordTooLargeError(f"record of {n} bytes exceeds max_record_size={limit}")


@cython.final
cdef class RecordWriter:
    """Serializes records into buffers of a LocalBufferPool and hands finished
    buffers to one BufferQueue per subpartition.

    A buffer is handed over when it is full, on ``flush()`` (the runtime calls
    it on the buffer timeout and before it idles) and before events. When the
    pool is dry the writer parks (GIL released) until the consumer recycles a
    buffer: that is the backpressure; the time is counted in
    ``backpressure_ns`` when the wait ends, and ``wait_since_ns`` says when
    the wait in progress began (0: none), so that a sample taken during a
    wait longer than its period counts it as backpressure, not as work.
    Both change only while the GIL is held: a reader holding it sees them
    consistent.

    ``timestamped=True``: every record travels with its event time (a float64
    of seconds framed ahead of the payload, inside the length): the batch
    calls then take ``timestamps``, a buffer of doubles (``array('d')``,
    a float64 NumPy array) with one time per record, and a RecordReader made
    with ``timestamped=True`` hands them back. Decided per stream when the
    writer is made: a stream without timestamps pays nothing.
    """

    def __cinit__(self, LocalBufferPool pool not None, queues, kind="bytes",
                  max_record_size=DEFAULT_MAX_RECORD_SIZE, request_timeout=None, timestamped=False):
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
        self.timestamped = bool(timestamped)
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
        PyMem_Free(self.pack.p)

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
            self.wait_since_ns = t0
            pool._waiters += 1
            try:
                with nogil:
                    rc = pool.request_wait(&seg, self.request_timeout_ns)
            finally:
                pool.leave_wait()
                # together, with the GIL held: never counted twice or not at all
                self.wait_since_ns = 0
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
        cdef uint32_t want = (<BufferQueue>self.queues[ch]).buffer_size
        if 0 < want < b.cap:
            b.cap = want    # buffer debloating: ship once the consumer's size is in
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
                if b.cap < n:
                    # a debloated size never refuses or shreds a record: its
                    # buffer may hold up to the rest of it (one segment at most)
                    b.cap = <uint32_t>min(<uint64_t>n, self.a.segment_size)
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
        cdef char tsb[8]
        cdef uint64_t bits
        if self._is_broken:
            raise _errors.ChannelClosedError(self.broken)
        if b.active and b.type != FB_DATA_RECORDS:
            self._finish(ch)
        fb_store_le32(hdr, n + 8 if self.timestamped else n)
        self._copied = 0
        try:
            self._copy_chunks(ch, hdr, 4)
            if self.timestamped:
                memcpy(&bits, &self._ts, 8)
                fb_store_le64(tsb, bits)
                self._copy_chunks(ch, tsb, 8)
            self._copy_chunks(ch, data, n)
        except BaseException as exc:
            if self._copied:
                # Part of the record is already in buffers (maybe shipped): later
                # records would be read as its rest. Refuse them; end_input()
                # still works, so the consumer sees a truncated stream, not garbage.
                self._is_broken = True
                self.broken = (f"subpartition {ch} holds a half-written record ({self._copied} of "
                               f"{n + 4 + 8 * self.timestamped} bytes) after {type(exc).__name__}: {exc}; the writer cannot "
                               "take more records")
            raise
        self.records_out += 1
        self.bytes_out += n + 8 * self.timestamped
        return 0

    cdef inline int _write_raw(self, int ch, const char *data, uint32_t n) except -1:
        cdef Builder *b = &self.builders[ch]
        cdef uint64_t bits
        if self.timestamped:
            if b.active and b.type == FB_DATA_RECORDS and b.cap - b.pos > n + 12 and not self._is_broken:
                fb_store_le32(b.base + b.pos, n + 8)
                memcpy(&bits, &self._ts, 8)
                fb_store_le64(b.base + b.pos + 4, bits)
                memcpy(b.base + b.pos + 12, data, n)
                b.pos += n + 12
                self.records_out += 1
                self.bytes_out += n + 8
                return 0
        elif b.active and b.type == FB_DATA_RECORDS and b.cap - b.pos > n + 4 and not self._is_broken:
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
        cdef char tmp[16]
        cdef long long iv
        cdef double dv
        cdef uint64_t bits
        cdef int overflow = 0
        if self.kind == KIND_BYTES:
            if PyBytes_CheckExact(rec):
                n = PyBytes_GET_SIZE(rec)
                if n > self.max_record_size:
                    raise _too_large(n, self.max_record_size)
                return self._write_raw(ch, PyBytes_AS_STRING(rec), <uint32_t>n)
            if isinstance(rec, str):
                raise TypeError("a bytes stream got a str record; encode it or use kind='str'")
            PyObject_GetBuffer(rec, &view, PyBUF_SIMPLE)
            try:
                if view.len > self.max_record_size:
                    raise _too_large(view.len, self.max_record_size)
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
                raise _too_large(n, self.max_record_size)
            return self._write_raw(ch, p, <uint32_t>n)
        if self.kind == KIND_NUMBER:
            # an int that fits 64 bits as int64 writes it, a float and a larger
            # int as the struct codec does: exact types, any int size
            if type(rec) is not int and type(rec) is not float:
                num = _as_number(rec)
                if num is None:
                    raise TypeError(f"a number stream takes int and float records, got {type(rec).__name__}")
                rec = num
            if type(rec) is float:
                dv = PyFloat_AS_DOUBLE(rec)
                memcpy(&bits, &dv, 8)
                tmp[0] = <char>S_FLOAT
                fb_store_le64(tmp + 1, bits)
                return self._write_raw(ch, tmp, 9)
            iv = PyLong_AsLongLongAndOverflow(rec, &overflow)
            if not overflow:
                # 8 bytes, as int64 writes it: a float is 9 and a larger int at least 11
                fb_store_le64(tmp, <uint64_t>iv)
                return self._write_raw(ch, tmp, 8)
            self.pack.len = 0
            _pack(&self.pack, rec, 0)
            return self._write_raw(ch, self.pack.p, <uint32_t>self.pack.len)
        if self.kind == KIND_STRUCT:
            self.pack.len = 0
            _pack(&self.pack, rec, 0)
            if self.pack.len > self.max_record_size:
                raise _too_large(self.pack.len, self.max_record_size)
            self._write_raw(ch, self.pack.p, <uint32_t>self.pack.len)
            if self.pack.cap > (1 << 20):
                # one huge record should not keep its scratch area for the writer's lifetime
                PyMem_Free(self.pack.p)
                self.pack.p = NULL
                self.pack.cap = 0
            return 0
        data = _pickle_dumps(rec, 5)
        n = PyBytes_GET_SIZE(data)
        if n > self.max_record_size:
            raise _too_large(n, self.max_record_size)
        return self._write_raw(ch, PyBytes_AS_STRING(data), <uint32_t>n)

    cdef int _channel(self, int ch) except -1:
        if not 0 <= ch < self.num_channels:
            raise IndexError(f"subpartition {ch} out of range (writer has {self.num_channels})")
        return ch

    cdef int _set_one_ts(self, timestamp) except -1:
        if self.timestamped:
            if timestamp is None:
                raise TypeError("this writer is timestamped: give each record its timestamp")
            self._ts = timestamp
        elif timestamp is not None:
            raise ValueError("a timestamp for a writer made without timestamped=True")
        return 0

    def write(self, record, timestamp=None):
        """Write one record to subpartition 0 (with its ``timestamp`` when the
        writer is timestamped)."""
        self._set_one_ts(timestamp)
        return self._write_obj(0, record)

    def write_to(self, record, int channel, timestamp=None):
        """Write one record to ``channel``."""
        self._set_one_ts(timestamp)
        return self._write_obj(self._channel(channel), record)

    def write_batch(self, records, int channel=0, timestamps=None):
        """Write a list of records to one subpartition in a single call.

        On a bad record the records before it are written, nothing of it is,
        and the error says which index failed. ``timestamps``: one float64
        per record, for a timestamped writer (and only for one)."""
        self._channel(channel)
        return self._write_many(records, 0, channel, None, timestamps, 0)

    def write_batch_rebalance(self, records, timestamps=None):
        """Round-robin over subpartitions, record by record (Flink's rebalance)."""
        return self._write_many(records, 1, 0, None, timestamps, 0)

    def write_batch_keyed(self, records, keys, timestamps=None, int max_parallelism=0):
        """Send each record to the subtask that owns its key.

        With ``max_parallelism`` > 0 (what jobs use) by key group: the key's
        group is ``key_group(key, max_parallelism)`` and channel ``c`` owns
        ``key_group_range(max_parallelism, num_channels, c)`` (Flink's
        KeyGroupRangeAssignment; one definition, in ``csrc/fb_serde.h``, for
        this routing and for state assignment), so state split by key group
        can be handed to another parallelism. With 0:
        ``stable_hash(key) % num_channels``."""
        if max_parallelism < 0 or (max_parallelism and max_parallelism < self.num_channels):
            raise ValueError(f"max_parallelism must be 0 or >= the {self.num_channels} channels, "
                             f"got {max_parallelism}")
        return self._write_many(records, 2, 0, keys, timestamps, <uint32_t>max_parallelism)

    def write_batch_broadcast(self, records, timestamps=None):
        """Write every record to every subpartition."""
        return self._write_many(records, 3, 0, None, timestamps, 0)

    def write_batch_to(self, records, channels, timestamps=None):
        """Write record i to subpartition ``channels[i]``."""
        return self._write_many(records, 4, 0, channels, timestamps, 0)

    cdef object _write_many(self, records, int mode, int channel, object keys, object timestamps,
                            uint32_t max_parallelism):
        if not isinstance(records, list):
            records = list(records)
        cdef Py_ssize_t i = 0, n = PyList_GET_SIZE(records)
        cdef int ch = channel, j
        cdef int nch = self.num_channels
        cdef const double[::1] tsv
        cdef const double *tsp = NULL
        cdef fb_key_router router
        fb_key_router_init(&router, <uint32_t>nch, max_parallelism)    # 0 unless keyed
        if keys is not None:
            if not isinstance(keys, list):
                keys = list(keys)
            if len(keys) != n:
                raise ValueError(f"got {n} records but {len(keys)} keys/channels")
        if self.timestamped:
            if timestamps is None:
                raise TypeError(f"this writer is timestamped: a batch of {n} records needs its timestamps")
            tsv = timestamps
            if tsv.shape[0] != n:
                raise ValueError(f"got {n} records but {tsv.shape[0]} timestamps")
            if n:
                tsp = &tsv[0]
        elif timestamps is not None:
            raise ValueError("timestamps for a writer made without timestamped=True")
        try:
            for i in range(n):
                rec = <object>PyList_GET_ITEM(records, i)
                if tsp is not NULL:
                    self._ts = tsp[i]
                if mode == 1:
                    ch = self.rr_next
                    self.rr_next = ch + 1 if ch + 1 < nch else 0
                elif mode == 2:
                    ch = <int>fb_key_router_channel(&router, _stable_hash(<object>PyList_GET_ITEM(keys, i)))
                elif mode == 4:
                    ch = self._channel(<object>PyList_GET_ITEM(keys, i))
                if mode == 3:
                    for j in range(nch):
                        self._write_obj(j, rec)
                else:
                    self._write_obj(ch, rec)
        except Exception as exc:
            if isinstance(exc, _errors.FlowBufError) and not isinstance(exc, (ValueError, TypeError)):
                raise  # no buffer / cancelled / destroyed: not about this record
            raise _at_index(exc, i, f"record {i} of the batch ({i} written before it): {exc}") from exc
        return n

    def write_array(self, arr, int channel=0):
        """Write the rows of a NumPy array (any fixed-width dtype, structured
        ones too) as fixed-width records: one memcpy per buffer, GIL released."""
        self._channel(channel)
        if self._is_broken:
            raise _errors.ChannelClosedError(self.broken)
        if self.timestamped:
            raise TypeError("fixed-width rows carry no timestamps: write_array on a timestamped writer")
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
                if b.cap < w:
                    b.cap = <uint32_t>w    # a debloated size still takes one row
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
        self.broadcast_event(FB_EVT_END_OF_PARTITION)
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
