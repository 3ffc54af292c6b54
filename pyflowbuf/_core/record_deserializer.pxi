# Part of serde.pyx (included; one module, pyflowbuf._core.serde): the
# per-channel record deserializer a RecordReader is built on. Uses the
# cimports at the top of serde.pyx and the struct codec (serde_struct.pxi).


cdef class _RecordDeserializer:
    """The per-channel half of a RecordReader: one state per input channel that
    reassembles length-prefixed records spanning buffers, and the decoding of a
    record's bytes by the stream's kind. RecordReader (the only class derived
    from it) sets it up and adds the gate, events and unaligned checkpoints;
    its methods are final, so the reader calls them directly."""

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
        PyMem_Free(self.tsbuf)

    @cython.final
    cdef int _strip_ts(self, const char **p, uint32_t *n) except -1:
        """A timestamped stream's record: its time (the first 8 bytes) into
        ``last_ts``, and ``p``/``n`` moved past it to the payload."""
        cdef uint64_t u
        if n[0] < 8:
            raise _errors.CorruptRecordError(
                f"a record of {n[0]} bytes on a timestamped stream, which frames 8 bytes of time with each")
        u = fb_load_le64(p[0])
        memcpy(&self.last_ts, &u, 8)
        p[0] += 8
        n[0] -= 8
        return 0

    @cython.final
    cdef int _release_current(self, ChanState *c) except -1:
        cdef PyObject *b = c.cur_buf
        c.has_cur = 0
        if b is not NULL:
            c.cur_buf = NULL
            (<Buffer>b).release_or_defer()
            Py_DECREF(<object>b)
        elif c.cur.pool is not NULL:
            fb_pool_recycle(c.cur.pool, c.cur.seg)
        else:
            self._replay_cur = None     # a replayed buffer: its bytes were the memory
        return 0

    @cython.final
    cdef object _make(self, ChanState *c, const char *p, uint32_t n):
        cdef Buffer buf
        cdef double dv
        cdef uint64_t u
        if self.kind == KIND_BYTES:
            if n >= self.zero_copy_min and c.cur.pool is not NULL:
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
        if self.kind == KIND_NUMBER:
            if n == 8:
                return PyLong_FromLongLong(<long long>fb_load_le64(p))
            if n == 9 and <unsigned char>p[0] == S_FLOAT:
                u = fb_load_le64(p + 1)
                memcpy(&dv, &u, 8)
                return PyFloat_FromDouble(dv)
            return _unpack_record(p, n)
        if self.kind == KIND_STRUCT:
            return _unpack_record(p, n)
        mv = PyMemoryView_FromMemory(<char *>p, n, 0x100)
        try:
            return _pickle_loads(mv)
        finally:
            mv.release()

    @cython.final
    cdef int _check_len(self, uint32_t n) except -1:
        if n > self.max_record_size:
            raise _errors.CorruptRecordError(
                f"record length {n} exceeds max_record_size={self.max_record_size}")
        return 0

    @cython.final
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
                    if self.timestamped:
                        self._strip_ts(&p, &n)
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
                if self.timestamped:
                    self._strip_ts(&p, &n)
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
        if self.timestamped:
            p = PyBytes_AS_STRING(obj)
            n = <uint32_t>PyBytes_GET_SIZE(obj)
            self._strip_ts(&p, &n)
            if self.kind == KIND_BYTES:
                return PyBytes_FromStringAndSize(p, n)
            return self._make_from_ptr(p, n)
        if self.kind == KIND_BYTES:
            return obj
        return self._make_from_assembled(obj)

    @cython.final
    cdef object _start_partial(self, ChanState *c, uint32_t n, const char *src, uint32_t have):
        c.partial = PyBytes_FromStringAndSize_raw(NULL, n)
        memcpy(PyBytes_AS_STRING_raw(c.partial), src, have)
        c.partial_len = n
        c.partial_have = have
        c.pos = c.cur.size
        return _NEED_MORE

    @cython.final
    cdef object _make_from_assembled(self, object b):
        # only for typed kinds: _make decodes them without looking at the channel
        return self._make_from_ptr(PyBytes_AS_STRING(b), <uint32_t>PyBytes_GET_SIZE(b))

    @cython.final
    cdef object _make_from_ptr(self, const char *p, uint32_t n):
        cdef ChanState tmp
        tmp.cur_buf = NULL
        tmp.cur.pool = NULL
        return self._make(&tmp, p, n)
