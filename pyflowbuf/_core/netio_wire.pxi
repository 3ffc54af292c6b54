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


cdef object _net_error(int err, object tls):
    """The one place the loops' C codes (an errno, or fb_tls.h's FB_TLS_*)
    become exceptions: TLS failures as TLSError naming the peer and what the
    OpenSSL reason means (``tls``: the connection's TLSSocket), the rest as
    ConnectionLostError."""
    cdef TLSSocket s
    if err == FB_TLS_ETLS or err == FB_TLS_EEOF or err == FB_TLS_ENOTLS or (err == ETIMEDOUT and tls is not None
                                                                            and (<TLSSocket>tls)._in_handshake):
        s = <TLSSocket>tls
        if err == FB_TLS_ETLS:
            text = (<bytes>(<char *>s.t.reason)).decode(errors="replace")
            if not s._in_handshake:
                s.flush_alert()
        elif err == FB_TLS_EEOF:
            text = "EOF"
        elif err == ETIMEDOUT:
            text = "TIMEOUT"
        else:
            text = "NOTLS"
        exc = TLSError(s.peer, s._explain(text, s._in_handshake))
        if s.error is None:
            s.error = exc
        return exc
    if tls is not None and (<TLSSocket>tls)._in_handshake:
        s = <TLSSocket>tls
        exc = TLSError(s.peer, f"the connection failed during the TLS handshake: {os.strerror(err)}")
        if s.error is None:
            s.error = exc
        return exc
    if err < 0 or err >= FB_TLS_ETLS:
        return ConnectionLostError(f"connection lost: error {err}")
    return ConnectionLostError(f"connection lost: {os.strerror(err)}")


@cython.final
cdef class Wire:
    """The sending half of one connection. Every frame, from any thread, is
    written under this lock, so frames never interleave; ``close`` takes the
    descriptor away under the same lock, so no thread can write into a
    socket number the kernel has already handed to someone else.

    Given a TLSSocket, every send is encrypted by libssl on the calling
    thread (a batch of frames per call, GIL released) and ``recv2`` reads
    through it, so the pumps run the same loops over TLS."""

    cdef int fd
    cdef pthread_mutex_t mu
    cdef bint _ready
    cdef readonly object sock
    cdef fb_tls *tls           # the TLSSocket's, or NULL on a plain connection

    def __cinit__(self, sock):
        self.sock = sock
        self.fd = sock.fileno()
        if isinstance(sock, TLSSocket):
            self.tls = &(<TLSSocket>sock).t
        if pthread_mutex_init(&self.mu, NULL) != 0:
            raise MemoryError("Wire")
        self._ready = True

    def __dealloc__(self):
        if self._ready:
            pthread_mutex_destroy(&self.mu)

    cdef int sendv(self, iovec *iov, int n) noexcept nogil:
        cdef int rc
        pthread_mutex_lock(&self.mu)
        if self.fd < 0:
            rc = 9      # EBADF
        elif self.tls is not NULL:
            rc = fb_tls_sendv(self.tls, iov, n, -1)
        else:
            rc = fb_sendv_all(self.fd, iov, n)
        pthread_mutex_unlock(&self.mu)
        return rc

    cdef int64_t recv2(self, void *a, size_t alen, void *b, size_t blen, int flags) noexcept nogil:
        """fb_recv2 on this connection (decrypted with TLS): bytes, 0 at its
        end, -errno (-EAGAIN with MSG_DONTWAIT) or -FB_TLS_ETLS."""
        if self.tls is not NULL:
            return fb_tls_recv2(self.tls, a, alen, b, blen, flags)
        return fb_recv2(self.fd, a, alen, b, blen, flags)

    cdef object error(self, int err):
        return _net_error(err, self.sock if self.tls is not NULL else None)

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
            raise self.error(rc)

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
            raise self.error(rc)

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
        cdef iovec v
        try:
            if self.fd < 0:
                return False
            if self.tls is not NULL:
                v.iov_base = <char *>b
                v.iov_len = len(b)
                return fb_tls_sendv(self.tls, &v, 1, fb_tls_now_ns()) == 0
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
