"""ResultSubpartition queues and InputGates for the in-process (local) exchange.

A BufferQueue is the queue of finished buffers of one ResultSubpartition; the
consuming task's InputGate reads it directly as a local InputChannel (a remote
channel fills the same kind of queue from the network). Data buffers are
bounded by the producer's LocalBufferPool, so the ring never needs to grow.
"""
cimport cython
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memset

from pyflowbuf._core.errors cimport check
from pyflowbuf._core.memory cimport Buffer, NetworkBufferPool, Notifier
from pyflowbuf.includes.arena cimport fb_pool_recycle, fb_segment_ptr
from pyflowbuf.includes.errors cimport *
from pyflowbuf.includes.park cimport *
from pyflowbuf.includes.ring cimport *

# the event codes, defined once (csrc/fb_events.h), under their older import path
from pyflowbuf._core.events import (BARRIER, BARRIER_UNALIGNED, CANCEL_BARRIER, END_OF_DATA,
                                    END_OF_PARTITION, USER_EVENT)


@cython.final
cdef class BufferQueue:
    """Finished buffers of one subpartition, in order, plus a priority lane
    that events (checkpoint barriers) use to overtake queued data."""

    def __cinit__(self, NetworkBufferPool network_pool not None, capacity=None):
        if capacity is None:
            capacity = network_pool.total_segments + 64
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2, got {capacity}")
        self.ring = fb_ring_new(capacity)
        self.prio = fb_ring_new(64)
        if self.ring is NULL or self.prio is NULL:
            fb_ring_delete(self.ring)
            fb_ring_delete(self.prio)
            self.ring = self.prio = NULL
            raise MemoryError("BufferQueue")
        check(fb_event_init(&self.space), "BufferQueue")
        self._ready = True
        self.network_pool = network_pool

    def __dealloc__(self):
        if not self._ready:
            return
        cdef fb_bufdesc d
        while fb_ring_pop(self.prio, &d) == FB_OK:
            if d.pool is not NULL:  # a priority lane can hold data buffers too
                fb_pool_recycle(d.pool, d.seg)
        while fb_ring_pop(self.ring, &d) == FB_OK:
            if d.pool is not NULL:
                fb_pool_recycle(d.pool, d.seg)
        fb_ring_delete(self.ring)
        fb_ring_delete(self.prio)
        fb_event_destroy(&self.space)

    cdef int attach(self, Notifier consumer) except -1:
        self._consumer_ref = consumer
        self.consumer = &consumer.ev
        return 0

    cdef int push(self, const fb_bufdesc *d, bint priority) except -1 nogil:
        cdef int rc = self.push_quiet(d, priority)
        if rc == 1:
            self.wake_consumer()
        return 0 if rc == 1 else rc

    cdef int push_quiet(self, const fb_bufdesc *d, bint priority) except -1 nogil:
        """``push`` that leaves waking the consumer to the caller: returns 1
        when the consumer must be woken (``wake_consumer``), else 0 or an
        error code. A receive loop that knows more data is arriving wakes
        the consumer once for several buffers."""
        cdef fb_ring *r = self.prio if priority else self.ring
        cdef uint32_t token
        while fb_ring_push(r, d) != FB_OK:
            token = fb_event_prepare(&self.space)
            if fb_ring_push(r, d) == FB_OK:
                fb_event_cancel(&self.space)
                break
            if self.cancelled:
                fb_event_cancel(&self.space)
                return FB_E_CANCELLED
            fb_event_wait(&self.space, token, 100000000)
        self.buffers_pushed += 1
        self.bytes_pushed += d.size
        # A consumer parks only once it has taken everything, so only the
        # first descriptor after that needs to wake it. This keeps a network
        # writer that waits for credit (with buffers queued) asleep while the
        # producer keeps filling the queue.
        return 1 if self.consumer is not NULL and fb_ring_was_empty(r) else 0

    cdef void wake_consumer(self) noexcept nogil:
        if self.consumer is not NULL:
            fb_event_notify(self.consumer)

    cdef int pop(self, fb_bufdesc *d) noexcept nogil:
        if fb_ring_pop(self.prio, d) == FB_OK or fb_ring_pop(self.ring, d) == FB_OK:
            fb_event_notify(&self.space)
            return FB_OK
        return FB_E_UNAVAILABLE

    cdef int pop_lane(self, fb_bufdesc *d, bint priority) noexcept nogil:
        """Pop from one lane only: the one ``peek`` named. ``pop`` prefers
        the priority lane, and the producer may push to it between a
        consumer's ``peek`` and its pop; taking "whatever is first" then
        would hand the consumer an item of another lane than the one it
        decided about (an event where it expects a data buffer)."""
        if fb_ring_pop(self.prio if priority else self.ring, d) == FB_OK:
            fb_event_notify(&self.space)
            return FB_OK
        return FB_E_UNAVAILABLE

    cdef fb_bufdesc *peek(self, bint *priority) noexcept nogil:
        """The descriptor ``pop`` would take next (priority lane first), left
        in place; NULL when both lanes are empty. Consumer side only."""
        cdef fb_bufdesc *d = fb_ring_peek(self.prio)
        priority[0] = d is not NULL
        if d is NULL:
            d = fb_ring_peek(self.ring)
        return d

    def push_event(self, int kind, long long aux=0, int flags=0, bint priority=False, long long mark=-1):
        """Enqueue an event (end of partition, barrier, ...). Events take no
        segment and are never blocked by a dry pool.

        A priority event carries ``mark``: the data lane's push count it was
        sent at (default: now), so the consumer can tell which queued items it
        overtook (``overtaken``). Producer side only."""
        cdef fb_bufdesc d
        d.pool = NULL
        d.seg = <uint32_t>(mark if mark >= 0 else (fb_ring_tail(self.ring) if priority else 0))
        d.size = 0
        d.width = kind
        d.type = FB_DATA_EVENT
        d.flags = flags
        d.aux = aux
        cdef int rc
        with nogil:
            rc = self.push(&d, priority)
        check(rc, "push_event")

    def push_buffer(self, Buffer buf not None, bint priority=False):
        """Hand a finished Buffer to the consumer (ownership moves with it)."""
        if buf._state != 0:
            from pyflowbuf.errors import BufferRecycledError
            raise BufferRecycledError("cannot enqueue a released buffer")
        if buf._exports:
            raise BufferError("cannot enqueue a buffer with live views")
        if buf._arena_owner is not self.network_pool:
            raise ValueError("the buffer belongs to another NetworkBufferPool than this queue")
        if buf.d.pool is NULL or buf.d.type == FB_DATA_EVENT:
            # a consumer recycles every data buffer to its pool: one without
            # a pool (or marked as an event) must not look like data there
            raise ValueError("only a data buffer from a LocalBufferPool can be enqueued "
                             f"(this one has {'no pool' if buf.d.pool is NULL else 'the event type'})")
        cdef fb_bufdesc d = buf.d
        cdef int rc
        with nogil:
            rc = self.push(&d, priority)
        check(rc, "push_buffer")
        buf._state = 1  # the queue owns the segment now

    def pop_buffer(self):
        """Take the next Buffer (data) or ``(kind, aux, flags)`` (event), or None."""
        cdef fb_bufdesc d
        if self.pop(&d) != FB_OK:
            return None
        if d.type == FB_DATA_EVENT:
            return (d.width, d.aux, d.flags)
        return Buffer.wrap(&d, self.network_pool)

    @property
    def push_position(self):
        """Items pushed to the data lane so far (producer side): the mark of an
        event pushed now."""
        return fb_ring_tail(self.ring)

    def overtaken(self, long long mark):
        """Consumer side, right after taking a priority event with ``mark``:
        how many data-lane items ahead of the head were pushed before it
        (negative: the head has passed that point already)."""
        return <int32_t>(<uint32_t>mark - <uint32_t>fb_ring_head(self.ring))

    def copy_front(self, Py_ssize_t count):
        """Consumer side: copies of the next ``count`` data-lane items, left in
        place, as ``(type, width, flags, aux, payload)``; payload is bytes for
        data buffers and None for events. The in-flight data an unaligned
        barrier overtook: copied, so the consumer processes and recycles the
        segments as usual while the copies are written to the checkpoint."""
        cdef Py_ssize_t size = <Py_ssize_t>fb_ring_size(self.ring), i
        cdef fb_bufdesc *d
        cdef list out = []
        if count > size:
            raise ValueError(f"only {size} items queued, asked for {count}")
        for i in range(count):
            d = fb_ring_at(self.ring, i)
            if d.type == FB_DATA_EVENT:
                out.append((d.type, d.width, d.flags, d.aux, None))
            else:
                out.append((d.type, d.width, d.flags, d.aux,
                            PyBytes_FromStringAndSize(fb_segment_ptr(self.network_pool.a, d.seg), d.size)))
        return out

    def cancel(self):
        self.cancelled = 1
        fb_event_notify_all(&self.space)
        if self.consumer is not NULL:
            fb_event_notify_all(self.consumer)

    @property
    def backlog(self):
        """Finished buffers queued and not yet consumed (Flink's backlog)."""
        return fb_ring_size(self.ring)

    @property
    def priority_backlog(self):
        return fb_ring_size(self.prio)

    def __len__(self):
        return fb_ring_size(self.ring) + fb_ring_size(self.prio)

    def __repr__(self):
        return f"BufferQueue(backlog={self.backlog}, pushed={self.buffers_pushed})"


