"""Credit-based flow control for one remote InputChannel, both ends.

Credit is a buffer the receiver has reserved for a channel. The two classes
here hold all the accounting and no sockets, so the model-based test drives
them directly; the server and client only move their decisions onto the wire.

Invariant (credit mode), per channel::

    receiver.available == sender.credit + AddCredit in flight
                          + receiver.unannounced + data BufferResponses in flight

so every data buffer that reaches the receiver finds a reserved segment, and
the sender's credit never goes negative.
"""
from __future__ import annotations

from collections import deque

from pyflowbuf.errors import InsufficientBuffersError, ProtocolError

DATA = 0
EVENT = 1
BACKLOG = 2

_SEQ_MASK = 0x7FFFFFFF
_BARRIER = 1  # pyflowbuf._core.channel.BARRIER


class ReceiverCredit:
    """Flink's BufferManager for one RemoteInputChannel.

    ``initial_credit`` exclusive buffers come from ``exclusive_pool`` (one pool
    per channel, at least that many segments guaranteed) and always return to
    this channel; floating buffers come from the gate-wide ``floating_pool`` as
    the sender's backlog asks for them (aim: backlog + initial_credit buffers
    available). A buffer the receiver fills leaves ``available``; when the
    consumer recycles it the segment goes back to its pool and ``replenish``
    reserves it again, which is new credit.

    Threads: the connection's reader thread calls ``take`` and sets
    ``backlog``; one control thread calls everything else. Two deques and
    single-writer counters make that safe without a lock.
    """

    __slots__ = ("exclusive_pool", "floating_pool", "initial_credit", "_excl", "_float",
                 "backlog", "unannounced", "granted", "waiting_floating", "taken", "low_water")

    def __init__(self, exclusive_pool, floating_pool, initial_credit):
        if initial_credit < 0:
            raise ValueError(f"exclusive buffers must be >= 0, got {initial_credit}")
        if initial_credit and exclusive_pool is None:
            raise ValueError("exclusive buffers need an exclusive_pool")
        if initial_credit == 0 and floating_pool is None:
            raise ValueError("a channel with 0 exclusive buffers needs a floating pool (or it can never "
                             "receive data)")
        self.exclusive_pool = exclusive_pool
        self.floating_pool = floating_pool
        self.initial_credit = initial_credit
        self._excl = deque()
        self._float = deque()
        self.backlog = 0
        self.unannounced = 0
        self.granted = 0          # total credit given to the sender, initial included
        self.waiting_floating = False
        self.taken = 0            # buffers filled with received data
        self.low_water = 1        # announce once the sender may hold this little credit

    def setup(self) -> int:
        """Reserve the exclusive buffers; returns the initial credit."""
        for _ in range(self.initial_credit):
            b = self.exclusive_pool.request()
            if b is None:
                self.release()
                raise InsufficientBuffersError(
                    f"insufficient number of network buffers: a remote channel needs {self.initial_credit} "
                    f"exclusive buffers, its pool gave {len(self._excl)}")
            self._excl.append(b)
        self.granted = self.initial_credit
        self.low_water = max(1, self.initial_credit // 2)
        return self.initial_credit

    @property
    def available(self):
        return len(self._excl) + len(self._float)

    @property
    def required(self):
        return self.backlog + self.initial_credit

    def take(self):
        """A reserved empty buffer for an arriving data buffer (floating first,
        as Flink does), or None when the sender overran the credit it was given."""
        if self.taken >= self.granted:
            return None
        try:
            b = self._float.popleft()
        except IndexError:
            try:
                b = self._excl.popleft()
            except IndexError:
                return None
        self.taken += 1
        return b

    def needs_floating(self):
        return self.floating_pool is not None and self.available < self.required

    def replenish(self) -> int:
        """Re-reserve recycled exclusive buffers and request floating ones for
        the backlog. Returns the credit not yet announced."""
        pool = self.exclusive_pool
        if pool is not None:
            while pool.in_use < self.initial_credit:
                b = pool.request()
                if b is None:
                    break
                self._excl.append(b)
                # An exclusive buffer back while we hold more than the backlog
                # needs: give a floating one back to the gate instead (a swap,
                # so the sender's credit does not change).
                if self.available > self.required:
                    try:
                        f = self._float.pop()
                    except IndexError:
                        self.unannounced += 1
                    else:
                        f.recycle()
                else:
                    self.unannounced += 1
        fp = self.floating_pool
        if fp is not None:
            need = self.required - self.available
            self.waiting_floating = False
            while need > 0:
                b = fp.request()
                if b is None:
                    self.waiting_floating = True
                    break
                self._float.append(b)
                self.unannounced += 1
                need -= 1
        return self.unannounced

    def should_announce(self):
        """Whether to send the unannounced credit now.

        Flink announces on every 0 -> positive change. Here credit is held back
        while the sender still has plenty: ``granted - taken`` bounds its credit
        from above, and credit goes out once that falls to the low-water mark
        (half of what it had after the last announcement) or to what we would
        give. So one AddCredit carries several buffers, and a sender that may be
        at 0 always gets credit at once: this never stalls a channel."""
        n = self.unannounced
        if n <= 0:
            return False
        slack = self.granted - self.taken
        return slack <= n or slack <= self.low_water

    def hungry(self):
        """Whether the control thread must hear every recycle for this channel:
        the sender may run dry. (Floating buffers still awaited are picked up
        at the next pass; while the sender has credit nothing waits on them.)"""
        return self.granted - self.taken <= self.low_water

    def announce(self) -> int:
        """Take the credit to send in one AddCredit (0: nothing to send)."""
        n = self.unannounced
        self.unannounced = 0
        self.granted += n
        self.low_water = max(1, (self.granted - self.taken) // 2)
        return n

    def reset_announcement(self) -> int:
        """A re-sent PartitionRequest carries all available buffers as its
        initial credit; returns that credit."""
        self.unannounced = 0
        self.granted = self.available
        return self.available

    def release(self):
        """Give every reserved buffer back to its pool (channel finished or failed)."""
        for dq in (self._excl, self._float):
            while True:
                try:
                    b = dq.pop()
                except IndexError:
                    break
                b.recycle()
        self.waiting_floating = False


class SenderView:
    """Flink's CreditBasedSequenceNumberingViewReader: the sending end of one
    subpartition on one connection.

    ``poll`` decides what goes next: an event always (events cost no credit),
    a data buffer only against credit; in credit mode with 0 exclusive buffers
    it announces the backlog so the receiver can reserve floating buffers
    (FLINK-16641). Items popped but not sendable wait in ``_pending``; a
    priority item (unaligned barrier) goes ahead of pending data.

    Threads: the connection's reader thread calls ``add_credit``/``resume``;
    the writer thread calls ``poll``. Counters have one writer each.
    """

    __slots__ = ("queue", "receiver_id", "subpartition", "initial_credit", "credit_based",
                 "block_on_barrier", "_added", "_used", "seq", "_pending", "_npending_prio",
                 "_told_backlog", "blocked", "finished", "cancelled", "buffers_sent", "bytes_sent",
                 "announcements", "gate_ref", "export")

    def __init__(self, queue, receiver_id, subpartition, initial_credit, credit_based=True,
                 block_on_barrier=False):
        self.queue = queue
        self.receiver_id = receiver_id
        self.subpartition = subpartition
        self.initial_credit = initial_credit
        self.credit_based = credit_based
        self.block_on_barrier = block_on_barrier
        self._added = initial_credit
        self._used = 0
        self.seq = 0
        self._pending = deque()
        self._npending_prio = 0
        self._told_backlog = 0
        self.blocked = False
        self.finished = False
        self.cancelled = None     # set by the reader thread: the exception to release with
        self.buffers_sent = 0
        self.bytes_sent = 0
        self.announcements = 0
        self.gate_ref = None
        self.export = None

    @property
    def credit(self):
        return self._added - self._used

    def add_credit(self, n):
        if n <= 0:
            raise ProtocolError(f"AddCredit of {n}")
        self._added += n

    def resume(self):
        self.blocked = False

    @property
    def backlog(self):
        return self.queue.backlog + len(self._pending)

    def _fill(self):
        q = self.queue
        if q.priority_backlog:
            item = q.pop_buffer()   # the priority lane is popped first
            if item is not None:
                self._pending.insert(self._npending_prio, (item, True))
                self._npending_prio += 1
        elif not self._pending:
            item = q.pop_buffer()
            if item is not None:
                self._pending.append((item, False))

    def poll(self):
        """``(DATA, buffer, seq, backlog, priority)``,
        ``(EVENT, (kind, aux, flags), seq, backlog, priority)``,
        ``(BACKLOG, None, -1, backlog, False)`` or None."""
        if self.finished:
            return None
        self._fill()
        pend = self._pending
        if not pend:
            return None
        item, prio = pend[0]
        is_event = type(item) is tuple
        if self.blocked and not prio:
            return None
        if not is_event and self.credit_based and self._added - self._used <= 0:
            if self.initial_credit == 0:
                backlog = self.backlog
                if backlog > self._told_backlog:
                    self._told_backlog = backlog
                    self.announcements += 1
                    return (BACKLOG, None, -1, backlog, False)
            return None
        pend.popleft()
        if prio:
            self._npending_prio -= 1
        seq = self.seq
        self.seq = (seq + 1) & _SEQ_MASK
        backlog = self.queue.backlog + len(pend)
        self._told_backlog = backlog
        if is_event:
            if self.block_on_barrier and item[0] == _BARRIER and not prio:
                self.blocked = True
            return (EVENT, item, seq, backlog, prio)
        self._used += 1
        self.buffers_sent += 1
        self.bytes_sent += item.size
        return (DATA, item, seq, backlog, prio)

    def release(self):
        """Recycle buffers popped but not sent (the view was cancelled)."""
        self.finished = True
        while self._pending:
            item, _ = self._pending.popleft()
            if type(item) is not tuple:
                item.recycle()
        self._npending_prio = 0
