"""Triggers: when a window fires (``window(assigner, trigger=...)``).

A trigger here is a description the window operator acts on, not code it
calls per record: ``EventTimeTrigger`` (the default of event-time windows),
``ProcessingTimeTrigger`` (the default of processing-time windows),
``ContinuousEventTimeTrigger(interval)`` (early firings), ``CountTrigger(n)``
and ``PurgingTrigger(trigger)``. User-defined triggers are not supported.

Each firing has a kind, which a window function that takes a context reads
as ``ctx.firing`` (see ``WindowContext``): ``"early"`` (before the watermark
reached the window's end), ``"on_time"`` (the watermark, or the wall clock
for processing time, reached the end), ``"late"`` (a record arrived within
the allowed lateness after that), and ``"partial"`` (a count window cut short
by the end of the input).
"""
from __future__ import annotations

from pyflowbuf import errors
from pyflowbuf.time.watermarks import check_seconds


class Trigger:
    """Base of the triggers.

    What the window operator reads: ``fires_at_end`` (the window fires when
    its time reaches its end, and again per record within the allowed
    lateness), ``interval`` (early firings every so many seconds of event
    time, or None), ``count`` (fire every ``count`` records, or None),
    ``purge`` (empty the window after each firing) and ``domain`` (the time
    the trigger works in: "event", "processing", or None for either).

    Example::

        res = keyed.window(fb.Tumbling(60), trigger=fb.ContinuousEventTimeTrigger(10)).aggregate(fb.Count())
    """

    fires_at_end = True
    interval = None
    count = None
    purge = False
    domain: str | None = "event"

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash((type(self).__name__, tuple(sorted(vars(self).items()))))


class EventTimeTrigger(Trigger):
    """The default trigger of event-time windows: a window fires once when
    the watermark reaches its end, and once more for every record that
    arrives within the allowed lateness after that (Flink's EventTimeTrigger).

    Example::

        keyed.window(fb.Tumbling(60), trigger=fb.EventTimeTrigger())    # the same as no trigger
    """

    def __repr__(self):
        return "EventTimeTrigger()"


class ProcessingTimeTrigger(Trigger):
    """The default trigger of processing-time windows: a window fires once when
    the wall clock reaches its end (and its state is then dropped).

    Example::

        keyed.window(fb.TumblingProcessingTime(5), trigger=fb.ProcessingTimeTrigger())   # the default
    """

    domain = "processing"

    def __repr__(self):
        return "ProcessingTimeTrigger()"


class ContinuousEventTimeTrigger(Trigger):
    """Early results: besides firing at the window's end (as
    ``EventTimeTrigger``), a window fires each time the watermark passes a
    multiple of ``interval`` seconds of event time, from the first multiple
    after its first record's timestamp up to its end, with what it holds by
    then (Flink's ContinuousEventTimeTrigger). Early firings have
    ``ctx.firing == "early"``. A window emptied by ``PurgingTrigger`` does
    not fire until a record arrives again.

    ``interval`` is seconds (a number or ``timedelta`` > 0, else
    ``ConfigurationError``). Event-time windows only; on Session windows,
    merged sessions keep the earliest pending early firing.

    Example::

        # per hour, with an updated count every 5 minutes of event time
        counts = (keyed.window(fb.Tumbling(3600), trigger=fb.ContinuousEventTimeTrigger(300))
                       .aggregate(fb.Count()))
    """

    def __init__(self, interval):
        self.interval = check_seconds("ContinuousEventTimeTrigger interval", interval, positive=True)

    def __repr__(self):
        return f"ContinuousEventTimeTrigger({self.interval!r})"


class CountTrigger(Trigger):
    """Fire a window every ``n`` records it receives (counted per window,
    from 0 again after each firing), with everything it holds (Flink's
    CountTrigger). It replaces the firing at the window's end: records of a
    window that never complete a count of ``n`` are not emitted, and are
    dropped when the window is cleaned up at its end (plus the allowed
    lateness), counted in ``unfired_records_dropped`` (``Environment.metrics()``);
    wrap it in ``PurgingTrigger`` to emit each group of ``n`` records once.
    Firings before the window's end are ``"early"``, after it ``"late"``.

    ``n`` is an int >= 1 (else ``ConfigurationError``). Works with event-time
    and processing-time windows (not ``SessionProcessingTime``); merged
    event-time sessions add up their counts.

    Example::

        batches_of_10 = (keyed.window(fb.Tumbling(60), trigger=fb.PurgingTrigger(fb.CountTrigger(10)))
                              .process(lambda k, w, recs: [(k, len(recs))]))
    """

    domain = None
    fires_at_end = False

    def __init__(self, n):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise errors.ConfigurationError(f"CountTrigger takes a number of records, an int >= 1; got {n!r}")
        self.count = n

    def __repr__(self):
        return f"CountTrigger({self.count!r})"


class PurgingTrigger(Trigger):
    """``trigger``, with the window emptied after each of its firings (Flink's
    PurgingTrigger): each firing then shows the records since the previous
    one. The window's timers and counts go on; a firing of an empty window
    emits nothing.

    ``trigger`` is one of the other triggers (else ``TypeError``).

    Example::

        # per-minute windows, emitting each 10 s of event time only what came since the last firing
        deltas = (keyed.window(fb.Tumbling(60),
                               trigger=fb.PurgingTrigger(fb.ContinuousEventTimeTrigger(10)))
                       .aggregate(fb.Count()))
    """

    purge = True

    def __init__(self, trigger: Trigger):
        if not isinstance(trigger, Trigger) or isinstance(trigger, PurgingTrigger):
            raise TypeError(f"PurgingTrigger takes one of EventTimeTrigger(), ContinuousEventTimeTrigger(s), "
                            f"CountTrigger(n), ProcessingTimeTrigger(); got {trigger!r}")
        self.trigger = trigger
        self.fires_at_end = trigger.fires_at_end
        self.interval = trigger.interval
        self.count = trigger.count
        self.domain = trigger.domain

    def __repr__(self):
        return f"PurgingTrigger({self.trigger!r})"
