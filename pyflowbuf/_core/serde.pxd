cimport cython
from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t

from pyflowbuf._core.channel cimport BufferQueue, InputGate
from pyflowbuf._core.memory cimport Buffer, LocalBufferPool, NetworkBufferPool
from pyflowbuf.includes.arena cimport fb_arena, fb_pool
from pyflowbuf.includes.ring cimport fb_bufdesc

cdef enum:
    KIND_BYTES = 0
    KIND_INT64 = 1
    KIND_FLOAT64 = 2
    KIND_STR = 3
    KIND_PICKLE = 4
    KIND_STRUCT = 5
    KIND_NUMBER = 6


cdef struct Packbuf:
    # a growable scratch area a struct record is encoded into before it is copied into segments
    char *p
    size_t len
    size_t cap


cdef struct Builder:
    uint32_t seg
    char *base
    uint32_t pos
    uint32_t cap
    uint16_t type
    uint32_t width
    int active


cdef struct ChanState:
    fb_bufdesc cur
    char *base
    uint32_t pos
    int has_cur
    char hdr[4]
    uint32_t hdr_have
    PyObject *partial
    uint32_t partial_len
    uint32_t partial_have
    PyObject *cur_buf
    int finished


cdef class RecordWriter:
    cdef LocalBufferPool pool
    cdef fb_pool *p
    cdef fb_arena *a
    cdef list queues
    cdef Builder *builders
    cdef readonly int num_channels
    cdef readonly int kind
    cdef readonly uint32_t max_record_size
    cdef int rr_next
    cdef public int64_t request_timeout_ns
    cdef readonly uint64_t records_out
    cdef readonly uint64_t bytes_out
    cdef readonly uint64_t buffers_out
    cdef readonly int64_t backpressure_ns
    cdef readonly int64_t wait_since_ns   # when the wait for a buffer in progress began; 0: none
    cdef readonly bint ended
    cdef readonly object broken    # why the writer cannot go on, or None
    cdef bint _is_broken
    cdef uint64_t _copied
    cdef Packbuf pack
    # a timestamped stream: every record is framed with its event time (8
    # bytes, float64) ahead of the payload; _ts is the one being written
    cdef readonly bint timestamped
    cdef double _ts
    cdef int _new_segment(self, int ch, uint16_t type, uint32_t width) except -1
    cdef int _finish(self, int ch) except -1
    cdef int _write_raw(self, int ch, const char *data, uint32_t n) except -1
    cdef int _write_span(self, int ch, const char *data, uint32_t n) except -1
    cdef int _copy_chunks(self, int ch, const char *src, uint32_t n) except -1
    cdef int _write_obj(self, int ch, object rec) except -1
    cdef int _channel(self, int ch) except -1
    cdef int _set_one_ts(self, timestamp) except -1
    cdef object _write_many(self, records, int mode, int channel, object keys, object timestamps,
                            uint32_t max_parallelism)


cdef class _RecordDeserializer:
    # per input channel: the record being reassembled and the current buffer
    cdef NetworkBufferPool arena_owner
    cdef fb_arena *a
    cdef ChanState *chs
    cdef int nch
    cdef readonly int kind
    cdef readonly uint32_t zero_copy_min
    cdef readonly uint32_t max_record_size
    cdef object _replay_cur     # the bytes of a replayed buffer being read
    # a timestamped stream: the time framed with the last record decoded, and
    # the times of the batch being read (grown to the batch's size)
    cdef readonly bint timestamped
    cdef double last_ts
    cdef double *tsbuf
    cdef Py_ssize_t tscap
    @cython.final
    cdef int _strip_ts(self, const char **p, uint32_t *n) except -1
    @cython.final
    cdef object _decode_one(self, ChanState *c)
    @cython.final
    cdef object _make(self, ChanState *c, const char *p, uint32_t n)
    @cython.final
    cdef int _check_len(self, uint32_t n) except -1
    @cython.final
    cdef object _start_partial(self, ChanState *c, uint32_t n, const char *src, uint32_t have)
    @cython.final
    cdef object _make_from_assembled(self, object b)
    @cython.final
    cdef object _make_from_ptr(self, const char *p, uint32_t n)
    @cython.final
    cdef int _release_current(self, ChanState *c) except -1


cdef class RecordReader(_RecordDeserializer):
    cdef readonly InputGate gate
    cdef int cur_ch
    cdef int finished_count
    cdef object _event
    cdef readonly uint64_t records_in
    cdef readonly uint64_t bytes_in
    cdef readonly uint64_t buffers_in
    cdef readonly object timestamps     # timestamped: the times of the last read_batch, array('d')
    # unaligned checkpoints: the mark of the last priority event, channels
    # whose buffers are being recorded as in-flight input, and in-flight
    # input to read again after a restore before anything from the gate
    cdef readonly uint32_t event_mark
    cdef unsigned char *recording
    cdef list recorded
    cdef object _replay
    cdef object _next_record(self, int64_t timeout_ns)
    cdef int _next_buffer(self, int64_t timeout_ns) except -2
    cdef int _record(self, int ch, fb_bufdesc *d) except -1
    cdef int _next_replayed(self) except -2
    cdef int _ch_index(self, int ch) except -1
