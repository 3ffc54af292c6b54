# Part of netio.pyx (included; one module, pyflowbuf._core.netio):
# the consumer side's books: ReceiverCredit (Flink's BufferManager of one
# remote input channel: exclusive and floating buffers, announced credit).
# Uses the cimports and constants at the top of netio.pyx.


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
