# Part of netio.pyx (included; one module, pyflowbuf._core.netio):
# mutual TLS 1.3 in the exchange's own loops (csrc/fb_tls.h, libssl): the
# context of one side (TLSContext) and one connection's TLS (TLSSocket),
# which the Wire and the pumps use in place of the plain socket.
# Uses the cimports and constants at the top of netio.pyx.

HAVE_TLS = bool(FB_HAVE_TLS)
TLS_LIBRARY = fb_tls_library().decode() if FB_HAVE_TLS else None


@cython.final
cdef class TLSContext:
    """libssl's context for one side (server or client) of a TLSConfig:
    TLS 1.3 only, TLS_AES_128_GCM_SHA256 first, the peer's certificate
    required and checked against ``ca``, no session tickets. PEM in memory;
    raises ValueError with the reason when something does not load."""

    cdef void *ctx
    cdef readonly bint server_side

    def __cinit__(self, bytes cert not None, bytes key, bytes ca not None, bint server_side):
        cdef char err[256]
        cdef const char *kp = NULL
        cdef size_t klen = 0
        err[0] = 0
        self.server_side = server_side
        if key is not None:
            kp = <const char *>key
            klen = len(key)
        self.ctx = fb_tls_ctx_new(server_side, <const char *>cert, len(cert), kp, klen,
                                  <const char *>ca, len(ca), err, sizeof(err))
        if self.ctx is NULL:
            raise ValueError(err.decode(errors="replace"))

    def __dealloc__(self):
        fb_tls_ctx_free(self.ctx)


