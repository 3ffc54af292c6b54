# Part of netio.pyx (included; one module, pyflowbuf._core.netio):
# the producer side: SenderView (one subpartition on one connection, its
# credit) and SendPump (gathers finished buffers against credit, one sendmsg).
# Uses the cimports and constants at the top of netio.pyx.


@cython.final
cdef class SenderView:
    """Flink's CreditBasedSequenceNumberingViewReader: the sending end of one
    subpartition on one connection.

    What goes next: an event always (events cost no credit), a data buffer
    only against credit, the priority lane (unaligned barriers) before queued
    data; in credit mode with 0 exclusive buffers the backlog is announced so
    the receiver can reserve floating buffers (FLINK-16641). Nothing is taken
    from the queue until it can be sent, so a view without credit holds
    nothing back.

    Threads: ``add_credit``/``resume`` may come from any thread (the
    server's connection thread applies AddCredit inside its SendPump, atomic
    on ``_added``); the sender (SendPump or ``poll``) does everything else.
    """

    cdef readonly BufferQueue queue
    cdef readonly bytes receiver_id
    cdef unsigned char rid[16]
    cdef readonly int subpartition
    cdef readonly int initial_credit
    cdef readonly bint credit_based
    cdef readonly bint block_on_barrier
    cdef fb_arena *arena
    cdef int64_t _added            # credit received; atomic (add_credit may run on any thread)
    cdef int64_t _used
    cdef readonly uint32_t seq
    cdef readonly uint32_t event_mark   # of the last event taken (see BufferQueue.push_event)
    cdef int64_t _told_backlog
    cdef int _blocked
    cdef int _finished
    cdef public object cancelled   # set on CancelPartitionRequest: the exception to release with
    cdef public object gate_ref
    cdef public object export
    cdef readonly uint64_t buffers_sent
    cdef readonly uint64_t bytes_sent
    cdef public uint64_t announcements

    def __init__(self, BufferQueue queue not None, bytes receiver_id not None, int subpartition,
                 int initial_credit, bint credit_based=True, bint block_on_barrier=False):
        if len(receiver_id) != 16:
            raise ValueError("a receiver id is 16 bytes")
        if initial_credit < 0:
            raise ProtocolError(f"negative initial credit {initial_credit}")
        self.queue = queue
        self.receiver_id = receiver_id
        memcpy(self.rid, <const char *>receiver_id, 16)
        self.subpartition = subpartition
        self.initial_credit = initial_credit
        self.credit_based = credit_based
        self.block_on_barrier = block_on_barrier
        self.arena = queue.network_pool.a
        self._added = initial_credit

    @property
    def credit(self):
        return fb_atomic_load_i64(&self._added, __ATOMIC_ACQUIRE) - self._used

    def add_credit(self, int n):
        if n <= 0:
            raise ProtocolError(f"AddCredit of {n}")
        fb_atomic_add_i64(&self._added, n, __ATOMIC_RELEASE)

    def resume(self):
        fb_atomic_store_int(&self._blocked, 0, __ATOMIC_RELEASE)

    @property
    def blocked(self):
        return bool(fb_atomic_load_int(&self._blocked, __ATOMIC_ACQUIRE))

    @blocked.setter
    def blocked(self, value):
        fb_atomic_store_int(&self._blocked, 1 if value else 0, __ATOMIC_RELEASE)

    @property
    def finished(self):
        return bool(self._finished)

    @finished.setter
    def finished(self, value):
        self._finished = 1 if value else 0

    @property
    def backlog(self):
        return self._backlog()

    cdef inline int64_t _backlog(self) noexcept nogil:
        return fb_ring_size(self.queue.ring) + fb_ring_size(self.queue.prio)

    cdef int next_item(self, bint *priority) noexcept nogil:
        """What ``poll`` would do now, without taking anything: 0 nothing,
        1 a data buffer the pump may send, 2 an event or priority item (for
        Python), 3 a backlog announcement is due."""
        cdef bint prio
        if self._finished:
            return 0
        cdef fb_bufdesc *d = self.queue.peek(&prio)
        priority[0] = prio
        if d is NULL:
            return 0
        if not prio and fb_atomic_load_int(&self._blocked, __ATOMIC_ACQUIRE):
            return 0
        cdef bint is_event = d.type == FB_DATA_EVENT
        if not is_event and self.credit_based and \
                fb_atomic_load_i64(&self._added, __ATOMIC_ACQUIRE) - self._used <= 0:
            if self.initial_credit == 0 and self._backlog() > self._told_backlog:
                return 3
            return 0
        return 2 if (prio or is_event) else 1

    cdef int take(self, fb_bufdesc *d, bint prio, int32_t *seq, int32_t *backlog) noexcept nogil:
        """Pop the item ``next_item`` looked at (``prio``: from the priority
        lane) and number it. Only from that lane: the producer may push an
        overtaking barrier between the look and the pop, and the sender
        must not take that event for the data buffer it decided to send."""
        if self.queue.pop_lane(d, prio) != FB_OK:
            return -1       # that lane is empty: nothing taken, nothing numbered
        seq[0] = self.seq
        self.seq = (self.seq + 1) & SEQ_MASK
        backlog[0] = <int32_t>self._backlog()
        self._told_backlog = backlog[0]
        if d.type == FB_DATA_EVENT:
            self.event_mark = d.seg
            if self.block_on_barrier and d.width == FB_EVT_BARRIER and not prio:
                fb_atomic_store_int(&self._blocked, 1, __ATOMIC_RELEASE)
        else:
            self._used += 1
            self.buffers_sent += 1
            self.bytes_sent += d.size
        return 0

    def poll(self):
        """``(DATA, buffer, seq, backlog, priority)``,
        ``(EVENT, (kind, aux, flags), seq, backlog, priority)``,
        ``(BACKLOG, None, -1, backlog, False)`` or None."""
        cdef bint prio
        cdef int what = self.next_item(&prio)
        if what == 0:
            return None
        return self._poll(what, prio)

    def peek(self):
        """``(what, priority)`` that ``poll`` would act on now, taking
        nothing: what is 0 (nothing), 1 (a data buffer the send loop may
        ship), 2 (an event or priority item, for Python) or 3 (a backlog
        announcement is due). ``peek`` then ``take_peeked(what, priority)`` is
        ``poll`` in the two steps the send loop makes, so tests can put a
        producer's push between them."""
        cdef bint prio
        cdef int what = self.next_item(&prio)
        return (what, bool(prio))

    def take_peeked(self, int what, bint priority):
        """Act on what ``peek`` returned, as ``poll`` does: take from the
        lane ``priority`` names (None when there is nothing, or 0)."""
        if what == 0:
            return None
        if not 1 <= what <= 3:
            raise ValueError(f"what must be 0..3 (from peek()), got {what}")
        return self._poll(what, priority)

    cdef object _poll(self, int what, bint prio):
        cdef fb_bufdesc d
        cdef int32_t seq, backlog
        if what == 3:
            self._told_backlog = self._backlog()
            self.announcements += 1
            return (BACKLOG, None, -1, self._told_backlog, False)
        if self.take(&d, prio, &seq, &backlog):
            return None
        if d.type == FB_DATA_EVENT:
            return (EVENT, (d.width, d.aux, d.flags), seq, backlog, prio)
        return (DATA, Buffer.wrap(&d, self.queue.network_pool), seq, backlog, prio)

    def release(self):
        """Stop sending (the view was cancelled); what is queued stays for the
        owner of the queue to drain."""
        self._finished = 1


