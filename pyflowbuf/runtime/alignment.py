"""Aligned checkpoint barriers for one subtask (Flink's SingleCheckpointBarrierHandler
in its aligned form), as plain logic over channel keys so it can be tested
against a model without threads.

A subtask with several input channels (one input with parallel producers, or
several inputs) receives barrier *n* on each of them. The first barrier *n*
starts the alignment: each channel whose barrier has arrived is blocked (its
buffers stay queued, so over TCP no credit is announced for it and only that
channel is held back) until barrier *n* has arrived on every live channel.
Then the subtask snapshots and forwards barrier *n*, and every channel is
resumed. A channel that ends (end of partition) no longer takes part. A
subtask with one live channel never blocks.

A cancel marker for *n* (the checkpoint was aborted upstream, or timed out)
ends the alignment at once and resumes every channel; barriers of an aborted
or older checkpoint arriving later are ignored. A barrier of a newer
checkpoint while *n* is still aligning means *n* was given up upstream without
a marker reaching here: *n* is aborted and the newer one starts.
"""
from __future__ import annotations

import time
from typing import Callable, Hashable, Iterable

Key = Hashable          # (input index, channel index)

# what on_barrier / on_cancel / on_channel_finished tell the subtask to do
SNAPSHOT = "snapshot"   # all aligned: snapshot checkpoint `id` and forward its barrier
ABORT = "abort"         # give up checkpoint `id`: forward a cancel marker


class BarrierAligner:
    """Tracks the alignment of one subtask.

    ``block(key)`` / ``resume(key)`` act on the input channels; each method
    returns a list of ``(action, checkpoint_id)`` for the subtask to carry out
    in order (forward a barrier after its snapshot, forward a cancel marker).
    """

    def __init__(self, channels: Iterable[Key], block: Callable[[Key], None],
                 resume: Callable[[Key], None], clock: Callable[[], int] = time.monotonic_ns):
        self.live = set(channels)
        self._block = block
        self._resume = resume
        self._clock = clock
        self.current: int | None = None       # the checkpoint being aligned
        self.arrived: set = set()
        self.blocked: set = set()
        self.latest = 0                       # highest id seen (completed, aborted or aligning)
        self.started_ns = 0
        self.alignment_ns: dict[int, int] = {}    # checkpoint id -> time spent aligning
        self.aborted: set = set()

    # ---- events ----
    def on_barrier(self, key: Key, checkpoint_id: int) -> list:
        n = checkpoint_id
        if key not in self.live:
            return []                      # a barrier after this channel ended cannot happen; be safe
        if n < self.latest or (n == self.latest and self.current != n):
            return []                      # an older or aborted checkpoint's late barrier
        actions = []
        if self.current is not None and n > self.current:
            actions += self._abort()
        if self.current is None:
            self.current = n
            self.latest = n
            self.arrived = set()
            self.started_ns = self._clock()
        self.arrived.add(key)
        if self.arrived >= self.live:
            return actions + self._complete()
        self._block(key)
        self.blocked.add(key)
        return actions

    def on_cancel(self, key: Key, checkpoint_id: int) -> list:
        n = checkpoint_id
        if n < self.latest or n in self.aborted:
            return []
        if self.current == n:
            return self._abort()
        # not aligning it yet: remember, so its barriers are ignored, and pass the marker on
        actions = self._abort() if self.current is not None else []
        self.latest = n
        self.aborted.add(n)
        return actions + [(ABORT, n)]

    def on_channel_finished(self, key: Key) -> list:
        self.live.discard(key)
        self.arrived.discard(key)
        if key in self.blocked:
            self.blocked.discard(key)
        if self.current is not None and self.arrived >= self.live:
            return self._complete()
        return []

    def abort(self, checkpoint_id: int) -> list:
        """The coordinator gave up ``checkpoint_id`` (timeout, a failure)."""
        return self.on_cancel(None, checkpoint_id) if checkpoint_id >= self.latest else []

    # ---- transitions ----
    def _resume_all(self):
        for key in self.blocked:
            self._resume(key)
        self.blocked = set()
        self.arrived = set()

    def _complete(self) -> list:
        n = self.current
        self.alignment_ns[n] = self._clock() - self.started_ns
        self.current = None
        # Resuming only lets the gate hand out those channels again; the
        # subtask reads nothing before it has carried out the snapshot.
        self._resume_all()
        return [(SNAPSHOT, n)]

    def _abort(self) -> list:
        n = self.current
        self.current = None
        self.aborted.add(n)
        self._resume_all()
        return [(ABORT, n)]

    @property
    def aligning(self) -> bool:
        return self.current is not None
