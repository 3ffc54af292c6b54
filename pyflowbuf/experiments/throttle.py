"""Sleep-based slow-downs for experiments (the article uses Thread.sleep).

A :class:`Speed` is a shared, thread-safe setting (a fraction of full speed)
that a controller thread changes on schedule; a :class:`Pacer` lives inside
one operator (a generator source, a ``map``, a sink) and, after each chunk of
records, sleeps just long enough that the operator runs at ``speed`` times its
calibrated maximum rate. Sleeping in user code counts as *busy* time in the
task's metrics, as Thread.sleep does in Flink.
"""
from __future__ import annotations

import threading
import time


class Speed:
    """A fraction of full speed, shared between a controller and a task."""

    def __init__(self, fraction: float = 1.0):
        self._lock = threading.Lock()
        self._value = 1.0
        self.set(fraction)

    def set(self, fraction: float) -> None:
        fraction = float(fraction)
        if not 0.0 < fraction:
            raise ValueError(f"speed must be a fraction > 0 of full speed, got {fraction!r}")
        with self._lock:
            self._value = fraction

    def get(self) -> float:
        with self._lock:
            return self._value

    def __repr__(self):
        return f"Speed({self.get():.0%})"


class Pacer:
    """Keeps one operator at ``speed x max_rate`` records per second.

    Call ``pacer(n)`` after each ``n`` records. It keeps an absolute schedule
    (so sleep overshoot is paid back) and sleeps only when at least
    ``min_sleep`` ahead of it (few, longer sleeps: ms-scale timer precision).
    It never lets an operator burst to catch up more than ``slack`` seconds
    of lost time: a task that was held up (backpressured) simply restarts
    its schedule, it does not race afterwards. At ``speed >= 1`` or without
    a ``max_rate`` (calibration) it does nothing.
    """

    def __init__(self, speed: Speed, max_rate: float | None = None, *,
                 min_sleep: float = 0.002, slack: float = 0.02):
        self.speed = speed
        self.max_rate = max_rate
        self.min_sleep = min_sleep
        self.slack = slack
        self._due = None
        self.slept_s = 0.0

    def __call__(self, n: int) -> None:
        fraction = self.speed.get()
        rate = self.max_rate
        if fraction >= 1.0 or not rate:
            self._due = None
            return
        now = time.monotonic()
        due = self._due
        if due is None or now - due > self.slack:
            due = now
        due += n / (fraction * rate)
        self._due = due
        ahead = due - now
        if ahead >= self.min_sleep:
            time.sleep(ahead)
            self.slept_s += ahead