@cython.final
cdef class SendPump:
    """The one I/O thread of a producer-side connection, without the GIL:
    round robin over the views (one buffer per view per round, so a view
    without credit never holds up the others), up to 16 buffers per sendmsg;
    between sends it applies the AddCredit frames waiting on the socket, and
    it parks in poll() on the socket and the connection's Notifier at once.
    So credit wakes the thread that sends, directly: no reader thread to wake
    first, and no second wake-up from it.

    ``run(timeout, reader)`` returns at the first frame that is not an
    AddCredit for a known view (RUN_FRAME, with the frame staged in
    ``reader``, a FrameReader). Without a reader it only sends and parks on
    the Notifier (credit then comes from ``SenderView.add_credit``)."""

    cdef Wire wire
    cdef int fd
    cdef Notifier notifier
    cdef int nfd                # this thread's descriptor of the Notifier, for poll()
    cdef int nfd_w
    cdef _Borrowed views
    cdef int next_view
    cdef int last_credited
    cdef int _dirty
    cdef int _closed
    cdef int _broken            # _gather took something that is not a data buffer
    cdef unsigned char hdr[MAX_BATCH][FB_NET_BUFFER_HEADER]
    cdef iovec iov[2 * MAX_BATCH]
    cdef fb_bufdesc sent[MAX_BATCH]
    cdef fb_pool *sent_pools[MAX_BATCH]
    cdef uint32_t sent_segs[MAX_BATCH]
    cdef readonly uint64_t buffers_sent
    cdef readonly uint64_t bytes_sent
    cdef readonly uint64_t parks              # times the writer parked
    cdef readonly uint64_t credit_parks       # ... with buffers queued that lacked credit
    cdef readonly uint64_t credit_frames      # AddCredit frames applied

    def __cinit__(self, Wire wire not None, Notifier notifier not None):
        self.wire = wire
        self.fd = wire.fd
        self.notifier = notifier
        self.views = _Borrowed()
        self.nfd = fb_event_fd_open(&notifier.ev, &self.nfd_w)

    def __dealloc__(self):
        if self.nfd >= 0 and self.notifier is not None:
            fb_event_fd_close(&self.notifier.ev, self.nfd, self.nfd_w)

    def set_views(self, views):
        """The views to serve (called by the connection's thread between runs)."""
        self.views.set(list(views), SenderView, "views")
        self.next_view = 0
        self.last_credited = 0

    def mark_dirty(self):
        """The views changed (opened, cancelled): the writer should look."""
        fb_atomic_store_int(&self._dirty, 1, __ATOMIC_SEQ_CST)
        fb_event_notify(&self.notifier.ev)

    def take_dirty(self):
        cdef int d = fb_atomic_load_int(&self._dirty, __ATOMIC_SEQ_CST)
        if d:
            fb_atomic_store_int(&self._dirty, 0, __ATOMIC_SEQ_CST)
        return bool(d)

    def close(self):
        fb_atomic_store_int(&self._closed, 1, __ATOMIC_SEQ_CST)
        fb_event_notify_all(&self.notifier.ev)

    @property
    def reads_credit(self):
        """Whether ``run(timeout, reader)`` can wait on the socket (False only
        where the system offers no pollable wake-up)."""
        return self.nfd >= 0

    def run(self, double timeout, reader=None):
        """Send until something needs Python; returns a RUN_* code. Raises
        ConnectionLostError when the socket fails."""
        cdef int64_t t = <int64_t>(timeout * 1e9)
        cdef int rc
        cdef _Staged st
        if reader is None or self.nfd < 0:
            with nogil:
                rc = self._run(t, NULL, NULL, NULL)
        else:
            st = _Staged(reader)
            try:
                with nogil:
                    rc = self._run(t, <unsigned char *>st.view.buf, &st.start, &st.end)
            finally:
                st.done()
        if rc < 0:
            raise self.wire.error(-rc)
        if rc == RUN_BROKEN:
            raise FlowBufError(
                "internal error: the network sender took an item without a segment pool for a data "
                "buffer; the connection stops here instead of recycling it")
        return rc

    cdef bint _credit_starved(self) noexcept nogil:
        cdef int i
        cdef SenderView_ptr v
        for i in range(self.views.n):
            v = self.views.items[i]
            if (<SenderView>v).credit_based and not (<SenderView>v)._finished and \
                    fb_ring_size((<SenderView>v).queue.ring) and \
                    fb_atomic_load_i64(&(<SenderView>v)._added, __ATOMIC_ACQUIRE) - (<SenderView>v)._used <= 0:
                return True
        return False

    cdef int _gather(self, bint *python) noexcept nogil:
        cdef int n = 0, i, k, what
        cdef bint progress = True, prio
        cdef int32_t seq, backlog
        cdef fb_bufdesc *d
        while progress and n < MAX_BATCH:
            progress = False
            for k in range(self.views.n):
                if n >= MAX_BATCH:
                    break
                i = self.next_view + k
                if i >= self.views.n:
                    i -= self.views.n
                what = (<SenderView>self.views.items[i]).next_item(&prio)
                if what == 1:
                    d = &self.sent[n]
                    if (<SenderView>self.views.items[i]).take(d, False, &seq, &backlog):   # 1: main lane
                        continue
                    if d.pool is NULL or d.type == FB_DATA_EVENT:
                        # Not a data buffer, though the main lane's head was
                        # one a moment ago (only this thread pops it): the
                        # books are broken. Stop with an error, not a crash.
                        if d.pool is not NULL:
                            fb_pool_recycle(d.pool, d.seg)
                        self._broken = 1
                        return n
                    fb_buffer_header_put(self.hdr[n], (<SenderView>self.views.items[i]).rid,
                                         (<SenderView>self.views.items[i]).subpartition, seq, backlog,
                                         <unsigned char>d.type, <int32_t>d.size, d.width, d.flags)
                    self.iov[2 * n].iov_base = self.hdr[n]
                    self.iov[2 * n].iov_len = FB_NET_BUFFER_HEADER
                    self.iov[2 * n + 1].iov_base = fb_segment_ptr((<SenderView>self.views.items[i]).arena, d.seg)
                    self.iov[2 * n + 1].iov_len = d.size
                    n += 1
                    progress = True
                elif what >= 2:
                    python[0] = True
        if self.views.n:   # the next send starts with the next view
            self.next_view = (self.next_view + 1) % self.views.n
        return n

    cdef int _read_credit(self, unsigned char *buf, Py_ssize_t *start, Py_ssize_t *end) noexcept nogil:
        """Apply the AddCredit frames already on the socket, without blocking:
        0 once there is nothing more to read now, RUN_FRAME when the staged
        frame is anything else (or the socket ended or failed: Python's read
        then reports it). Reads follow the FrameReader's staging rule."""
        cdef const unsigned char *p
        cdef int32_t credit
        cdef int i, k
        cdef bint found
        cdef Py_ssize_t want
        cdef int64_t n
        while True:
            want = FB_NET_FRAME_HEADER
            if end[0] - start[0] >= FB_NET_FRAME_HEADER:
                p = buf + start[0]
                if p[8] != FB_NET_MSG_ADD_CREDIT or fb_be32_get(p) != FB_NET_ADD_CREDIT_SIZE:
                    return RUN_FRAME
                want = FB_NET_ADD_CREDIT_SIZE
            if end[0] - start[0] < want:
                if start[0]:
                    memmove(buf, buf + start[0], end[0] - start[0])
                    end[0] -= start[0]
                    start[0] = 0
                n = self.wire.recv2(buf + end[0], FB_NET_BUFFER_HEADER - end[0], NULL, 0, MSG_DONTWAIT)
                if n == -EAGAIN or n == -EWOULDBLOCK:
                    return 0
                if n <= 0:
                    return RUN_FRAME
                end[0] += n
                continue
            p = buf + start[0]
            credit = <int32_t>fb_be32_get(p + 9)
            if fb_be32_get(p + 4) != FB_NET_MAGIC or credit <= 0:
                return RUN_FRAME
            found = False
            for k in range(self.views.n):
                i = self.last_credited + k
                if i >= self.views.n:
                    i -= self.views.n
                if memcmp((<SenderView>self.views.items[i]).rid, p + 13, 16) == 0:
                    self.last_credited = i
                    found = True
                    break
            if not found:
                return RUN_FRAME   # Python knows whether it is stale or unknown
            fb_atomic_add_i64(&(<SenderView>self.views.items[i])._added, credit, __ATOMIC_RELEASE)
            start[0] += FB_NET_ADD_CREDIT_SIZE
            self.credit_frames += 1

    cdef int _park(self, uint32_t token, int64_t timeout_ns, bint sock) noexcept nogil:
        """Wait for a notify (or, with ``sock``, for the socket to become
        readable); RUN_IDLE after the timeout, else 0."""
        cdef pollfd fds[2]
        cdef int ms, rc
        if not sock:
            return RUN_IDLE if fb_event_wait(&self.notifier.ev, token, timeout_ns) == FB_E_TIMEOUT else 0
        ms = -1 if timeout_ns < 0 else <int>((timeout_ns + 999999) // 1000000)
        fds[0].fd = self.fd
        fds[0].events = POLLIN
        fds[0].revents = 0
        fds[1].fd = self.nfd
        fds[1].events = POLLIN
        fds[1].revents = 0
        rc = poll(fds, 2, ms)
        fb_event_cancel(&self.notifier.ev)
        if fds[1].revents:
            fb_event_fd_drain(self.nfd)
        return RUN_IDLE if rc == 0 else 0

    cdef int _run(self, int64_t timeout_ns, unsigned char *buf, Py_ssize_t *start, Py_ssize_t *end) noexcept nogil:
        cdef fb_event *ev = &self.notifier.ev
        cdef uint32_t token
        cdef bint python
        cdef bint sock = buf is not NULL
        cdef int n, i, err
        cdef uint64_t nbytes
        while True:
            token = fb_event_prepare(ev)
            if fb_atomic_load_int(&self._closed, __ATOMIC_SEQ_CST):
                fb_event_cancel(ev)
                return RUN_CLOSED
            if fb_atomic_load_int(&self._dirty, __ATOMIC_SEQ_CST):
                fb_event_cancel(ev)
                return RUN_DIRTY
            if sock and self._read_credit(buf, start, end):
                fb_event_cancel(ev)
                return RUN_FRAME
            python = False
            n = self._gather(&python)
            if self._broken and not n:
                fb_event_cancel(ev)
                return RUN_BROKEN
            if n:
                fb_event_cancel(ev)
                nbytes = 0
                for i in range(n):
                    nbytes += self.sent[i].size
                err = self.wire.sendv(self.iov, 2 * n)
                # the kernel has copied the payloads (or the connection is gone): recycle either way
                for i in range(n):
                    self.sent_pools[i] = self.sent[i].pool
                    self.sent_segs[i] = self.sent[i].seg
                fb_pool_recycle_many(self.sent_pools, self.sent_segs, n)
                if err:
                    return -err
                self.buffers_sent += n
                self.bytes_sent += nbytes
                if self._broken:
                    return RUN_BROKEN
                continue
            if python:
                fb_event_cancel(ev)
                return RUN_PYTHON
            self.parks += 1
            if self._credit_starved():
                self.credit_parks += 1
            if self._park(token, timeout_ns, sock) == RUN_IDLE:
                return RUN_IDLE
