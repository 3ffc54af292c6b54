"""The window vocabulary: ``TimeWindow`` and the assigners (``Tumbling``,
``Sliding``, ``Session``)."""
from __future__ import annotations

import math
from typing import NamedTuple

from pyflowbuf.runtime.watermarks import check_seconds


class TimeWindow(NamedTuple):
    """The window ``[start, end)`` of event time, in seconds.

    Example::

        w = TimeWindow(0.0, 10.0)
        w.start, w.end           # (0.0, 10.0): holds 0 <= t < 10
    """
    start: float
    end: float

    @property
    def max_timestamp(self) -> float:
        """The largest time inside the window: ``end`` less the smallest step
        of a float (Flink's ``end - 1`` ms, for seconds as floats). The
        window's results carry it as their timestamp, so a second window
        of the same size puts them into the window they came from; the
        window fires once the watermark reaches ``end``.

        Example::

            TimeWindow(0.0, 10.0).max_timestamp      # 9.999999999999998
        """
        return max_timestamp(self.end)

    def __repr__(self):
        return f"TimeWindow({self.start!r}, {self.end!r})"


def max_timestamp(end: float) -> float:
    """The largest float below ``end``: the time of a window's results."""
    return math.nextafter(end, -math.inf)


# ---- assigners ----

class WindowAssigner:
    """Base of the window assigners (``Tumbling``, ``Sliding``, ``Session``):
    ``assign(t)`` gives the windows a timestamp belongs to; ``merging`` says
    whether windows of one key merge (sessions).

    Example::

        assert Session(30).merging and not Tumbling(60).merging
    """
    merging = False

    def assign(self, t: float) -> list:
        """The windows that a record at time ``t`` (seconds) belongs to, as a list
        of ``(start, end)`` pairs.

        Example::

            Tumbling(10).assign(12.0)        # [(10.0, 20.0)]
            Sliding(10, 5).assign(12.0)      # [(10.0, 20.0), (5.0, 15.0)]
            Session(3).assign(4.0)           # [(4.0, 7.0)], merged later with its neighbours
        """
        raise NotImplementedError


class Tumbling(WindowAssigner):
    """Fixed windows of ``size`` seconds, back to back, aligned to ``offset``
    (windows start at offset + k * size).

    ``size`` and ``offset`` are seconds (numbers or ``timedelta``); a size
    that is not > 0, or an offset < 0, is a ``ConfigurationError``.

    Example::

        fb.Tumbling(60)                  # [0, 60), [60, 120), ...
        fb.Tumbling(3600, offset=1800)   # hours starting at half past
    """

    def __init__(self, size, offset=0.0):
        self.size = check_seconds("Tumbling size", size, positive=True)
        self.offset = check_seconds("Tumbling offset", offset) % self.size

    def assign(self, t):
        start = t - (t - self.offset) % self.size
        return [(start, start + self.size)]

    def __repr__(self):
        return f"Tumbling({self.size!r})" if not self.offset else f"Tumbling({self.size!r}, offset={self.offset!r})"


class Sliding(WindowAssigner):
    """Windows of ``size`` seconds starting every ``slide`` seconds: a record
    belongs to ceil(size / slide) windows (fewer when slide > size).

    ``size``, ``slide`` and ``offset`` are seconds; a size or slide that is
    not > 0 is a ``ConfigurationError``.

    Example::

        fb.Sliding(60, 10)     # one-minute windows every 10 s: 6 per record
    """

    def __init__(self, size, slide, offset=0.0):
        self.size = check_seconds("Sliding size", size, positive=True)
        self.slide = check_seconds("Sliding slide", slide, positive=True)
        self.offset = check_seconds("Sliding offset", offset) % self.slide

    def assign(self, t):
        size, slide = self.size, self.slide
        start = t - (t - self.offset) % slide
        out = []
        while start > t - size:
            out.append((start, start + size))
            start -= slide
        return out

    def __repr__(self):
        return f"Sliding({self.size!r}, {self.slide!r})"


class Session(WindowAssigner):
    """Sessions per key: a record opens [t, t + gap), and windows that
    overlap or touch merge into one, so a session ends after ``gap`` seconds
    without records of its key.

    ``gap`` is seconds (> 0, else ``ConfigurationError``). Session windows
    merge accumulators: ``aggregate`` needs an AggregateFunction with
    ``merge``.

    Example::

        visits = clicks.key_by(lambda c: c["user"]).window(fb.Session(1800)).aggregate(fb.Count())
    """

    merging = True

    def __init__(self, gap):
        self.gap = check_seconds("Session gap", gap, positive=True)

    def assign(self, t):
        return [(t, t + self.gap)]

    def __repr__(self):
        return f"Session({self.gap!r})"


