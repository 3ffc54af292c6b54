"""The hot paths of the remote exchange, run without the GIL.

Data buffers cross a connection without Python. On the producer a SendPump
gathers the finished buffers of every SenderView against their credit and
writes them with one sendmsg, header and segment side by side. On the
consumer a ReceivePump reads BufferResponse headers, receives each payload
straight into a segment its channel reserved, pushes it to the channel's
BufferQueue, and turns recycled segments back into credit (AddCredit) on
the same thread. Everything rare (events, control frames, the priority lane,
odd or bad input, TCP-window-only mode) goes back to pyflowbuf.net, which
handles that one frame and re-enters the loop: every protocol decision and
error message stays in one place.

Flow-control state lives here too (ReceiverCredit, SenderView) so the loops
and Python share one set of books; the model-based tests drive them directly.
"""
cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove, memset

from pyflowbuf._core.channel cimport BufferQueue
from pyflowbuf.includes.events cimport FB_EVT_BARRIER
from pyflowbuf._core.memory cimport Buffer, LocalBufferPool, NetworkBufferPool, Notifier
from pyflowbuf.includes.arena cimport (FB_POOL_INUSE, fb_arena, fb_pool, fb_pool_recycle, fb_pool_recycle_many,
                                       fb_pool_request, fb_segment_ptr)
from pyflowbuf.includes.atomic cimport *
from pyflowbuf.includes.errors cimport *
from pyflowbuf.includes.net cimport *
from pyflowbuf.includes.park cimport *
from pyflowbuf.includes.ring cimport *

import os
import time

from pyflowbuf.errors import (CancelledError, ConnectionLostError, FlowBufError, InsufficientBuffersError,
                              ProtocolError)

DATA = 0
EVENT = 1
BACKLOG = 2

# what SendPump.run / ReceivePump.run return (a failed system call raises instead)
cdef enum:
    RUN_PYTHON = 1     # the next item or frame needs the Python path
    RUN_DIRTY = 2      # the set of views changed
    RUN_IDLE = 3       # nothing happened within the timeout
    RUN_CLOSED = 4
    RUN_FRAME = 5      # a frame for Python is staged in the reader
    RUN_BROKEN = 6     # (SendPump) the queue handed over something that is not a data buffer

PYTHON = RUN_PYTHON
DIRTY = RUN_DIRTY
IDLE = RUN_IDLE
CLOSED = RUN_CLOSED
FRAME = RUN_FRAME

cdef enum:
    SEQ_MASK = 0x7FFFFFFF
    MAX_BATCH = 16          # buffers per gathered send
    WAKE_BATCH = 4          # buffers received per consumer wake-up, at most
    RX_PYTHON = 1
    RX_LOST = 2             # recv failed (errno in err_a)
    RX_TRUNCATED = 3        # the peer closed mid-payload (err_a of err_b bytes)
    RX_CANCELLED = 4        # the channel's queue was cancelled while full


cdef extern from "<errno.h>" nogil:
    enum:
        EAGAIN
        EWOULDBLOCK


cdef extern from "<poll.h>" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    enum:
        POLLIN


cdef extern from "<sys/socket.h>" nogil:
    Py_ssize_t send(int fd, const void *buf, size_t n, int flags)
    enum:
        MSG_DONTWAIT
        MSG_NOSIGNAL


ctypedef void *ReceiverCredit_ptr
ctypedef void *SenderView_ptr


cdef Py_ssize_t _send_dontwait(int fd, bytes b):
    return send(fd, <const char *>b, len(b), MSG_DONTWAIT | MSG_NOSIGNAL)



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


# ============================================================ producer side

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
            raise _lost(-rc)
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
                n = fb_recv2(self.fd, buf + end[0], FB_NET_BUFFER_HEADER - end[0], NULL, 0, MSG_DONTWAIT)
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


# ============================================================ consumer side

