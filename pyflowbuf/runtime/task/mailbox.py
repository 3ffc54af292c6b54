"""A subtask's mailbox, and what its loop does between batches: run the
mails, wait for an output buffer (unaligned checkpoints), ship partly filled
buffers on the buffer timeout."""
from __future__ import annotations

import collections
import time


class Mailbox:
    """Mails (control messages: checkpoint triggers, timers, user callables)
    that run in the task's thread between batches.

    ``notifier``: set by the job when tasks wait for output buffers between
    batches (unaligned checkpoints); ``take_priority_events``: takes the
    barriers that overtake queued input while the task waits (set by the
    input processor; a source has none).

    ``frozen``: the task sent the barrier of a stop-with-savepoint. Until
    the job ends (or the savepoint fails and the task thaws) only control
    mails run (``ControlMail``: the coordinator's word that a checkpoint
    completed or was aborted); the others (timers, watermark emission,
    triggers) wait in order, since what they would send comes after the
    savepoint and would be sent again by the job restored from it.
    """

    def __init__(self, input_side, outputs: list, source_wakeup=None):
        self.mails: collections.deque = collections.deque()
        self.frozen = False
        self.outputs = outputs
        self.notifier = None
        self.bp_wait_ns = 0
        self.take_priority_events = _none_taken
        self._input = input_side
        # An unbounded source that waits for input (a socket, a watched
        # directory) wakes up for a mail or a cancel instead of polling
        self._source_wakeup = source_wakeup

    def post(self, mail) -> None:
        """Run ``mail()`` in the task's thread between batches."""
        self.mails.append(mail)
        if self._input is not None:
            self._input.notifier.notify()
        elif self.notifier is not None:
            self.notifier.notify()
        if self._source_wakeup is not None:
            self._source_wakeup()

    def drain(self) -> None:
        mails = self.mails
        while mails:
            if self.frozen:     # (a mail may freeze the task: the ones after it wait)
                self._drain_frozen()
                return
            mails.popleft()()

    def _drain_frozen(self) -> None:
        mails, held = self.mails, collections.deque()
        while mails and self.frozen:
            mail = mails.popleft()
            if type(mail) is ControlMail:
                mail()
            else:
                held.append(mail)
        # back in their order, ahead of any not looked at (thawed: the next drain runs them)
        mails.extendleft(reversed(held))

    def output_blocked(self) -> bool:
        """Unaligned checkpoints: whether an output has no buffer to give now.
        The task then waits here, between batches, instead of inside a write,
        so mails (a checkpoint trigger) and overtaking barriers get through
        under backpressure, as Flink's mailbox does."""
        if self.notifier is None:
            return False
        for out in self.outputs:
            if not out.pool.available:
                return True
        return False

    def wait_for_output(self) -> None:
        """Park until an output buffer is free, a mail comes, or an overtaking
        barrier arrives (each wakes the task's Notifier), then take those
        barriers. After a while without a buffer, ship the partly filled ones:
        the consumer may be waiting for exactly those."""
        notifier = self.notifier
        token = notifier.prepare()
        if self.mails or not self.output_blocked() or self.take_priority_events():
            notifier.cancel()
            return
        t0 = time.monotonic_ns()
        woke = notifier.wait(token, 0.05)
        self.bp_wait_ns += time.monotonic_ns() - t0
        if not woke and self.output_blocked():
            for out in self.outputs:
                out.flush()
        self.take_priority_events()


class ControlMail:
    """A mail that runs in a frozen task too (see ``Mailbox``)."""

    __slots__ = ("mail",)

    def __init__(self, mail):
        self.mail = mail

    def __call__(self):
        self.mail()


def _none_taken() -> bool:
    return False


class OutputFlusher:
    """The buffer timeout: partly filled output buffers are shipped at least
    every ``timeout`` seconds (0: after every record, Flink's setting)."""

    def __init__(self, outputs: list, timeout: float):
        self.outputs = outputs
        self.timeout_ns = int(timeout * 1e9)
        self.next_ns = time.monotonic_ns() + self.timeout_ns

    def flush_if_due(self, now_ns: int) -> None:
        if now_ns >= self.next_ns:
            for out in self.outputs:
                out.flush()
            self.next_ns = now_ns + self.timeout_ns

    def flush(self) -> None:
        """Ship what is buffered now (the task is about to wait), and start
        the timeout over."""
        for out in self.outputs:
            out.flush()
        self.next_ns = time.monotonic_ns() + self.timeout_ns
