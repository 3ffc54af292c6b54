from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t

from pyflowbuf.includes.arena cimport fb_arena, fb_pool
from pyflowbuf.includes.park cimport fb_event
from pyflowbuf.includes.ring cimport fb_bufdesc


cdef class Notifier:
    cdef fb_event ev
    cdef bint _ready


cdef class NetworkBufferPool:
    cdef fb_arena *a
    cdef readonly Notifier notifier


cdef class LocalBufferPool:
    cdef fb_pool *p
    cdef fb_arena *a
    cdef readonly NetworkBufferPool network_pool
    cdef Notifier _listener
    cdef public int cancelled
    cdef int _waiters              # threads inside request_wait (counted with the GIL held)
    cdef bint _destroy_pending     # destroy() came while a thread waited
    cdef int request_wait(self, uint32_t *seg, int64_t timeout_ns) except? -1 nogil
    cdef int leave_wait(self) except -1
    cdef int _alive(self) except -1
    cdef inline char *segment_ptr(self, uint32_t seg) noexcept nogil:
        return self.a.base + (<uint64_t>seg << self.a.segment_shift)


cdef class Buffer:
    cdef fb_bufdesc d
    cdef NetworkBufferPool _arena_owner
    cdef char *base
    cdef uint64_t capacity_
    cdef readonly uint32_t reader_index
    cdef int _exports
    cdef int _state       # 0 live, 1 recycled, 2 release pending on views
    @staticmethod
    cdef Buffer wrap(const fb_bufdesc *d, NetworkBufferPool arena)
    cdef int _recycle_now(self) except -1
    cdef int release_or_defer(self) except -1
    cdef int _view_done(self) except -1
    cdef int _live(self) except -1


cdef class RecordView:
    cdef Buffer buf
    cdef char *ptr
    cdef Py_ssize_t length
    cdef Py_ssize_t shape[1]
    @staticmethod
    cdef RecordView new(Buffer buf, char *ptr, Py_ssize_t length)
    @staticmethod
    cdef object memoryview_of(Buffer buf, char *ptr, Py_ssize_t length)