@cython.final
cdef class TLSSocket:
    """One connection's TLS, over the TCP socket ``tcp``: ``handshake`` by a
    deadline, then what the exchange does with a socket (``recv_into``,
    ``recvmsg_into``, ``sendall``, timeouts, ``shutdown``, ``close``) for its
    Python path, while ``Wire`` and the pumps call libssl directly without
    the GIL. ``explain(text, in_handshake)`` says what an OpenSSL reason
    means; every TLS failure is raised as ``TLSError(peer, explain(...))``
    and kept in ``error``. ``tcp`` is owned: ``close`` closes it."""

    cdef fb_tls t
    cdef bint _ready
    cdef readonly object tcp
    cdef readonly object peer
    cdef readonly TLSContext context
    cdef object _explain
    cdef object _timeout
    cdef bint _in_handshake
    cdef public object error

    def __cinit__(self, tcp, TLSContext context not None, peer, explain):
        self.tcp = tcp
        self.peer = peer
        self.context = context
        self._explain = explain
        rc = fb_tls_init(&self.t, context.ctx, tcp.fileno(), context.server_side)
        if rc:
            raise MemoryError("TLSSocket") if rc != FB_TLS_ENOTLS else TLSError(peer, "this core has no libssl")
        self._ready = True

    def __dealloc__(self):
        if self._ready:
            fb_tls_destroy(&self.t)

    def fileno(self):
        return self.tcp.fileno()

    @property
    def peer_closed(self):
        """The peer ended TLS with close_notify."""
        return bool(self.t.peer_closed)

    @property
    def cipher(self):
        return fb_tls_cipher(&self.t).decode()

    def stats(self):
        """Ciphertext bytes in/out, records written and system calls, for the cost breakdown."""
        return {"bytes_in": self.t.bytes_in, "bytes_out": self.t.bytes_out, "writes": self.t.records_out,
                "recv_calls": self.t.recv_calls, "send_calls": self.t.send_calls}

    cdef object fail(self, int64_t err):
        """The one place this module's C codes become exceptions (``_net_error``)."""
        exc = _net_error(<int>err, self)
        if isinstance(exc, TLSError) and self.error is None:
            self.error = exc
        return exc

    def handshake(self, deadline=None):
        """The TLS handshake, all of it by ``deadline`` (time.monotonic();
        None: no limit). Raises TLSError naming the peer and the reason."""
        cdef int64_t dl = -1 if deadline is None else <int64_t>(deadline * 1e9)
        cdef int rc
        self._in_handshake = True
        try:
            with nogil:
                rc = fb_tls_handshake(&self.t, dl)
            if rc:
                raise self.fail(-rc)
        finally:
            self._in_handshake = False

    def peer_certificate(self):
        """The peer's certificate (DER), or None."""
        cdef unsigned char *der = NULL
        cdef int n = fb_tls_peer_der(&self.t, &der)
        if n <= 0:
            return None
        try:
            return (<char *>der)[:n]
        finally:
            fb_tls_free(der)

    # ------------------------------------------------------ the socket's face
    def settimeout(self, value):
        self._timeout = value

    def gettimeout(self):
        return self._timeout

    cdef int64_t _deadline(self):
        if self._timeout is None:
            return -1
        return fb_tls_now_ns() + <int64_t>(self._timeout * 1e9)

    cdef int64_t _recv(self, void *a, size_t alen, void *b, size_t blen) except? -1:
        cdef int64_t dl = self._deadline()
        cdef int64_t n
        with nogil:
            n = fb_tls_recv_by(&self.t, a, alen, b, blen, dl)
        if n >= 0:
            return n
        if n == -ETIMEDOUT and dl >= 0:
            raise socket.timeout("timed out")
        raise self.fail(-n)

    def recv_into(self, buffer, Py_ssize_t nbytes=0):
        cdef Py_buffer v
        PyObject_GetBuffer(buffer, &v, PyBUF_WRITABLE)
        try:
            if nbytes <= 0 or nbytes > v.len:
                nbytes = v.len
            return self._recv(v.buf, nbytes, NULL, 0)
        finally:
            PyBuffer_Release(&v)

    def recvmsg_into(self, buffers):
        """Into up to two buffers, as ``socket.recvmsg_into`` (no ancillary data)."""
        cdef Py_buffer va, vb
        cdef bint two = len(buffers) > 1
        if len(buffers) > 2:
            raise ValueError("TLSSocket.recvmsg_into takes at most two buffers")
        PyObject_GetBuffer(buffers[0], &va, PyBUF_WRITABLE)
        try:
            if two:
                PyObject_GetBuffer(buffers[1], &vb, PyBUF_WRITABLE)
            try:
                n = self._recv(va.buf, va.len, vb.buf if two else NULL, vb.len if two else 0)
            finally:
                if two:
                    PyBuffer_Release(&vb)
        finally:
            PyBuffer_Release(&va)
        return n, [], 0, None

    def sendall(self, data):
        cdef Py_buffer v
        cdef iovec io
        cdef int rc
        cdef int64_t dl = self._deadline()
        PyObject_GetBuffer(data, &v, PyBUF_SIMPLE)
        try:
            io.iov_base = v.buf
            io.iov_len = v.len
            with nogil:
                rc = fb_tls_sendv(&self.t, &io, 1, dl)
        finally:
            PyBuffer_Release(&v)
        if rc == ETIMEDOUT and dl >= 0:
            raise socket.timeout("timed out")
        if rc:
            raise self.fail(rc)

    def flush_alert(self):
        """Our alert after a failed read, best effort (the peer learns why)."""
        with nogil:
            fb_tls_flush_alert(&self.t)

    def shutdown(self, how):
        """Wakes every thread waiting on the connection (they then see its end)."""
        self.tcp.shutdown(how)

    def close(self):
        """close_notify (best effort, never waiting), then close the TCP socket."""
        if self.t.fd >= 0 and self.tcp.fileno() == self.t.fd:   # (not if tcp was closed under us)
            with nogil:
                fb_tls_close_notify(&self.t)
            self.t.fd = -1
        self.tcp.close()

    def getpeername(self):
        return self.tcp.getpeername()

    def getsockname(self):
        return self.tcp.getsockname()

    def setsockopt(self, *args):
        return self.tcp.setsockopt(*args)