@cython.final
cdef class ReceiverCredit:
    """Flink's BufferManager for one RemoteInputChannel, plus what the
    receive loop needs of the channel (receiver id, queue, sequence number).

    ``initial_credit`` exclusive buffers come from ``exclusive_pool`` (one pool
    per channel, at least that many segments guaranteed) and always return to
    this channel; floating buffers come from the gate-wide ``floating_pool`` as
    the sender's backlog asks for them (aim: backlog + initial_credit buffers
    available, at most the floating pool's max_size at creation). A buffer the
    receiver fills leaves ``available``; when the consumer recycles it the
    segment goes back to its pool and ``replenish`` reserves it again, which
    is new credit.

    Threads: the connection's reader (``take``, ``backlog``, and replenishing
    after each buffer) and the manager's control thread; one mutex guards the
    books. The pools are pinned until ``release`` (a ``destroy()`` meanwhile
    is carried out then), so the reader can request segments without the GIL.
    """

    cdef readonly LocalBufferPool exclusive_pool
    cdef readonly LocalBufferPool floating_pool
    cdef readonly int initial_credit
    cdef pthread_mutex_t mu
    cdef bint _ready
    cdef uint32_t *_excl
    cdef int n_excl
    cdef uint32_t *_float
    cdef int n_float
    cdef int cap_float
    cdef fb_pool *_xp
    cdef fb_pool *_fp
    cdef int64_t _backlog
    cdef int64_t _unannounced
    cdef int64_t _granted
    cdef int64_t _taken
    cdef int64_t _low_water
    cdef bint _waiting_floating
    cdef bint _released
    cdef bint _detached
    cdef bint _pinned
    # the channel, for the receive loop (reader thread only)
    cdef unsigned char rid[16]
    cdef BufferQueue queue
    cdef fb_arena *arena
    cdef public uint32_t expected_seq
    cdef public uint64_t buffers_received
    cdef public uint64_t bytes_received
    cdef bint wake_due               # pushed without waking the consumer yet

    def __cinit__(self):
        if pthread_mutex_init(&self.mu, NULL) != 0:
            raise MemoryError("ReceiverCredit")
        self._ready = True

    def __init__(self, exclusive_pool, floating_pool, int initial_credit):
        if initial_credit < 0:
            raise ValueError(f"exclusive buffers must be >= 0, got {initial_credit}")
        if initial_credit and exclusive_pool is None:
            raise ValueError("exclusive buffers need an exclusive_pool")
        if initial_credit == 0 and floating_pool is None:
            raise ValueError("a channel with 0 exclusive buffers needs a floating pool (or it can never "
                             "receive data)")
        for p in (exclusive_pool, floating_pool):
            if p is not None and not isinstance(p, LocalBufferPool):
                raise TypeError("pools must be LocalBufferPools")
            if p is not None and p.destroyed:
                from pyflowbuf.errors import PoolDestroyedError
                raise PoolDestroyedError("the LocalBufferPool was destroyed")
        self.exclusive_pool = exclusive_pool
        self.floating_pool = floating_pool
        self.initial_credit = initial_credit
        self.cap_float = floating_pool.max_size if floating_pool is not None else 0
        self._excl = <uint32_t *>PyMem_Malloc(sizeof(uint32_t) * initial_credit + 4)
        self._float = <uint32_t *>PyMem_Malloc(sizeof(uint32_t) * self.cap_float + 4)
        if self._excl is NULL or self._float is NULL:
            raise MemoryError()
        self._xp = self.exclusive_pool.p if exclusive_pool is not None else NULL
        self._fp = self.floating_pool.p if floating_pool is not None else NULL
        for p in (self.exclusive_pool, self.floating_pool):
            if p is not None:
                (<LocalBufferPool>p)._waiters += 1
        self._pinned = True
        self._low_water = 1

    def __dealloc__(self):
        if self._ready:
            self._release_all()
            self._unpin()
            pthread_mutex_destroy(&self.mu)
        PyMem_Free(self._excl)
        PyMem_Free(self._float)

    cdef void _unpin(self):
        if not self._pinned:
            return
        self._pinned = False
        for p in (self.exclusive_pool, self.floating_pool):
            if p is not None:
                (<LocalBufferPool>p).leave_wait()

    def bind(self, bytes receiver_id not None, BufferQueue queue not None):
        """Attach the channel the receive loop delivers to."""
        if len(receiver_id) != 16:
            raise ValueError("a receiver id is 16 bytes")
        memcpy(self.rid, <const char *>receiver_id, 16)
        self.queue = queue
        self.arena = queue.network_pool.a

    # ------------------------------------------------------------ books (mutex held)
    cdef bint _pool_ok(self, LocalBufferPool pool) noexcept nogil:
        return pool.p is not NULL and not pool._destroy_pending

    cdef int _take(self, uint32_t *seg, fb_pool **pool) noexcept nogil:
        """A reserved empty segment for an arriving data buffer (floating
        first, as Flink does); -1 when the sender overran its credit."""
        if self._taken >= self._granted or self._released:
            return -1
        if self.n_float:
            self.n_float -= 1
            seg[0] = self._float[self.n_float]
            pool[0] = self._fp
        elif self.n_excl:
            self.n_excl -= 1
            seg[0] = self._excl[self.n_excl]
            pool[0] = self._xp
        else:
            return -1
        self._taken += 1
        return 0

    cdef int64_t _replenish(self) noexcept nogil:
        cdef uint32_t seg
        cdef int64_t need
        if self._released:
            return self._unannounced
        if self._xp is not NULL and self._pool_ok(self.exclusive_pool):
            while FB_POOL_INUSE(self._xp.state) < <uint32_t>self.initial_credit:
                if fb_pool_request(self._xp, &seg) != FB_OK:
                    break
                self._excl[self.n_excl] = seg
                self.n_excl += 1
                # An exclusive buffer back while we hold more than the backlog
                # needs: give a floating one back to the gate instead (a swap,
                # so the sender's credit does not change).
                if self.n_excl + self.n_float > self._backlog + self.initial_credit and self.n_float:
                    self.n_float -= 1
                    fb_pool_recycle(self._fp, self._float[self.n_float])
                else:
                    self._unannounced += 1
        self._waiting_floating = False
        if self._fp is not NULL and self._pool_ok(self.floating_pool):
            need = self._backlog + self.initial_credit - (self.n_excl + self.n_float)
            while need > 0:
                if self.n_float >= self.cap_float or fb_pool_request(self._fp, &seg) != FB_OK:
                    self._waiting_floating = True
                    break
                self._float[self.n_float] = seg
                self.n_float += 1
                self._unannounced += 1
                need -= 1
        return self._unannounced

    cdef bint _should_announce(self) noexcept nogil:
        cdef int64_t n = self._unannounced
        if n <= 0:
            return False
        cdef int64_t slack = self._granted - self._taken
        return slack <= n or slack <= self._low_water

    cdef int64_t _announce(self) noexcept nogil:
        cdef int64_t n = self._unannounced
        self._unannounced = 0
        self._granted += n
        self._low_water = max(1, (self._granted - self._taken) // 2)
        return n

    cdef bint _hungry(self) noexcept nogil:
        return self._granted - self._taken <= self._low_water

    cdef int64_t _service(self, bint *hungry) noexcept nogil:
        """Replenish, then take the credit to announce now (0: none)."""
        cdef int64_t n = 0
        pthread_mutex_lock(&self.mu)
        self._replenish()
        if not self._released and not self._detached and self._should_announce():
            n = self._announce()
        hungry[0] = not self._released and self._hungry()
        pthread_mutex_unlock(&self.mu)
        return n

    cdef void _release_all(self) noexcept nogil:
        pthread_mutex_lock(&self.mu)
        self._released = True
        while self.n_excl:
            self.n_excl -= 1
            fb_pool_recycle(self._xp, self._excl[self.n_excl])
        while self.n_float:
            self.n_float -= 1
            fb_pool_recycle(self._fp, self._float[self.n_float])
        self._waiting_floating = False
        pthread_mutex_unlock(&self.mu)

    # ------------------------------------------------------------ Python API
    def setup(self):
        """Reserve the exclusive buffers; returns the initial credit."""
        cdef uint32_t seg
        cdef int i, rc
        for i in range(self.initial_credit):
            rc = fb_pool_request(self._xp, &seg) if self._pool_ok(self.exclusive_pool) else FB_E_DESTROYED
            if rc != FB_OK:
                got = self.n_excl
                self.release()
                raise InsufficientBuffersError(
                    f"insufficient number of network buffers: a remote channel needs {self.initial_credit} "
                    f"exclusive buffers, its pool gave {got}")
            with nogil:
                pthread_mutex_lock(&self.mu)
                self._excl[self.n_excl] = seg
                self.n_excl += 1
                pthread_mutex_unlock(&self.mu)
        with nogil:
            pthread_mutex_lock(&self.mu)
            self._granted = self.initial_credit
            self._low_water = max(1, self.initial_credit // 2)
            pthread_mutex_unlock(&self.mu)
        return self.initial_credit

    @property
    def available(self):
        return self.n_excl + self.n_float

    @property
    def required(self):
        return self._backlog + self.initial_credit

    @property
    def backlog(self):
        return self._backlog

    @backlog.setter
    def backlog(self, int64_t value):
        with nogil:
            pthread_mutex_lock(&self.mu)
            self._backlog = value
            pthread_mutex_unlock(&self.mu)

    @property
    def unannounced(self):
        return self._unannounced

    @property
    def granted(self):
        return self._granted

    @property
    def taken(self):
        return self._taken

    @property
    def low_water(self):
        return self._low_water

    @property
    def waiting_floating(self):
        return bool(self._waiting_floating)

    @property
    def released(self):
        return bool(self._released)

    def take(self):
        """A reserved empty Buffer for an arriving data buffer, or None when
        the sender overran the credit it was given."""
        cdef uint32_t seg
        cdef fb_pool *pool
        cdef int rc
        with nogil:
            pthread_mutex_lock(&self.mu)
            rc = self._take(&seg, &pool)
            pthread_mutex_unlock(&self.mu)
        if rc:
            return None
        cdef fb_bufdesc d
        memset(&d, 0, sizeof(d))
        d.pool = pool
        d.seg = seg
        owner = self.floating_pool if pool == self._fp and self._fp is not NULL else self.exclusive_pool
        return Buffer.wrap(&d, (<LocalBufferPool>owner).network_pool)

    def needs_floating(self):
        return self.floating_pool is not None and self.n_excl + self.n_float < self._backlog + self.initial_credit

    def replenish(self):
        """Re-reserve recycled exclusive buffers and request floating ones for
        the backlog. Returns the credit not yet announced."""
        cdef int64_t n
        with nogil:
            pthread_mutex_lock(&self.mu)
            n = self._replenish()
            pthread_mutex_unlock(&self.mu)
        return n

    def should_announce(self):
        """Whether to send the unannounced credit now.

        Flink announces on every 0 -> positive change. Here credit is held back
        while the sender still has plenty: ``granted - taken`` bounds its credit
        from above, and credit goes out once that falls to the low-water mark
        (half of what it had after the last announcement) or to what we would
        give. So one AddCredit carries several buffers, and a sender that may be
        at 0 always gets credit at once: this never stalls a channel."""
        return self._should_announce()

    def hungry(self):
        """Whether the control thread must hear every recycle for this channel:
        the sender may run dry."""
        return self._hungry()

    def announce(self):
        """Take the credit to send in one AddCredit (0: nothing to send)."""
        cdef int64_t n
        with nogil:
            pthread_mutex_lock(&self.mu)
            n = self._announce()
            pthread_mutex_unlock(&self.mu)
        return n

    def service(self):
        """``(credit to announce now, hungry)`` after replenishing, in one step
        (the receive loop may announce concurrently)."""
        cdef bint hungry
        cdef int64_t n
        with nogil:
            n = self._service(&hungry)
        return n, bool(hungry)

    def reset_announcement(self):
        """A re-sent PartitionRequest carries all available buffers as its
        initial credit; returns that credit."""
        cdef int64_t n
        with nogil:
            pthread_mutex_lock(&self.mu)
            self._unannounced = 0
            n = self.n_excl + self.n_float
            self._granted = self._taken + n
            pthread_mutex_unlock(&self.mu)
        return n

    def detach(self):
        """The channel stopped (finished, failed, cancelled): the receive loop
        leaves its frames to Python and announces nothing more."""
        with nogil:
            pthread_mutex_lock(&self.mu)
            self._detached = True
            pthread_mutex_unlock(&self.mu)

    def release(self):
        """Give every reserved buffer back to its pool and unpin the pools
        (channel finished or failed)."""
        with nogil:
            self._release_all()
        self._unpin()


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
            raise _lost(<int>self.err_a)
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
            n = fb_recv2(self.fd, a, alen, b, blen, MSG_DONTWAIT)
            if n != -EAGAIN and n != -EWOULDBLOCK:
                return n
            self._wake_due()
            if self.rfd >= 0:
                n = self._await_socket()
                if n < 0:
                    return n
        return fb_recv2(self.fd, a, alen, b, blen, 0)

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

