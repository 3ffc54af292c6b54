"""Timers: keyed event-time and processing-time timers, and the base of
the operators that keep them (``TimerOperator``: the process operators of
``pyflowbuf.time.process``, the window and join operators of
``pyflowbuf/windows/``).

A timer is (key, time). Timers are deduplicated (registering the same key and
time twice gives one firing), fire in time order (ties in registration
order), run in the task's thread, and go into checkpoints. Event-time timers
fire when the watermark reaches their time; processing-time timers when the
wall clock (``time.time()``) does: the process's processing-time thread
(``pyflowbuf.time.processing_time``) posts a mail to the task at the
earliest deadline, and the task fires the timers between batches.
"""
from __future__ import annotations

import heapq
import math
import time

from pyflowbuf import errors
from pyflowbuf.operators.contracts import Operator
# the processing-time service lived here before; its names stay importable from here
from pyflowbuf.time.processing_time import ProcessingTimeService, processing_time_service, schedule  # noqa: F401
from pyflowbuf.time.watermarks import NO_WATERMARK, to_seconds


class TimerQueue:
    """Timers of one time domain: a heap of distinct times, and per time the
    keys in registration order (a dict: deduplicated, ordered)."""

    def __init__(self):
        self._heap: list = []
        self._at: dict = {}

    def register(self, key, t: float) -> bool:
        """Add timer (key, t); False if it was already there."""
        keys = self._at.get(t)
        if keys is None:
            self._at[t] = {key: None}
            heapq.heappush(self._heap, t)
            return True
        if key in keys:
            return False
        keys[key] = None
        return True

    def delete(self, key, t: float) -> None:
        keys = self._at.get(t)
        if keys is not None:
            keys.pop(key, None)

    def pop_due(self, limit: float):
        """The earliest timer with time <= ``limit`` as (key, t), removed; None if none."""
        heap, at = self._heap, self._at
        while heap and heap[0] <= limit:
            t = heap[0]
            keys = at[t]
            if keys:
                key = next(iter(keys))
                del keys[key]
                return key, t
            heapq.heappop(heap)
            del at[t]
        return None

    def peek_time(self) -> float | None:
        heap, at = self._heap, self._at
        while heap and not at[heap[0]]:
            del at[heapq.heappop(heap)]
        return heap[0] if heap else None

    def __len__(self):
        return sum(len(k) for k in self._at.values())

    def snapshot(self) -> list:
        """[(t, [keys in order])] in time order."""
        return [(t, list(self._at[t])) for t in sorted(self._at) if self._at[t]]

    @classmethod
    def restored(cls, snap) -> "TimerQueue":
        q = cls()
        for t, keys in snap or ():
            for k in keys:
                q.register(k, t)
        return q


class TimerService:
    """Event-time and processing-time timers of one operator instance, and
    the operator's watermark (never decreasing)."""

    def __init__(self):
        self.watermark = NO_WATERMARK
        self.event = TimerQueue()
        self.processing = TimerQueue()

    def advance(self, watermark: float) -> bool:
        if watermark > self.watermark:
            self.watermark = watermark
            return True
        return False

    def snapshot(self) -> dict:
        return {"watermark": self.watermark, "event": self.event.snapshot(),
                "processing": self.processing.snapshot()}

    def restore(self, snap) -> None:
        if not snap:
            return
        self.watermark = snap["watermark"]
        self.event = TimerQueue.restored(snap["event"])
        self.processing = TimerQueue.restored(snap["processing"])


def timer_service_snapshot(timers, commons) -> dict:
    """A TimerService snapshot from restored timer lists; the watermark is
    the lowest of the subtasks they came from (no timer fires early)."""
    marks = [c["watermark"] for c in commons if c]
    return {"watermark": min(marks) if marks else NO_WATERMARK,
            "event": timers.get("event", []), "processing": timers.get("processing", [])}


def _seconds(t, what) -> float:
    t = to_seconds(t)
    if math.isnan(t):
        raise errors.ConfigurationError(f"{what}: a timer's time must be a number, got nan")
    return t


class TimerOperator(Operator):
    """Shared by operators that keep timers: the timer service, the task
    hooks that fire them, and emitting what they make outside of a batch
    (through its ``Output``)."""

    event_time = True

    def __init__(self, name):
        super().__init__(name)
        self.timers = TimerService()
        self._proc_handle = None
        self._proc_deadline = math.inf

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        self._schedule_processing()

    def _register_event(self, key, t):
        self.timers.event.register(key, t)

    def _register_processing(self, key, t):
        if self.timers.processing.register(key, t) and t < self._proc_deadline:
            self._schedule_processing()

    def _schedule_processing(self):
        t = self.timers.processing.peek_time()
        output = self.chain_output
        if t is None or output is None or t >= self._proc_deadline:
            return
        if self._proc_handle is not None:
            ProcessingTimeService.cancel(self._proc_handle)
        self._proc_deadline = t
        self._proc_handle = output.schedule(t, self._processing_mail)

    def _processing_mail(self):
        """In the task thread: fire the processing-time timers that are due."""
        self._proc_handle = None
        self._proc_deadline = math.inf
        out = self.fire_processing(time.time())
        self.chain_output.emit(out)     # (also ships what timers sent to side outputs)
        self._schedule_processing()

    def on_watermark(self, watermark):
        if not self.timers.advance(watermark):
            return [], None
        return self.fire_event(watermark), watermark

    # subclasses: fire_event(watermark) -> records, fire_processing(now) -> records

    def finish(self):
        if self._proc_handle is not None:
            ProcessingTimeService.cancel(self._proc_handle)
            self._proc_handle = None
        return []


