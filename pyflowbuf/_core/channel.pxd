from libc.stdint cimport int64_t, uint32_t, uint64_t

from pyflowbuf._core.memory cimport NetworkBufferPool, Notifier
from pyflowbuf.includes.park cimport fb_event
from pyflowbuf.includes.ring cimport fb_bufdesc, fb_ring

cdef class BufferQueue:
    cdef fb_ring *ring
    cdef fb_ring *prio
    cdef bint _ready
    cdef fb_event space            # the producer parks here when the ring is full
    cdef fb_event *consumer        # the gate's notifier, told on every push
    cdef Notifier _consumer_ref
    cdef readonly NetworkBufferPool network_pool
    cdef public int cancelled
    cdef readonly uint64_t buffers_pushed
    cdef readonly uint64_t bytes_pushed
    # called by a network sender with (checkpoint id, copies of the items a
    # priority barrier overtook here, or None when an aligned barrier passed)
    cdef public object overtaken_sink
    # Buffer debloating, set by the consumer (a local gate, or the network
    # server on NewBufferSize) and read by the producer: the buffer size the
    # writer caps new buffers at (0: the whole segment) and the bytes the
    # consumer wants in flight on this channel (0: unknown, a remote consumer)
    cdef public uint32_t buffer_size
    cdef public uint64_t desired_bytes
    cdef int push(self, const fb_bufdesc *d, bint priority) except -1 nogil
    cdef int push_quiet(self, const fb_bufdesc *d, bint priority) except -1 nogil
    cdef void wake_consumer(self) noexcept nogil
    cdef int pop(self, fb_bufdesc *d) noexcept nogil
    cdef int pop_lane(self, fb_bufdesc *d, bint priority) noexcept nogil
    cdef fb_bufdesc *peek(self, bint *priority) noexcept nogil
    cdef int attach(self, Notifier consumer) except -1


cdef class InputGate:
    cdef list _queues
    cdef fb_ring **rings
    cdef fb_ring **prios
    cdef fb_event **spaces
    cdef unsigned char *blocked
    cdef unsigned char *finished
    cdef readonly int num_channels
    cdef int next_channel
    cdef readonly Notifier notifier
    cdef public int cancelled
    cdef readonly int64_t idle_ns
    cdef int poll(self, fb_bufdesc *d, int *channel) noexcept nogil
    cdef int poll_priority(self, fb_bufdesc *d, int channel) noexcept nogil
    cdef int poll_wait(self, fb_bufdesc *d, int *channel, int64_t timeout_ns) noexcept nogil
