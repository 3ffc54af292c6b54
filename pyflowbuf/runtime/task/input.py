"""The input processor: the default action of a subtask's mailbox loop when
it reads input gates, one loop for one input or several.

A task with several inputs (union, connect) reads a ``MultiInput`` and hands
each batch, and each event, on with the index of the input it came from; a
task with one input reads its ``InputSide`` through ``OneInput``, which
answers the same way with index 0. The loop is written once, so its guards
hold for both.
"""
from __future__ import annotations

import time

from pyflowbuf._core.events import BARRIER, CANCEL_BARRIER, EVT_WATERMARK
from pyflowbuf.exchange.sides import MultiInput
from pyflowbuf.runtime.task.mailbox import OutputFlusher


class OneInput:
    """One ``InputSide`` read as a ``MultiInput`` of one: ``read`` gives
    ``(0, batch)``, ``take_event`` ``(0, event)``."""

    __slots__ = ("side", "sides")

    def __init__(self, side):
        self.side = side
        self.sides = (side,)

    def read(self, max_records, timeout):
        side = self.side
        # An event that ended the last read is still pending: reading again
        # would go past it (and a second event would replace it, so a barrier
        # got lost and its alignment hung until end of input). MultiInput.read
        # keeps the same rule.
        if side.has_event:
            return 0, []
        return 0, side.read(max_records, timeout)

    def take_event(self):
        ev = self.side.take_event()
        return None if ev is None else (0, ev)

    @property
    def finished(self):
        return self.side.finished


