# Part of netio.pyx (included; one module, pyflowbuf._core.netio):
# the Wire (one connection's socket, non-blocking sends and reads) and the
# staged and borrowed byte views it sends from.
# Uses the cimports and constants at the top of netio.pyx.


cdef class _Staged:
    """The FrameReader's staging buffer, held for a nogil loop."""
    cdef Py_buffer view
    cdef Py_ssize_t start
    cdef Py_ssize_t end
    cdef object reader

    def __cinit__(self, reader):
        PyObject_GetBuffer(reader._buf, &self.view, PyBUF_SIMPLE)
        if self.view.len < FB_NET_BUFFER_HEADER:
            PyBuffer_Release(&self.view)
            raise ValueError("staging buffer too small")
        self.reader = reader
        self.start = reader._start
        self.end = reader._end

    cdef void done(self):
        PyBuffer_Release(&self.view)
        self.reader._start = self.start
        self.reader._end = self.end


@cython.final
cdef class _Borrowed:
    """A C array of borrowed pointers to the objects a nogil loop serves;
    ``objs`` keeps them alive while the array is in use. Replaced only by
    the thread that runs the loop, between runs."""
    cdef list objs
    cdef void **items
    cdef int n

    def __cinit__(self):
        self.objs = []

    def __dealloc__(self):
        PyMem_Free(self.items)

    cdef int set(self, list objs, type cls, str what) except -1:
        for o in objs:
            if not isinstance(o, cls):
                raise TypeError(f"{what} must be {cls.__name__}s")
        cdef void **arr = <void **>PyMem_Malloc(sizeof(void *) * len(objs) + 1)
        if arr is NULL:
            raise MemoryError()
        cdef Py_ssize_t i
        for i in range(len(objs)):
            arr[i] = <void *>objs[i]
        PyMem_Free(self.items)
        self.items = arr
        self.objs = objs
        self.n = <int>len(objs)
        return 0


cdef object _lost(int err):
    return ConnectionLostError(f"connection lost: {os.strerror(err)}")


@cython.final
cdef class Wire:
    """The sending half of one connection. Every frame, from any thread, is
    written under this lock, so frames never interleave; ``close`` takes the
    descriptor away under the same lock, so no thread can write into a
    socket number the kernel has already handed to someone else."""

    cdef int fd
    cdef pthread_mutex_t mu
    cdef bint _ready
    cdef readonly object sock

    def __cinit__(self, sock):
        self.sock = sock
        self.fd = sock.fileno()
        if pthread_mutex_init(&self.mu, NULL) != 0:
            raise MemoryError("Wire")
        self._ready = True

    def __dealloc__(self):
        if self._ready:
            pthread_mutex_destroy(&self.mu)

    cdef int sendv(self, iovec *iov, int n) noexcept nogil:
        cdef int rc
        pthread_mutex_lock(&self.mu)
        rc = 9 if self.fd < 0 else fb_sendv_all(self.fd, iov, n)   # 9: EBADF
        pthread_mutex_unlock(&self.mu)
        return rc

    def send(self, data):
        """Write all of ``data`` (GIL released)."""
        cdef Py_buffer view
        cdef iovec v
        cdef int rc
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            v.iov_base = view.buf
            v.iov_len = view.len
            with nogil:
                rc = self.sendv(&v, 1)
        finally:
            PyBuffer_Release(&view)
        if rc:
            raise _lost(rc)

    def sendmsg(self, parts):
        """Write a list of bytes-like objects with gathered I/O (segments are
        not copied)."""
        cdef Py_ssize_t n = len(parts), i, got = 0
        cdef Py_buffer *views = <Py_buffer *>PyMem_Malloc(sizeof(Py_buffer) * n + 1)
        cdef iovec *iov = <iovec *>PyMem_Malloc(sizeof(iovec) * n + 1)
        cdef int rc = 0
        if views is NULL or iov is NULL:
            PyMem_Free(views)
            PyMem_Free(iov)
            raise MemoryError()
        try:
            for i in range(n):
                PyObject_GetBuffer(parts[i], &views[i], PyBUF_SIMPLE)
                got += 1
                iov[i].iov_base = views[i].buf
                iov[i].iov_len = views[i].len
            with nogil:
                rc = self.sendv(iov, <int>n)
        finally:
            for i in range(got):
                PyBuffer_Release(&views[i])
            PyMem_Free(views)
            PyMem_Free(iov)
        if rc:
            raise _lost(rc)

    def send_nowait(self, data, double timeout=0.2):
        """Best effort, never blocking on the socket: write ``data`` if the
        lock comes free within ``timeout`` s and the socket takes it at once
        (a last ErrorResponse before closing)."""
        cdef bytes b = bytes(data)
        deadline = time.monotonic() + timeout
        while pthread_mutex_trylock(&self.mu) != 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        try:
            if self.fd < 0:
                return False
            return _send_dontwait(self.fd, b) == len(b)
        finally:
            pthread_mutex_unlock(&self.mu)

    def close(self):
        """Close the socket; later sends raise ConnectionLostError."""
        with nogil:
            pthread_mutex_lock(&self.mu)
            self.fd = -1
            pthread_mutex_unlock(&self.mu)
        try:
            self.sock.close()
        except OSError:
            pass
