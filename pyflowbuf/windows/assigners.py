"""The window vocabulary: ``TimeWindow`` and ``RecordRange``, and the
assigners: event time (``Tumbling``, ``Sliding``, ``Session``), processing
time (``TumblingProcessingTime``, ``SlidingProcessingTime``,
``SessionProcessingTime``) and counts (``CountWindow``)."""
from __future__ import annotations

import math
from typing import NamedTuple

from pyflowbuf import errors
from pyflowbuf.time.watermarks import check_seconds


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
    # which clock places records in windows: "event" (their timestamps),
    # "processing" (the wall clock when they arrive) or "count" (their number)
    domain = "event"

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




# ---- processing time ----

class TumblingProcessingTime(Tumbling):
    """Tumbling windows of processing time: a record belongs to the window of
    the wall clock (``time.time()``) when its subtask receives it, and the
    window fires once the wall clock reaches its end (Flink's
    TumblingProcessingTimeWindows). No timestamps needed; results depend on
    when records arrive, so they differ from run to run. Windows still open
    at the end of a bounded input fire then.

    ``size`` and ``offset`` are seconds (``ConfigurationError`` as for
    ``Tumbling``); ``allowed_lateness`` does not apply (no record is late).

    Example::

        per_second = keyed.window(fb.TumblingProcessingTime(1.0)).aggregate(fb.Count())
    """

    domain = "processing"

    def __repr__(self):
        return f"TumblingProcessingTime({self.size!r})"


class SlidingProcessingTime(Sliding):
    """Sliding windows of processing time (``size`` seconds every ``slide``
    seconds of the wall clock when records arrive); see
    ``TumblingProcessingTime``.

    Example::

        last_minute = keyed.window(fb.SlidingProcessingTime(60, 10)).aggregate(fb.Count())
    """

    domain = "processing"

    def __repr__(self):
        return f"SlidingProcessingTime({self.size!r}, {self.slide!r})"


class SessionProcessingTime(Session):
    """Sessions of processing time: a key's session ends after ``gap``
    seconds of the wall clock in which none of its records arrived; see
    ``TumblingProcessingTime``. ``aggregate`` needs an AggregateFunction
    with ``merge``, as for ``Session``.

    Example::

        bursts = keyed.window(fb.SessionProcessingTime(5)).process(lambda k, w, recs: [(k, len(recs))])
    """

    domain = "processing"

    def __repr__(self):
        return f"SessionProcessingTime({self.gap!r})"


# ---- counts ----

class RecordRange(NamedTuple):
    """The window of a ``CountWindow``: the records of one key numbered
    ``start <= i < end`` in the order its subtask received them (from 0).

    Example::

        w = RecordRange(0, 100)
        w.end - w.start          # 100 records
    """
    start: int
    end: int

    def __repr__(self):
        return f"RecordRange({self.start!r}, {self.end!r})"


class CountWindow(WindowAssigner):
    """Windows of a number of records per key (Flink's ``countWindow``): with
    ``slide=None`` each ``size`` records of a key form a window, which fires
    when its last record arrives and is then emptied (tumbling); with a
    ``slide``, every ``slide`` records of a key the window of its last
    ``size`` records fires (sliding; the first firings hold fewer than
    ``size`` records).

    The window function gets a ``RecordRange(start, end)``: the positions of
    the window's records among its key's records. Records are counted in the
    order their subtask receives them: with one upstream subtask that is the
    source's order; records of one key coming from several subtasks
    interleave as they arrive. No timestamps are needed and no record is
    late. At the end of a bounded input a window that has not reached its
    count is dropped (as in Flink; its records since the key's last firing
    are counted in ``unfired_records_dropped``), unless ``emit_partial=True``: then it
    fires once more with the records it has (``firing == "partial"`` for a
    window function that takes the context).

    ``size`` and ``slide`` are ints >= 1 (else ``ConfigurationError``);
    ``trigger=`` does not apply to count windows.

    Example::

        every_100 = keyed.window(fb.CountWindow(100)).aggregate(fb.Sum(lambda r: r["amount"]))
        moving = keyed.window(fb.CountWindow(10, slide=1)).process(
            lambda k, w, recs: [(k, sum(r["price"] for r in recs) / len(recs))])
    """

    domain = "count"

    def __init__(self, size, slide=None, *, emit_partial=False):
        self.size = _count("CountWindow size", size)
        self.slide = None if slide is None else _count("CountWindow slide", slide)
        self.emit_partial = bool(emit_partial)

    def assign(self, t):
        raise TypeError("CountWindow places records by their number, not by a time")

    def __repr__(self):
        return f"CountWindow({self.size!r})" if self.slide is None else \
            f"CountWindow({self.size!r}, slide={self.slide!r})"


def _count(what, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise errors.ConfigurationError(f"{what} is a number of records, an int >= 1; got {n!r}")
    return n