@cython.final
cdef class InputGate:
    """A consumer task's input: one channel per producer subpartition.

    Reading is fair across channels (round robin), priority events first.
    Blocked channels (barrier alignment) are skipped. Waiting parks the thread
    on the gate's Notifier with the GIL released."""

    def __cinit__(self, queues, Notifier notifier=None):
        queues = list(queues)
        if not queues:
            raise ValueError("an InputGate needs at least one channel")
        for obj in queues:
            if not isinstance(obj, BufferQueue):
                raise TypeError(f"channels must be BufferQueues, got {type(obj).__name__}")
        self._queues = queues
        self.num_channels = len(queues)
        self.notifier = notifier if notifier is not None else Notifier()
        self.rings = <fb_ring **>PyMem_Malloc(sizeof(fb_ring *) * self.num_channels)
        self.prios = <fb_ring **>PyMem_Malloc(sizeof(fb_ring *) * self.num_channels)
        self.spaces = <fb_event **>PyMem_Malloc(sizeof(fb_event *) * self.num_channels)
        self.blocked = <unsigned char *>PyMem_Malloc(self.num_channels)
        self.finished = <unsigned char *>PyMem_Malloc(self.num_channels)
        if not self.rings or not self.prios or not self.spaces or not self.blocked or not self.finished:
            raise MemoryError()
        memset(self.blocked, 0, self.num_channels)
        memset(self.finished, 0, self.num_channels)
        cdef BufferQueue q
        cdef int i
        for i in range(self.num_channels):
            q = <BufferQueue>queues[i]
            self.rings[i] = q.ring
            self.prios[i] = q.prio
            self.spaces[i] = &q.space
            q.attach(self.notifier)

    def __dealloc__(self):
        PyMem_Free(self.rings)
        PyMem_Free(self.prios)
        PyMem_Free(self.spaces)
        PyMem_Free(self.blocked)
        PyMem_Free(self.finished)

    cdef int poll(self, fb_bufdesc *d, int *channel) noexcept nogil:
        cdef int n = self.num_channels, i, idx
        for i in range(n):
            if fb_ring_pop(self.prios[i], d) == FB_OK:
                fb_event_notify(self.spaces[i])
                channel[0] = i
                return FB_OK
        for i in range(n):
            idx = self.next_channel + i
            if idx >= n:
                idx -= n
            if self.blocked[idx]:
                continue
            if fb_ring_pop(self.rings[idx], d) == FB_OK:
                fb_event_notify(self.spaces[idx])
                self.next_channel = idx + 1 if idx + 1 < n else 0
                channel[0] = idx
                return FB_OK
        return FB_E_UNAVAILABLE

    cdef int poll_priority(self, fb_bufdesc *d, int channel) noexcept nogil:
        """Pop from ``channel``'s priority lane only."""
        if fb_ring_pop(self.prios[channel], d) == FB_OK:
            fb_event_notify(self.spaces[channel])
            return FB_OK
        return FB_E_UNAVAILABLE

    cdef int poll_wait(self, fb_bufdesc *d, int *channel, int64_t timeout_ns) noexcept nogil:
        """Poll; when nothing is there park until a producer pushes, the
        timeout passes (FB_E_TIMEOUT) or the gate is cancelled."""
        cdef int rc = self.poll(d, channel)
        if rc == FB_OK:
            return rc
        cdef fb_event *ev = &self.notifier.ev
        cdef int64_t start = fb_monotonic_ns()
        cdef int64_t deadline = start + timeout_ns if timeout_ns >= 0 else -1
        cdef int64_t left = -1
        cdef uint32_t token
        while True:
            token = fb_event_prepare(ev)
            rc = self.poll(d, channel)
            if rc == FB_OK:
                fb_event_cancel(ev)
                break
            if self.cancelled:
                fb_event_cancel(ev)
                rc = FB_E_CANCELLED
                break
            if deadline >= 0:
                left = deadline - fb_monotonic_ns()
                if left <= 0:
                    fb_event_cancel(ev)
                    rc = FB_E_TIMEOUT
                    break
            fb_event_wait(ev, token, left)
        self.idle_ns += fb_monotonic_ns() - start
        return rc

    def block(self, int channel):
        """Stop reading data from ``channel`` (barrier alignment); priority
        events still get through."""
        self._check(channel)
        self.blocked[channel] = 1

    def resume(self, int channel=-1):
        """Resume one channel, or all with -1."""
        if channel == -1:
            memset(self.blocked, 0, self.num_channels)
        else:
            self._check(channel)
            self.blocked[channel] = 0
        fb_event_notify_all(&self.notifier.ev)

    def is_blocked(self, int channel):
        self._check(channel)
        return bool(self.blocked[channel])

    def _check(self, int channel):
        if not 0 <= channel < self.num_channels:
            raise IndexError(f"channel {channel} out of range (gate has {self.num_channels})")

    def cancel(self):
        self.cancelled = 1
        fb_event_notify_all(&self.notifier.ev)

    @property
    def channels(self):
        return tuple(self._queues)

    @property
    def queued_buffers(self):
        cdef int i
        cdef uint64_t total = 0
        for i in range(self.num_channels):
            total += fb_ring_size(self.rings[i]) + fb_ring_size(self.prios[i])
        return total

    def queued_per_channel(self):
        """Buffers queued on each channel, in one call (the debloater's
        buffers in use, per channel as Flink sums them)."""
        cdef int i
        return [fb_ring_size(self.rings[i]) + fb_ring_size(self.prios[i]) for i in range(self.num_channels)]

    def queued_bytes_per_channel(self):
        """Bytes in the data buffers queued on each channel (the in-flight
        data of the gate). Consumer side: call it from the reading thread."""
        cdef int i, j
        cdef uint64_t k, n, total
        cdef fb_ring *r
        out = []
        for i in range(self.num_channels):
            total = 0
            for j in range(2):
                r = self.rings[i] if j == 0 else self.prios[i]
                n = fb_ring_size(r)
                for k in range(n):
                    total += fb_ring_at(r, k).size
            out.append(total)
        return out

    def __repr__(self):
        return f"InputGate(channels={self.num_channels}, queued={self.queued_buffers})"
