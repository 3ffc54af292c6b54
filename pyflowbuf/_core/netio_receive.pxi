# Part of netio.pyx (included; one module, pyflowbuf._core.netio):
# the consumer side's loop: ReceivePump (BufferResponse headers, payloads
# straight into reserved segments, recycled segments back as AddCredit).
# Uses the cimports and constants at the top of netio.pyx.


@cython.final
cdef class ReceivePump:
    """The reader of one consumer-side connection in credit mode.

    ``run(reader)`` receives data frames for the channels given to
    ``set_channels`` until a frame needs Python (its header stays staged in
    ``reader``, a FrameReader), then returns RUN_PYTHON. Per data frame: one
    recvmsg for the payload (plus at most the next 49-byte header, the
    FrameReader's staging rule), a ring push, and credit work under the
    channel's mutex; AddCredit goes out from this thread when due. Given the
    pools' recycle Notifier it also serves channels whose sender may run dry
    while it waits for the socket; without one it wakes the control thread
    for them (``hungry_wakes``).
    """

    cdef Wire wire
    cdef int fd
    cdef Notifier wake
    cdef Notifier recycles       # told when a consumer recycles a segment
    cdef fb_event *rev
    cdef int rfd                 # this thread's descriptor of it, for poll(), or -1
    cdef int rfd_w
    cdef bint hungry             # a channel's sender may run dry
    cdef _Borrowed chans
    cdef int last
    cdef readonly int64_t max_buffer_size
    cdef readonly uint64_t frames
    cdef readonly uint64_t credit_frames     # AddCredit sent from this loop
    cdef readonly uint64_t hungry_wakes      # times it handed a hungry channel to the control thread
    cdef int64_t err_a
    cdef int64_t err_b
    cdef int n_due                            # pushes since a consumer was owed a wake
    cdef readonly uint64_t consumer_wakes     # batched wakes of consumers
    cdef readonly uint64_t recycle_credit_frames   # AddCredit sent while waiting for the socket
    cdef unsigned char credit_frame[FB_NET_ADD_CREDIT_SIZE]
    cdef readonly int send_error             # errno of the first AddCredit that could not be sent, or 0

    def __cinit__(self, Wire wire not None, Notifier wake not None, int64_t max_buffer_size,
                  Notifier recycles=None):
        self.wire = wire
        self.fd = wire.fd
        self.wake = wake
        self.max_buffer_size = max_buffer_size
        self.chans = _Borrowed()
        self.rfd = -1
        if recycles is not None:
            self.rfd = fb_event_fd_open(&recycles.ev, &self.rfd_w)
            if self.rfd >= 0:
                self.recycles = recycles
                self.rev = &recycles.ev

    def __dealloc__(self):
        if self.rfd >= 0 and self.recycles is not None:
            fb_event_fd_close(self.rev, self.rfd, self.rfd_w)

    def set_channels(self, credits):
        credits = [c for c in credits if c is not None]
        for c in credits:
            if isinstance(c, ReceiverCredit) and (<ReceiverCredit>c).queue is None:
                raise TypeError("channels must be bound ReceiverCredits (bind())")
        self.chans.set(credits, ReceiverCredit, "channels")
        self.last = 0

    def run(self, reader):
        """Receive data frames; returns RUN_PYTHON with the next frame's
        header staged in ``reader``. Raises ConnectionLostError, ProtocolError
        (truncated payload) or CancelledError."""
        cdef _Staged st = _Staged(reader)
        cdef int rc
        try:
            with nogil:
                rc = self._run(<unsigned char *>st.view.buf, &st.start, &st.end)
        finally:
            st.done()
        if rc == RX_LOST:
            raise self.wire.error(<int>self.err_a)
        if rc == RX_TRUNCATED:
            raise ProtocolError(f"truncated frame: the connection closed after "
                                f"{FB_NET_BUFFER_HEADER + self.err_a} of {FB_NET_BUFFER_HEADER + self.err_b} bytes")
        if rc == RX_CANCELLED:
            raise CancelledError("the channel's queue was cancelled")
        return RUN_PYTHON

    cdef ReceiverCredit_ptr _find(self, const unsigned char *rid) noexcept nogil:
        cdef int i, k
        for k in range(self.chans.n):
            i = self.last + k
            if i >= self.chans.n:
                i -= self.chans.n
            if memcmp((<ReceiverCredit>self.chans.items[i]).rid, rid, 16) == 0:
                self.last = i
                return self.chans.items[i]
        return NULL

    cdef void _wake_due(self) noexcept nogil:
        cdef int i
        cdef ReceiverCredit_ptr c
        if not self.n_due:
            return
        self.n_due = 0
        for i in range(self.chans.n):
            c = self.chans.items[i]
            if (<ReceiverCredit>c).wake_due:
                (<ReceiverCredit>c).wake_due = False
                self.consumer_wakes += 1
                (<ReceiverCredit>c).queue.wake_consumer()

    cdef int64_t _recv(self, void *a, size_t alen, void *b, size_t blen) noexcept nogil:
        """recvmsg that, before it would block, wakes the owed consumers and
        serves channels whose sender may run dry (below)."""
        cdef int64_t n
        if self.hungry:
            # while other channels keep the socket busy, a hungry channel's
            # recycles are served between their frames
            n = self._serve_hungry()
            if n < 0:
                return n
            self.hungry = n > 0
        if self.n_due or self.rfd >= 0:
            n = self.wire.recv2(a, alen, b, blen, MSG_DONTWAIT)
            if n != -EAGAIN and n != -EWOULDBLOCK:
                return n
            self._wake_due()
            if self.rfd >= 0:
                n = self._await_socket()
                if n < 0:
                    return n
        return self.wire.recv2(a, alen, b, blen, 0)

    cdef bint _send_credit(self, int64_t credit, const unsigned char *rid) noexcept nogil:
        """AddCredit for one channel. A send that fails (the producer closed
        its end, maybe unread credit making it a reset) ends credit on this
        connection, but not reading: what the producer sent before is still
        in the socket, up to the end-of-partition of channels it finished.
        The stream's end then says which channels are complete."""
        cdef iovec v
        cdef int rc
        if self.send_error:
            return False
        fb_add_credit_put(self.credit_frame, <int32_t>credit, rid)
        v.iov_base = self.credit_frame
        v.iov_len = FB_NET_ADD_CREDIT_SIZE
        rc = self.wire.sendv(&v, 1)
        if rc:
            self.send_error = rc
            return False
        return True

    cdef int _serve_hungry(self) noexcept nogil:
        """Credit for channels whose sender may run dry: 1 if any still may
        (it waits on recycles), 0 if none (or no credit can be sent any more)."""
        cdef int i
        cdef int any_hungry = 0
        cdef int64_t credit
        cdef bint hungry
        cdef ReceiverCredit_ptr c
        if self.send_error:
            return 0
        for i in range(self.chans.n):
            c = self.chans.items[i]
            pthread_mutex_lock(&(<ReceiverCredit>c).mu)
            hungry = (<ReceiverCredit>c)._hungry()
            pthread_mutex_unlock(&(<ReceiverCredit>c).mu)
            if not hungry:
                continue
            credit = (<ReceiverCredit>c)._service(&hungry)
            if credit:
                if not self._send_credit(credit, (<ReceiverCredit>c).rid):
                    return 0
                self.recycle_credit_frames += 1
            if hungry:
                any_hungry = 1
        return any_hungry

    cdef int64_t _await_socket(self) noexcept nogil:
        """Wait until the socket is readable. Meanwhile a channel whose sender
        may run dry gets its credit the moment its consumer recycles a
        segment: no data can arrive to carry this thread to it, and handing
        it to the control thread (Python) costs a wake-up and the GIL."""
        cdef pollfd fds[2]
        cdef int rc
        while True:
            fb_event_prepare(self.rev)
            rc = self._serve_hungry()
            self.hungry = rc > 0
            if rc <= 0:
                fb_event_cancel(self.rev)
                return rc
            fds[0].fd = self.fd
            fds[0].events = POLLIN
            fds[0].revents = 0
            fds[1].fd = self.rfd
            fds[1].events = POLLIN
            fds[1].revents = 0
            rc = poll(fds, 2, -1)
            fb_event_cancel(self.rev)
            if rc < 0:
                return 0   # EINTR or worse: the blocking recv decides
            if fds[1].revents:
                fb_event_fd_drain(self.rfd)
            if fds[0].revents:
                return 0

    cdef int _stage(self, unsigned char *buf, Py_ssize_t *start, Py_ssize_t *end, Py_ssize_t want) noexcept nogil:
        """Have ``want`` bytes of the frame at ``start`` staged, reading at
        most up to one BufferResponse header from the frame start (the
        FrameReader's staging rule); 0, or RUN_PYTHON when the socket ends or
        fails first (Python's reader then reads again and reports it)."""
        cdef Py_ssize_t have = end[0] - start[0]
        cdef int64_t n
        if have >= want:
            return 0
        if start[0]:
            memmove(buf, buf + start[0], have)
            start[0] = 0
            end[0] = have
        while end[0] < want:
            n = self._recv(buf + end[0], FB_NET_BUFFER_HEADER - end[0], NULL, 0)
            if n <= 0:
                return RUN_PYTHON
            end[0] += n
        return 0

    cdef int _run(self, unsigned char *buf, Py_ssize_t *start, Py_ssize_t *end) noexcept nogil:
        cdef int rc = self._loop(buf, start, end)
        self._wake_due()
        return rc

    cdef int _loop(self, unsigned char *buf, Py_ssize_t *start, Py_ssize_t *end) noexcept nogil:
        cdef fb_buffer_header h
        cdef ReceiverCredit_ptr p
        cdef int rc
        while True:
            # a frame header first: only the 9-byte frame header, since a
            # short control frame may be all there is to read
            if self._stage(buf, start, end, FB_NET_FRAME_HEADER):
                return RX_PYTHON
            if buf[start[0] + 8] != FB_NET_MSG_BUFFER_RESPONSE:
                return RX_PYTHON
            if self._stage(buf, start, end, FB_NET_BUFFER_HEADER):
                return RX_PYTHON
            fb_buffer_header_get(buf + start[0], &h)
            if (h.magic != FB_NET_MAGIC or h.compressed or h.data_type > 1 or h.size < 0
                    or h.size > self.max_buffer_size or h.length != FB_NET_BUFFER_HEADER + h.size
                    or h.subpartition < 0 or h.seq < 0 or h.backlog < 0
                    or (h.data_type == FB_DATA_FIXED and h.width == 0)):
                return RX_PYTHON   # events, the priority lane, and anything Python must judge
            p = self._find(h.rid)
            if p is NULL:
                return RX_PYTHON
            rc = self._frame(<ReceiverCredit>p, &h, buf, start, end)
            if rc:
                return rc

    cdef int _frame(self, ReceiverCredit c, fb_buffer_header *h, unsigned char *buf, Py_ssize_t *start,
                    Py_ssize_t *end) noexcept nogil:
        cdef uint32_t seg
        cdef fb_pool *pool
        cdef char *mem
        cdef int64_t got, n, credit
        cdef int rc
        cdef bint hungry
        cdef fb_bufdesc d
        if <uint32_t>h.seq != c.expected_seq or <uint64_t>h.size > c.arena.segment_size:
            return RX_PYTHON
        pthread_mutex_lock(&c.mu)
        rc = -1 if c._detached else c._take(&seg, &pool)
        if rc == 0:
            c._backlog = h.backlog
        pthread_mutex_unlock(&c.mu)
        if rc:
            return RX_PYTHON
        # by the staging rule the header was all that was staged
        start[0] = 0
        end[0] = 0
        mem = fb_segment_ptr(c.arena, seg)
        got = 0
        while got < h.size:
            n = self._recv(mem + got, h.size - got, buf, FB_NET_BUFFER_HEADER)
            if n <= 0:
                fb_pool_recycle(pool, seg)
                if n == 0:
                    self.err_a = got
                    self.err_b = h.size
                    return RX_TRUNCATED
                self.err_a = -n
                return RX_LOST
            got += n
        if got > h.size:
            end[0] = got - h.size
        c.expected_seq = (c.expected_seq + 1) & SEQ_MASK
        d.pool = pool
        d.seg = seg
        d.size = h.size
        d.width = h.width
        d.type = h.data_type
        d.flags = h.flags
        d.aux = 0
        # Credit first: waking the consumer (the push) may hand this core to
        # it, and the sender should not wait for that turn to end.
        credit = c._service(&hungry)
        if credit:
            if self._send_credit(credit, c.rid):   # (a failed one keeps the buffer: it arrived whole)
                self.credit_frames += 1
        elif hungry:
            if self.rfd >= 0:
                self.hungry = True      # _recv serves it from now on
            else:
                self.hungry_wakes += 1
                fb_event_notify(&self.wake.ev)
        # The consumer is woken once for up to WAKE_BATCH buffers, or as soon
        # as the socket has nothing more to read (_recv): while data keeps
        # arriving it drains several buffers per wake-up instead of parking
        # after each.
        rc = c.queue.push_quiet(&d, False)
        if rc < 0:
            fb_pool_recycle(pool, seg)
            return RX_CANCELLED
        if rc == 1 and not c.wake_due:
            c.wake_due = True
        if c.wake_due:
            self.n_due += 1
            if self.n_due >= WAKE_BATCH:
                self._wake_due()
        c.buffers_received += 1
        c.bytes_received += h.size
        self.frames += 1
        return 0
