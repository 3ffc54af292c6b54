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

Unaligned checkpoints (Flink's unaligned barriers): a barrier flagged
unaligned overtook the data queued ahead of it. At the first one the subtask
snapshots at once and forwards *n* (overtaking too), blocks nothing, and
records as in-flight input what it takes from every channel until barrier *n*
arrives there (``CAPTURE``: that channel's recording ends, and the data the
barrier overtook is taken along); ``INFLIGHT_DONE`` once every channel has
delivered it. An aligned checkpoint turns unaligned when a barrier of it
arrives unaligned (the alignment timeout converted it upstream) or on
``switch`` (the timeout, here): channels blocked so far are resumed, since
what they hold came after the barrier.

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
# unaligned: (SNAPSHOT_UNALIGNED, (id, keys)) snapshot now, forward an
# overtaking barrier, record `keys` (their unread prefix first);
# (CAPTURE, (id, key)) the barrier arrived on `key` (or it ended): close its
# in-flight input; (INFLIGHT_DONE, id) every channel delivered the barrier
SNAPSHOT_UNALIGNED = "snapshot_unaligned"
CAPTURE = "capture"
INFLIGHT_DONE = "inflight_done"


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
        self.unaligned = False                # the current checkpoint went unaligned
        self.recording: set = set()           # channels whose in-flight input is being recorded
        self.switched: set = set()            # ids to take unaligned from their first barrier on

    # ---- events ----
    def on_barrier(self, key: Key, checkpoint_id: int, unaligned: bool = False) -> list:
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
            self.unaligned = False
        if key in self.arrived:
            return actions                 # its second barrier: the converted copy, or the original after it
        if not self.unaligned and (unaligned or n in self.switched):
            actions += self._go_unaligned()
        self.arrived.add(key)
        if self.unaligned:
            self.recording.discard(key)
            actions.append((CAPTURE, (n, key)))
            if self.arrived >= self.live:
                actions += self._complete_unaligned()
            return actions
        if self.arrived >= self.live:
            return actions + self._complete()
        self._block(key)
        self.blocked.add(key)
        return actions

    def switch(self, checkpoint_id: int) -> list:
        """The alignment timeout of ``checkpoint_id`` passed: take it unaligned
        (now if it is aligning here, else from its first barrier on)."""
        n = checkpoint_id
        if n < self.latest or (n == self.latest and self.current != n):
            return []                      # done (or given up) here already
        if self.current == n:
            return [] if self.unaligned else self._go_unaligned()
        self.switched.add(n)
        self.switched = {i for i in self.switched if i >= self.latest}
        return []

    def _go_unaligned(self) -> list:
        self.unaligned = True
        self.recording = set(self.live - self.arrived)
        for key in self.blocked:           # what they hold came after the barrier
            self._resume(key)
        self.blocked = set()
        return [(SNAPSHOT_UNALIGNED, (self.current, frozenset(self.recording)))]

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
        actions = []
        if self.unaligned and key in self.recording:
            # what it delivered up to its end was recorded: that is all of it
            self.recording.discard(key)
            actions.append((CAPTURE, (self.current, key)))
        if self.current is not None and self.arrived >= self.live:
            return actions + (self._complete_unaligned() if self.unaligned else self._complete())
        return actions

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

    def _complete_unaligned(self) -> list:
        n = self.current
        self.alignment_ns[n] = self._clock() - self.started_ns
        self.current = None
        self.unaligned = False
        self.recording = set()
        self.arrived = set()
        return [(INFLIGHT_DONE, n)]

    def _abort(self) -> list:
        n = self.current
        self.current = None
        self.aborted.add(n)
        self.unaligned = False
        self.recording = set()
        self._resume_all()
        return [(ABORT, n)]

    @property
    def aligning(self) -> bool:
        return self.current is not None
