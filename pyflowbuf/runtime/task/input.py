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
    wait. With a chain that is slow per record (a sink at 3 ms a record, a
    batched function whose time grows with its batch) a batch of
    ``max_batch`` records would hold an unaligned barrier for seconds; read
    in batches of ``target_ns`` worth, it waits for one of them, or for one
    record where a record takes longer. A fast chain keeps ``max_batch``
    (a smaller size doubles again while batches are quick).

    A function whose cost is per call rather than per record (a round trip
    per batch) would only get slower with smaller batches: when
    ``PER_CALL_SAMPLES`` smaller batches in a row each took more than twice
    the larger one's time per record, the larger size becomes the floor,
    and a barrier waits for one such batch (what cannot be split). Several
    in a row, not one: a thread kept off the CPU or waiting for the GIL
    (5 ms at a time) makes one record of 3 ms look like 8, and one such
    sample made a per-record chain a per-call one for good (the smallest of
    several samples is the estimate noise cannot inflate). Time blocked on
    an output buffer counts too: under backpressure reads get smaller, which
    costs nothing there (the task would wait anyway), and grow back once it
    clears.

    ``observe`` takes the timings, so a test drives it with made-up ones::

        >>> s = BatchSizer(1024, target_ns=2_000_000)
        >>> s.observe(200, 200 * 3_000_000)       # 3 ms a record
        >>> s.size
        1
        >>> s.observe(1, 8_000_000)               # one record slowed by the scheduler
        >>> s.size, s.floor
        (1, 1)
    """

    # smaller batches in a row that must look per call before the size
    # stops shrinking (each compared with the first slow batch)
    PER_CALL_SAMPLES = 3

    __slots__ = ("size", "max", "target_ns", "floor", "_prev", "_strikes")

    def __init__(self, max_batch: int, target_ns: int = 2_000_000):
        # From max_batch down, not from one record up: starting small, a
        # function whose cost is per call would never show it (no larger
        # batch to compare with) and stay at one record a call. The price:
        # a first batch at a slow operator is max_batch records.
        self.size = self.max = max_batch
        self.target_ns = target_ns
        self.floor = 1
        self._prev = None       # (size, ns) of the first batch found slow: what smaller ones compare with
        self._strikes = 0       # smaller batches in a row since then that looked per call

    def observe(self, n: int, ns: int) -> None:
        """A batch of ``n`` records took ``ns`` to process."""
        anchor = self._prev
        if anchor is not None and n < anchor[0]:
            if ns * anchor[0] > 2 * anchor[1] * n:
                # per call, not per record: at a fraction of the size a
                # record costs more than twice what it did; smaller batches
                # do not help. (Against the first slow size, not the last:
                # shrinking by small steps, each step alone never shows it.)
                self._strikes += 1
                if self._strikes >= self.PER_CALL_SAMPLES:
                    self.floor = self.size = anchor[0]
                    self._prev = None
                    self._strikes = 0
                    return
            else:
                self._strikes = 0
        if ns > self.target_ns:
            size = max(self.floor, n * self.target_ns // ns)
            if size < self.size:
                if anchor is None or n >= anchor[0]:
                    self._prev = (n, ns)
                    self._strikes = 0
                self.size = size
        elif ns * 2 <= self.target_ns and self.size < self.max and n >= self.size:
            self.size = min(self.max, self.size * 2)


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
