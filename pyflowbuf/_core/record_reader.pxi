# Part of serde.pyx (included; one module, pyflowbuf._core.serde): the
# RecordReader, built on the per-channel deserializer (record_deserializer.pxi).
# Uses the cimports at the top of serde.pyx.


@cython.final
cdef class RecordReader(_RecordDeserializer):
    """Reads records from an InputGate, one deserializer per channel.

    A record that lies inside one buffer is read in place: at least
    ``zero_copy_min`` bytes come back as a read-only memoryview over the
    segment (the segment is not recycled while the view lives), smaller ones as
    ``bytes`` because copying a few bytes costs less than creating a view. A
    record spanning buffers is assembled once into a new ``bytes``.

    ``timestamped=True`` reads a stream a timestamped RecordWriter wrote:
    after ``read_batch`` the attribute ``timestamps`` holds the batch's times
    (an ``array('d')``, one per record), after a per-record read
    ``last_timestamp`` the record's.
    """
    # The deserializer's methods are called as _RecordDeserializer.<name>(self, ...):
    # a direct C call on the per-record path, where self.<name>(...) would go
    # through the vtable (Cython does not treat them as final from a subclass).

    def __cinit__(self, gate, kind="bytes", zero_copy_min=DEFAULT_ZERO_COPY_MIN,
                  max_record_size=DEFAULT_MAX_RECORD_SIZE, timestamped=False):
        if isinstance(gate, BufferQueue):
            gate = InputGate([gate])
        if not isinstance(gate, InputGate):
            raise TypeError(f"gate must be an InputGate or BufferQueue, got {type(gate).__name__}")
        if zero_copy_min < 0:
            raise ValueError(f"zero_copy_min must be >= 0, got {zero_copy_min}")
        self.gate = gate
        self.kind = _kind_code(kind)
        self.timestamped = bool(timestamped)
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
        self.recording = <unsigned char *>PyMem_Calloc(self.nch, 1)
        if self.chs is NULL or self.recording is NULL:
            raise MemoryError()
        self.cur_ch = -1
        self.recorded = [[] for _ in range(self.nch)]

    def __dealloc__(self):
        # the channel states are freed by _RecordDeserializer.__dealloc__, which runs after this
        PyMem_Free(self.recording)

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
            if self._replay:
                return self._next_replayed()
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
                if self.recording[ch]:
                    self._record(ch, &d)
                break
            if d.width != FB_EVT_END_OF_PARTITION:
                self._event = (ch, d.width, d.aux, d.flags)
                self.event_mark = d.seg
                if self.recording[ch] and d.width != FB_EVT_BARRIER and d.width != FB_EVT_CANCEL_BARRIER:
                    self._record(ch, &d)
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

    cdef int _record(self, int ch, fb_bufdesc *d) except -1:
        """A copy of a buffer (or event) taken from a recorded channel: the
        segment is recycled as usual once read, the copy goes to the checkpoint."""
        cdef object payload = None
        if d.type != FB_DATA_EVENT:
            payload = PyBytes_FromStringAndSize(fb_segment_ptr(self.a, d.seg), d.size)
        (<list>self.recorded[ch]).append((d.type, d.width, d.flags, d.aux, payload))
        return 0

    cdef int _next_replayed(self) except -2:
        """The next item of in-flight input being replayed after a restore."""
        cdef int ch
        cdef ChanState *c
        ch, item = self._replay.popleft()
        dtype, width, flags, aux, payload = item
        if dtype == FB_DATA_EVENT:
            self._event = (ch, width, aux, flags)
            return 0
        c = &self.chs[ch]
        self._replay_cur = payload
        c.cur.pool = NULL
        c.cur.seg = 0
        c.cur.size = <uint32_t>len(payload)
        c.cur.width = width
        c.cur.type = dtype
        c.cur.flags = flags
        c.cur.aux = aux
        c.base = PyBytes_AS_STRING(payload)
        c.pos = 0
        c.has_cur = 1
        c.cur_buf = NULL
        self.buffers_in += 1
        self.bytes_in += c.cur.size
        self.cur_ch = ch
        return 1

    # ---- unaligned checkpoints ----
    def poll_priority(self):
        """Take an event from a priority lane now, leaving all data where it
        is: a task waiting for output buffers (backpressure) still takes an
        overtaking barrier. ``(channel, kind, aux, flags)`` or None."""
        cdef fb_bufdesc d
        cdef int ch
        cdef InputGate gate = self.gate
        if self._event is not None or self._replay:
            return None
        for ch in range(self.nch):
            if gate.poll_priority(&d, ch) == FB_OK:
                if d.type != FB_DATA_EVENT:
                    raise _errors.CorruptRecordError(f"a data buffer in the priority lane of channel {ch}")
                self.event_mark = d.seg
                return (ch, d.width, d.aux, d.flags)
        return None

    def start_recording(self, int ch):
        """Record a copy of every buffer (and event) taken from ``ch`` from now
        on: in-flight input of an unaligned checkpoint."""
        self._ch_index(ch)
        self.recording[ch] = 1

    def stop_recording(self, int ch):
        """Stop recording ``ch``; returns what was recorded, in order."""
        self._ch_index(ch)
        self.recording[ch] = 0
        out = self.recorded[ch]
        self.recorded[ch] = []
        return out

    def is_recording(self, int ch):
        return bool(self.recording[self._ch_index(ch)])

    def unread_prefix(self, int ch):
        """What this reader took from ``ch`` but has not handed out yet, as one
        data item (or None): the start of a record that spans buffers, the
        rest of a buffer left after a batch ended mid-buffer, or both (the
        start, then the buffer that continues it, already taken from the gate
        by a batch that ended there). After a restore it is read again first,
        so a record cut by the snapshot is whole."""
        cdef ChanState *c = &self.chs[self._ch_index(ch)]
        cdef bytes data
        # The start of a cut record and the rest of the current buffer can
        # both be held: a batch that ends with the buffer that began the
        # record already took the next buffer of the channel (unread, pos 0).
        # Both go into the prefix, in that order, or the record's continuation
        # is in neither the prefix nor the recording.
        cdef bint rest = self.cur_ch == ch and c.has_cur and c.pos < c.cur.size
        if c.partial is not NULL:
            data = (<uint32_t>c.partial_len).to_bytes(4, "little") + \
                PyBytes_FromStringAndSize(PyBytes_AS_STRING(<object>c.partial), c.partial_have)
        elif c.hdr_have:
            data = PyBytes_FromStringAndSize(c.hdr, c.hdr_have)
        elif rest:
            data = PyBytes_FromStringAndSize(c.base + c.pos, c.cur.size - c.pos)
            return (c.cur.type, c.cur.width, 0, 0, data)
        else:
            return None
        if rest:
            data += PyBytes_FromStringAndSize(c.base + c.pos, c.cur.size - c.pos)
        return (FB_DATA_RECORDS, 0, 0, 0, data)

    def replay(self, items):
        """In-flight input to read before anything from the gate: an iterable
        of ``(channel, (type, width, flags, aux, payload))`` in order."""
        import collections
        for ch, item in items:
            self._ch_index(ch)
            if item[0] != FB_DATA_EVENT and not isinstance(item[4], bytes):
                raise TypeError("a replayed data item needs bytes as its payload")
        if self._replay is None:
            self._replay = collections.deque()
        self._replay.extend(items)

    def take_over(self, RecordReader old not None):
        """Carry recording and replay state over from the reader this one
        replaces (nothing was decoded by the old one)."""
        if old.nch != self.nch:
            raise ValueError("readers of different gates")
        memcpy(self.recording, old.recording, self.nch)
        self.recorded = old.recorded
        old.recorded = [[] for _ in range(old.nch)]
        self._replay, old._replay = old._replay, None

    @property
    def replaying(self):
        return bool(self._replay) or self._replay_cur is not None

    cdef int _ch_index(self, int ch) except -1:
        if not 0 <= ch < self.nch:
            raise IndexError(f"channel {ch} out of range (reader has {self.nch})")
        return ch

    cdef object _next_record(self, int64_t timeout_ns):
        """A record, or _NEED_MORE when none is available within the timeout."""
        cdef ChanState *c
        cdef int64_t deadline = -1
        while True:
            if self.cur_ch >= 0:
                c = &self.chs[self.cur_ch]
                rec = _RecordDeserializer._decode_one(self, c)
                if rec is not _NEED_MORE:
                    self.records_in += 1
                    if c.pos >= c.cur.size:
                        # consumed: give the segment back now, not at the next read
                        _RecordDeserializer._release_current(self, c)
                        self.cur_ch = -1
                    return rec
                _RecordDeserializer._release_current(self, c)
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
        cdef bint stamped = self.timestamped
        cdef double *grown
        if stamped and self.tscap < max_records:
            grown = <double *>PyMem_Realloc(self.tsbuf, max(max_records, 1) * sizeof(double))
            if grown is NULL:
                raise MemoryError()
            self.tsbuf, self.tscap = grown, max(max_records, 1)
        while PyList_GET_SIZE(out) < max_records:
            if self.cur_ch >= 0:
                c = &self.chs[self.cur_ch]
                rec = _RecordDeserializer._decode_one(self, c)
                if rec is not _NEED_MORE:
                    if stamped:
                        self.tsbuf[PyList_GET_SIZE(out)] = self.last_ts
                    PyList_Append(out, rec)
                    if c.pos < c.cur.size:
                        continue
                    rec = _NEED_MORE
                _RecordDeserializer._release_current(self, c)
                self.cur_ch = -1
            if not self._next_buffer(0 if PyList_GET_SIZE(out) else t):
                break
        self.records_in += PyList_GET_SIZE(out)
        if stamped:
            self.timestamps = _ts_array(self.tsbuf, PyList_GET_SIZE(out))
        return out

    @property
    def last_timestamp(self):
        """A timestamped reader: the time of the record read last (read, poll,
        iteration); None on a reader without timestamps."""
        return self.last_ts if self.timestamped else None

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
                _RecordDeserializer._release_current(self, c)
                self.cur_ch = -1
            if not self._next_buffer(t):
                return None
        if self.timestamped:
            raise TypeError("read_array() on a timestamped reader: fixed-width rows carry no timestamps")
        if c.cur.type != FB_DATA_FIXED:
            raise TypeError("read_array() got a buffer of variable-size records; use read_batch()")
        if c.cur.width != dt.itemsize:
            raise ValueError(f"buffer holds {c.cur.width}-byte records, dtype {dt} has itemsize {dt.itemsize}")
        if c.cur.pool is NULL:      # replayed after a restore: over its bytes
            arr = np.frombuffer(self._replay_cur, dtype=dt, offset=c.pos)
            self.records_in += arr.shape[0]
            c.pos = c.cur.size
            _RecordDeserializer._release_current(self, c)
            self.cur_ch = -1
            return arr
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
        _RecordDeserializer._release_current(self, c)
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
    def num_channels(self):
        return self.nch

    def channel_finished(self, int ch):
        """True once channel ``ch`` delivered end-of-partition: barrier
        alignment waits for no barrier from a channel that has ended."""
        if not 0 <= ch < self.nch:
            raise IndexError(f"channel {ch} out of range (reader has {self.nch})")
        return bool(self.chs[ch].finished)

    @property
    def held_buffers(self):
        """Buffers this reader holds (current ones, views not counted)."""
        return sum(1 for i in range(self.nch) if self.chs[i].has_cur)