class BatchSizer:
    """How many records the input processor reads at a time, so that what it
    reads takes about ``target_ns`` to process at most.

    Between two reads the task looks at its mailbox and takes the priority
    events first (an overtaking barrier, a cancel): a batch is where they
    wait. With a chain that is slow per record (a map at 3 ms a record, a
    batched function whose time grows with its batch) a batch of
    ``max_batch`` records would hold an unaligned barrier for seconds; read
    in batches of ``target_ns`` worth, it waits for one of them, or for one
    record where a record takes longer.

    It starts at one record and doubles while batches are quick, so not
    even the first batch of a slow operator holds a barrier for
    ``max_batch`` records (starting at ``max_batch``, the first checkpoint
    of a job with a map at 3 ms a record waited 3 s for it).

    A function whose cost is per call rather than per record (a round trip
    per batch) would only get slower with smaller batches. Where a batch
    at the smallest size (``floor``) is over the target, the sizer tries
    twice the size: if twice the records take less than 1.5 times as long,
    much of the cost is per call, and the larger size becomes the floor
    (and it tries the next); if not, it goes back and tries again less often
    (every 2, 4, ... up to ``MAX_GAP`` slow batches). Where twice the records
    take ``NOT_PER_CALL`` times as long or more, the cost is per record and
    the floor goes back to one record: a floor once set comes back down.
    Each decision compares the fastest of ``SAMPLES`` batches at each size,
    never one batch: a thread kept off the CPU or waiting for the GIL (5 ms
    at a time) makes a record of 3 ms look like 8, and one such sample must
    not make a per-record chain a per-call one. Time blocked on an output
    buffer counts too: under backpressure reads get smaller, which costs
    nothing there (the task would wait anyway), and grow back once it
    clears.

    ``observe`` takes the timings, so a test drives it with made-up ones::

        >>> s = BatchSizer(1024, target_ns=2_000_000)
        >>> s.size
        1
        >>> for _ in range(4):
        ...     s.observe(s.size, s.size * 3_000_000)    # 3 ms a record
        >>> s.size, s.floor                               # twice the records took twice the time
        (1, 1)
        >>> s.observe(1, 8_000_000)                       # one record slowed by the scheduler
        >>> s.size, s.floor
        (1, 1)
    """

    SAMPLES = 2         # batches at a size whose fastest is that size's cost
    MAX_GAP = 64        # slow batches at the floor between two tries of twice the size, at most
    NOT_PER_CALL = 1.8  # twice the records at least this many times as long: per record

    __slots__ = ("size", "max", "target_ns", "floor", "_best", "_samples", "_gap", "_probe")

    def __init__(self, max_batch: int, target_ns: int = 2_000_000):
        self.max = max_batch
        self.size = 1
        self.target_ns = target_ns
        self.floor = 1
        self._best = 0          # the fastest of the batches at this size since the last try
        self._samples = 0
        self._gap = self.SAMPLES
        self._probe = None      # (size, fastest ns) it came from while it tries twice that size

    def _set(self, size: int) -> None:
        self.size = size
        self._samples = 0

    def _sample(self, ns: int) -> int:
        self._best = ns if self._samples == 0 else min(self._best, ns)
        self._samples += 1
        return self._samples

    def observe(self, n: int, ns: int) -> None:
        """A batch of ``n`` records took ``ns`` to process."""
        probe = self._probe
        if probe is not None:
            if n != self.size:
                # a short read: no answer; back to the size it came from
                self._probe = None
                self._set(probe[0])
                return
            if self._sample(ns) < self.SAMPLES:
                return
            base_n, base_ns = probe
            best = self._best
            self._probe = None
            if best * 2 < base_ns * 3:
                # twice the records in less than 1.5 times the time: much
                # of the cost is per call; smaller batches would not help
                self.floor = self.size
                self._gap = self.SAMPLES
                if best > self.target_ns and self.size < self.max:
                    self._probe = (self.size, best)
                    self._set(min(self.max, self.size * 2))
                return
            if best >= base_ns * self.NOT_PER_CALL:
                self.floor = 1      # per record at this size: a floor set by noise goes
            self._gap = min(self.MAX_GAP, self._gap * 2)
            self._set(base_n)
            return
        target = self.target_ns
        if ns > target:
            size = max(self.floor, n * target // ns)
            if size < self.size:
                self._set(size)
            elif n == self.size and self.size < self.max and self._sample(ns) >= self._gap:
                # over the target at the floor: try twice the size
                self._probe = (self.size, self._best)
                self._set(min(self.max, self.size * 2))
        elif ns * 2 <= target and n >= self.size and self.size < self.max:
            self._set(min(self.max, self.size * 2))


class InputProcessor:
    """Reads a subtask's inputs and hands what comes to its parts: batches to
    the operator chain, barriers to the checkpoint side, watermarks to event
    time, any other event to ``job.event_handler(task, event, input_index)``.

    Between reads it runs the mailbox, waits for an output buffer where
    outputs are gated (unaligned checkpoints), and ships partly filled
    buffers before it idles and on the buffer timeout.
    """

    def __init__(self, task, input_side, chain, mailbox, checkpoints, event_time, outputs: list):
        self.task = task
        self.job = task.job
        self.input = input_side if isinstance(input_side, MultiInput) else OneInput(input_side)
        self.sides = list(self.input.sides)
        self.chain = chain
        self.mailbox = mailbox
        self.checkpoints = checkpoints
        self.event_time = event_time
        self.outputs = outputs
        self.records_in = 0
        self.sizer = BatchSizer(task.job.spec.max_batch)
        mailbox.take_priority_events = self.take_priority_events

    def run(self) -> None:
        """Read until every input has ended (or the job is cancelled)."""
        job, inp, mailbox, checkpoints = self.job, self.input, self.mailbox, self.checkpoints
        mails, outputs, sides = mailbox.mails, self.outputs, self.sides
        timeout, sizer = job.spec.network_config.buffer_timeout, self.sizer
        size = sizer.size
        target = sizer.target_ns
        clock = time.monotonic_ns
        flusher = OutputFlusher(outputs, timeout)
        per_record = timeout == 0
        idle_wait = max(timeout, 0.05)
        process = self.chain.process
        timestamped = self.chain.timestamped
        # unaligned checkpoints: a barrier in a priority lane goes ahead of
        # the rest of a buffer the reader is in the middle of (which it
        # would otherwise finish first: at a slow operator, many batches)
        priority = mailbox.notifier is not None
        take_priority = self.take_priority_events
        while not job.cancelled:
            if mails:
                mailbox.drain()
            if priority:
                if mailbox.output_blocked():
                    mailbox.wait_for_output()
                    if mailbox.frozen:
                        self._wait_frozen()
                    continue
                if take_priority():
                    if mailbox.frozen:
                        self._wait_frozen()
                    continue
            index, batch = inp.read(size, 0)
            if checkpoints.aligner is not None:
                checkpoints.check_channel_ends()
            if not batch:
                got = inp.take_event()
                if got is not None:
                    self.on_event(got[1], got[0])
                    if mailbox.frozen:
                        self._wait_frozen()
                    continue
                if inp.finished:
                    return
                flusher.flush()     # about to idle: ship what is buffered first (Flink flushes too)
                index, batch = inp.read(size, idle_wait)
                if not batch:
                    continue
            self.records_in += len(batch)
            ts = sides[index].ts if timestamped else None
            if per_record:
                for i, rec in enumerate(batch):
                    process([rec], None if ts is None else ts[i:i + 1], index)
                    for out in outputs:
                        out.flush()
            else:
                t0 = clock()
                process(batch, ts, index)
                t1 = clock()
                flusher.flush_if_due(t1)
                if t1 - t0 > target or size < sizer.max:
                    sizer.observe(len(batch), t1 - t0)
                    size = sizer.size

    def _wait_frozen(self) -> None:
        """The task sent a stop barrier: read no input (what comes after the
        barrier is after the savepoint) until the job ends or the savepoint
        fails; control mails run meanwhile."""
        job, mailbox = self.job, self.mailbox
        while mailbox.frozen and not job.cancelled:
            if mailbox.mails:
                mailbox.drain()
            time.sleep(0.01)

    def on_event(self, event, input_index: int = 0) -> None:
        """An event other than end-of-partition, with the index of the input
        that delivered it: ``event`` is (channel, kind, aux, flags), channel
        counted within that input's gate."""
        kind = event[1]
        if (kind == BARRIER or kind == CANCEL_BARRIER) and self.checkpoints.aligner is not None:
            self.checkpoints.on_barrier(event, input_index)
            return
        if kind == EVT_WATERMARK:
            self.event_time.on_event(event, input_index)
            return
        handler = self.job.event_handler
        if handler is not None:
            handler(self.task, event, input_index)

    def take_priority_events(self) -> bool:
        """Barriers that overtook the queued input (unaligned), taken while
        the task waits for an output buffer; whether there were any."""
        took = False
        for i, side in enumerate(self.sides):
            if side.reader is None or side.has_event or side.reader.replaying:
                # (replaying restored in-flight data: a barrier waits until
                # it is read, where the reader takes it in its order)
                continue
            ev = side.reader.poll_priority()
            if ev is not None:
                took = True
                self.on_event(ev, i)
        return took
