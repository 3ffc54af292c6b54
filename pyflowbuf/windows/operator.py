"""The keyed window operators (records a record at a time): event time with
the default trigger (``WindowOperator``), other triggers and processing time
(``TriggerWindowOperator``), and count windows (``CountWindowOperator``).

On a stream whose timestamps travel, an operator reads each record's time
from the batch's times (no function call per record) and gives every result
the window's ``max_timestamp`` (its end less the smallest step: the largest
time inside it, as Flink's end - 1 ms). Count windows give their results no
time (``CountWindow`` streams carry none).
"""
from __future__ import annotations

import bisect
import copy
import itertools
import math
import time
from array import array as _array

from pyflowbuf._core.serde import ts_select
from pyflowbuf.operators.contracts import Operator
from pyflowbuf.operators.side_outputs import LATE, unknown_tag
from pyflowbuf.time.timers import TimerOperator, TimerQueue, timer_service_snapshot
from pyflowbuf.time.watermarks import NO_WATERMARK, to_seconds
from pyflowbuf.windows.aggregates import Count
from pyflowbuf.windows.assigners import RecordRange, TimeWindow, Tumbling
from pyflowbuf.windows.triggers import ProcessingTimeTrigger


REDUCE, AGGREGATE, PROCESS = "reduce", "aggregate", "process"
_MISSING = object()


class WindowSpec:
    """What ``KeyedStream.window(...)...`` builds: everything the operator
    needs besides its function, picklable for worker processes."""

    def __init__(self, assigner, key_fn, ts_fn, allowed_lateness=0.0, trigger=None):
        self.assigner = assigner
        self.key_fn = key_fn
        self.ts_fn = ts_fn
        self.allowed_lateness = allowed_lateness
        self.trigger = trigger      # None: the assigner's default (EventTimeTrigger)


class WindowContext:
    """What a window function that takes one more argument gets: ``process(fn)``
    with ``fn(key, window, records, ctx)``, ``window_function(key, window,
    result, ctx)`` (without the key for ``window_all``).

    firing
        The kind of this firing: "early" (before the window's end, by a
        ``ContinuousEventTimeTrigger`` or ``CountTrigger``), "on_time" (at the
        window's end; for a count window, when its count is complete), "late"
        (a record within the allowed lateness after the end), or "partial"
        (a count window cut short by the end of the input).
    key, window
        The window's key and window (``TimeWindow`` or ``RecordRange``).
    watermark
        The operator's watermark (-inf before the first, and in windows that
        are not in event time).

    Example::

        def fn(key, window, records, ctx):
            return [(key, window.start, len(records), ctx.firing)]

        res = keyed.window(fb.Tumbling(60), trigger=fb.ContinuousEventTimeTrigger(10)).process(fn)
    """

    __slots__ = ("_op", "key", "window", "firing")

    def __init__(self, op):
        self._op = op
        self.key = None
        self.window = None
        self.firing = None

    @property
    def watermark(self) -> float:
        """The window operator's watermark in seconds of event time.

        Example::

            behind = ctx.watermark - window.end      # how late a "late" firing is
        """
        timers = self._op.timers
        return NO_WATERMARK if timers is None else timers.watermark

    def current_processing_time(self) -> float:
        """The wall clock (``time.time()``; the harness's time in an ``OperatorHarness``).

        Example::

            lag = ctx.current_processing_time() - window.end
        """
        return self._op.clock()

    def output(self, tag, value) -> None:
        """Emit ``value`` to the side output ``tag`` (declared with
        ``process(fn, side_outputs=[tag])``).

        Example::

            ctx.output(big, (key, len(records)))     # big = fb.OutputTag("big")
        """
        side = self._op.side
        if side is None or getattr(tag, "name", None) == LATE:    # late() is fed by the operator alone
            raise unknown_tag(self._op.name, tag, () if side is None else
                              [t for n, (t, _) in side.routes.items() if n != LATE])
        side.output(tag, value, getattr(self.window, "max_timestamp", None))

    def __repr__(self):
        return f"WindowContext(key={self.key!r}, window={self.window!r}, firing={self.firing!r})"


def _functions(how, fn):
    """(create, add, result, merge) of a window's contents for ``how``."""
    if how == AGGREGATE:
        return fn.create_accumulator, fn.add, fn.get_result, getattr(fn, "merge", None)
    if how == REDUCE:
        return (lambda: _MISSING), (lambda x, acc, _f=fn: x if acc is _MISSING else _f(acc, x)), \
            (lambda acc: acc), fn
    return list, _append, None, (lambda a, b: a + b)


class _WindowOutput:
    """Calling the window's function on a firing, shared by the operators."""

    how: str
    fn = None
    window_function = None
    with_ctx = False
    ctx = None
    _result = None

    _ots = None         # a timestamped output: the times of the records being built
    _last_ts = None     # ... and of the last batch's, once built

    def _emit_window(self, k, window, acc, out, firing):
        ctx = self.ctx
        n = len(out)
        if ctx is not None:
            ctx.key, ctx.window, ctx.firing = k, window, firing
        if self.how == PROCESS:
            self._extend(out, self.fn(k, window, acc, ctx) if ctx is not None else self.fn(k, window, acc))
        else:
            r = self._result(acc)
            if self.window_function is not None:
                r = self.window_function(k, window, r, ctx) if ctx is not None else self.window_function(k, window, r)
            out.append(r)
        ots = self._ots
        if ots is not None and len(out) > n:
            ots.extend([window.max_timestamp] * (len(out) - n))


class WindowOperator(_WindowOutput, TimerOperator):
    """Keyed windows over records. ``how`` is reduce (``fn(a, b)``), aggregate
    (an AggregateFunction) or process (``fn(key, window, records)``);
    ``window_function(key, window, result)`` (reduce/aggregate) turns each
    result into the output record. ``with_ctx``: the function takes a
    ``WindowContext`` as its last argument (the firing kind; side outputs with
    ``ctx.output(tag, value)``). Late records go to the side output ``LATE``
    when a stream reads it (``late()``), else they are dropped and counted."""

    clock = staticmethod(time.time)     # processing time; an OperatorHarness sets its own

    def __init__(self, name, spec: WindowSpec, how, fn, window_function=None, with_ctx=False):
        super().__init__(name)
        self.with_ctx = with_ctx
        self.ctx = WindowContext(self) if with_ctx else None
        self.assigner = spec.assigner
        self.merging = spec.assigner.merging
        self.key_fn = spec.key_fn
        self.ts_fn = spec.ts_fn
        self.lateness = spec.allowed_lateness
        self.how = how
        self.fn = fn
        self.window_function = window_function
        self._late = None               # the LATE side output's buffer when a stream reads it
        self._late_times = None         # ... and its records' times, where that stream carries them
        self.windows: dict = {}         # (key, start, end) -> accumulator   (non-merging)
        self.sessions: dict = {}        # key -> sorted [[start, end, acc], ...]  (merging)
        self.cleanup = TimerQueue()     # (key, start, end) at end + lateness
        self.late_dropped = 0
        self.late_out = 0
        self._create, self._add, self._result, self._merge = _functions(how, fn)

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        if self.side is not None:
            self._late = self.side.buffer(LATE)
            self._late_times = self.side.times_of(LATE)

    # ---- records ----
    def process_batch(self, batch):
        return self._records(batch, map(self.ts_fn, batch))[0]

    def process_ts(self, batch, ts):
        if ts is None:
            return self.process_batch(batch), None
        return self._records(batch, ts)

    def _records(self, batch, times):
        """The window results (and tagged late records) of ``batch``, whose
        records' times ``times`` gives in order; (records, their times or None)."""
        wm = self.timers.watermark
        out: list = []
        late: list = []         # (record, time)
        self._ots = [] if self.timestamped else None
        if self.merging:
            self._session_batch(batch, times, wm, out, late, self._add_to_session)
        elif type(self.assigner) is Tumbling:
            self._tumbling_batch(batch, times, out, late)
        else:
            self._assign_batch(batch, times, wm, out, late)
        return self._finish_batch(out, late), self._last_ts

    # what a firing trigger does (TriggerWindowOperator's differ): every
    # ``every`` records, or at the end and with each late record
    every = None
    at_end = True
    counts = None

    def _session_batch(self, batch, times, wm, out, late, add_to_session):
        key_fn = self.key_fn
        for x, t in zip(batch, times):
            if type(t) is not float:
                t = to_seconds(t)
            if not add_to_session(key_fn(x), t, x, wm, out):
                late.append((x, t))

    def _assign_batch(self, batch, times, wm, out, late):
        """Each record (``times`` gives their times in order) into the windows
        its assigner gives it and the watermark has not dropped; records
        placed in none are ``late`` (record, time)."""
        key_fn, windows, add, create, lateness = self.key_fn, self.windows, self._add, self._create, self.lateness
        assign, every, counts, at_end = self.assigner.assign, self.every, self.counts, self.at_end
        for x, t in zip(batch, times):
            if type(t) is not float:
                t = to_seconds(t)
            k = None
            placed = False
            for start, end in assign(t):
                if end + lateness <= wm:
                    continue                    # this window is gone
                if k is None:
                    k = key_fn(x)
                wk = (k, start, end)
                acc = windows.get(wk, _MISSING)
                if acc is _MISSING:
                    self._new_window(wk, t, wm)
                    acc = create()
                elif acc is _EMPTY:
                    acc = create()
                windows[wk] = add(x, acc)
                placed = True
                if every is not None:
                    c = counts.get(wk, 0) + 1
                    if c >= every:
                        c = 0
                        self._fire(wk, "late" if end <= wm else "early", out)
                    counts[wk] = c
                elif at_end and end <= wm:      # fired before: fire again with this record
                    self._fire(wk, "late", out)
            if not placed:
                late.append((x, t))

    def _new_window(self, wk, t, wm):
        end = wk[2]
        if end > wm:
            self.timers.event.register(wk, end)
        else:       # fires right away, once; only its cleanup is ahead
            self.cleanup.register(wk, end + self.lateness)

    def _fire(self, wk, firing, out):
        self._emit(wk[0], wk[1], wk[2], self.windows[wk], out, firing)

    def _tumbling_batch(self, batch, times, out, late):
        """``process_batch`` for tumbling windows, the common case: one window
        per record, its start computed inline, and a count kept inline."""
        key_fn = self.key_fn
        wm, lateness = self.timers.watermark, self.lateness
        windows, add, create = self.windows, self._add, self._create
        get = windows.get
        register, cleanup = self.timers.event.register, self.cleanup.register
        size, offset = self.assigner.size, self.assigner.offset
        count = type(self.fn) is Count and self.how == AGGREGATE
        missing = _MISSING
        for x, t in zip(batch, times):
            if type(t) is not float:
                t = to_seconds(t)
            start = t - (t - offset) % size
            end = start + size
            if end + lateness <= wm:
                late.append((x, t))
                continue
            wk = (key_fn(x), start, end)
            acc = get(wk, missing)
            if acc is missing:
                acc = 0 if count else create()
                if end > wm:
                    register(wk, end)
                else:
                    cleanup(wk, end + lateness)
            acc = acc + 1 if count else add(x, acc)
            windows[wk] = acc
            if end <= wm:
                self._emit(wk[0], start, end, acc, out)

    def _finish_batch(self, out, late):
        ots = self._ots
        self._ots = None
        if late:
            if self._late is not None:
                self._late.extend(x for x, _ in late)
                if self._late_times is not None:        # late records keep their own times
                    self._late_times.extend(t for _, t in late)
                self.late_out += len(late)
            else:
                self.late_dropped += len(late)
        self._last_ts = None if ots is None else _array("d", ots)
        return self._checked(out)

    def _emit(self, k, start, end, acc, out, firing="late"):
        self._emit_window(k, TimeWindow(start, end), acc, out, firing)

    def _end_register(self, wk, t):
        self.timers.event.register(wk, t)

    def _end_delete(self, wk, t):
        self.timers.event.delete(wk, t)

    # ---- sessions ----
    def _add_to_session(self, k, t, x, wm, out) -> bool:
        """Put ``x`` (time ``t``) into key ``k``'s sessions, merging those its
        window [t, t + gap) overlaps or touches; False if the merged session
        is already past its allowed lateness (``x`` is late)."""
        start, end = t, t + self.assigner.gap
        sess = self.sessions.get(k)
        if sess is None:
            sess = self.sessions[k] = []
        hits = [s for s in sess if s[0] <= end and start <= s[1]]
        lo = min([start] + [s[0] for s in hits])
        hi = max([end] + [s[1] for s in hits])
        if hi + self.lateness <= wm:
            if not sess:
                del self.sessions[k]
            return False
        merge = self._merge
        acc = _MISSING
        for s in hits:
            sess.remove(s)
            self._end_delete((k, s[0], s[1]), s[1])
            self.cleanup.delete((k, s[0], s[1]), s[1] + self.lateness)
            acc = s[2] if acc is _MISSING else merge(acc, s[2])
        if acc is _MISSING:
            acc = self._create()
        acc = self._add(x, acc)
        bisect.insort(sess, [lo, hi, acc], key=lambda s: s[0])
        if hi > wm:
            self._end_register((k, lo, hi), hi)
        else:
            self.cleanup.register((k, lo, hi), hi + self.lateness)
            self._emit(k, lo, hi, acc, out)
        return True

    # ---- time: what fires, with its times in fired_ts ----
    def fire_event(self, watermark):
        self._ots = [] if self.timestamped else None
        out = self._fire_event(watermark)
        self.fired_ts, self._ots = self._ots, None
        return out

    def fire_processing(self, now):
        self._ots = [] if self.timestamped else None
        out = self._fire_processing(now)
        self.fired_ts, self._ots = self._ots, None
        return out

    def _fire_event(self, watermark):
        out: list = []
        pop, lateness = self.timers.event.pop_due, self.lateness
        while True:
            due = pop(watermark)
            if due is None:
                break
            wk, end = due
            acc = self._acc(wk)
            if acc is _MISSING:
                continue
            self._emit(wk[0], wk[1], end, acc, out, "on_time")
            if lateness:
                self.cleanup.register(wk, end + lateness)
            else:
                self._purge(wk)
        pop = self.cleanup.pop_due
        while True:
            due = pop(watermark)
            if due is None:
                break
            self._purge(due[0])
        return self._checked(out)

    def _fire_processing(self, now):
        return []

    def _acc(self, wk):
        if not self.merging:
            return self.windows.get(wk, _MISSING)
        for s in self.sessions.get(wk[0], ()):
            if s[0] == wk[1] and s[1] == wk[2]:
                return s[2]
        return _MISSING

    def _purge(self, wk):
        if not self.merging:
            self.windows.pop(wk, None)
            return
        sess = self.sessions.get(wk[0])
        if sess:
            sess[:] = [s for s in sess if not (s[0] == wk[1] and s[1] == wk[2])]
            if not sess:
                del self.sessions[wk[0]]

    # ---- checkpoints ----
    def snapshot_state(self):
        if self.merging:
            sessions = {k: [[s, e, _copy_acc(a)] for s, e, a in v] for k, v in self.sessions.items()}
            windows = None
        else:
            sessions = None
            windows = {wk: _copy_acc(a) for wk, a in self.windows.items()}
        return {"windows": windows, "sessions": sessions, "timers": self.timers.snapshot(),
                "cleanup": self.cleanup.snapshot(), "late_dropped": self.late_dropped}

    def restore_state(self, state):
        if not state:
            return
        if state["windows"] is not None:
            self.windows = {wk: _copy_acc(a) for wk, a in state["windows"].items()}
        if state["sessions"] is not None:
            self.sessions = {k: [[s, e, _copy_acc(a)] for s, e, a in v] for k, v in state["sessions"].items()}
        self.timers.restore(state["timers"])
        self.cleanup = TimerQueue.restored(state["cleanup"])
        self.late_dropped = state.get("late_dropped", 0)

    keyed_state = True

    def keyed_parts(self, state):
        maps = ({"sessions": (state["sessions"], None)} if state["sessions"] is not None else
                {"windows": (state["windows"] or {}, _window_key)})
        timers = state["timers"]
        return (maps,
                {"event": (timers["event"], _window_key), "processing": (timers["processing"], _window_key),
                 "cleanup": (state["cleanup"], _window_key)},
                {"watermark": timers["watermark"], "late_dropped": state.get("late_dropped", 0)})

    def from_keyed_parts(self, maps, timers, commons):
        return {"windows": None if self.merging else maps.get("windows", {}),
                "sessions": maps.get("sessions", {}) if self.merging else None,
                "timers": timer_service_snapshot(timers, commons),
                "cleanup": timers.get("cleanup", []),
                # a counter of the job, not of a key: each old subtask's goes to one new subtask
                "late_dropped": sum(c.get("late_dropped", 0) for c in commons if c and c.get("owner", True))}

    def metrics(self) -> dict:
        return {"late_records_dropped": self.late_dropped, "late_records_out": self.late_out}


def _window_key(wk):
    """The record key of a window's (key, start, end)."""
    return wk[0]


def _trigger_timer_key(t):
    """The record key of a trigger window's timer: (0 or 1, (key, start,
    end)) for its end and its early firings, else (key, start, end)."""
    if len(t) == 2 and type(t[1]) is tuple:
        return t[1][0]
    return t[0]


_EMPTY = object()      # a window emptied by PurgingTrigger: its timers and counts go on


class TriggerWindowOperator(WindowOperator):
    """Keyed windows with a trigger other than the default (event time:
    tumbling, sliding and sessions), or in processing time (tumbling and
    sliding with any processing-time trigger, sessions with the default
    one, on the base class's session code). The trigger (``spec.trigger``,
    see ``pyflowbuf.windows.triggers``) says whether a window fires at its end, every ``interval`` of event time
    (timers keyed ``(1, window)``; the end is ``(0, window)``), or every
    ``count`` records (a count per window), and whether a firing empties it.
    Event-time windows are dropped at end + allowed lateness, processing-time
    windows at their end."""

    def __init__(self, name, spec: WindowSpec, how, fn, window_function=None, with_ctx=False):
        super().__init__(name, spec, how, fn, window_function, with_ctx)
        trig = spec.trigger
        if trig is None:        # processing-time windows with their default trigger
            trig = ProcessingTimeTrigger()
        self.processing = spec.assigner.domain == "processing"
        self.at_end = trig.fires_at_end
        self.interval = trig.interval
        self.every = trig.count
        self.purge = trig.purge
        self.counts: dict = {}      # window -> records since its last count firing
        # records a CountTrigger never fired: still counted when their window was
        # dropped (Flink drops them too; the metric makes it visible)
        self.unfired_dropped = 0

    # ---- records ----
    def process_ts(self, batch, ts):
        # the times that travel with the records, else ts_fn's
        return self._records(batch, map(self.ts_fn, batch) if ts is None else ts)

    def _records(self, batch, times):
        out: list = []
        late: list = []
        self._ots = [] if self.timestamped else None
        if self.processing:     # (processing-time sessions take the default trigger only)
            wm, times, add_to_session = NO_WATERMARK, itertools.repeat(self.clock()), self._add_to_session
        else:
            wm, add_to_session = self.timers.watermark, self._add_to_triggered_session
        if self.merging:
            self._session_batch(batch, times, wm, out, late, add_to_session)
        else:
            self._assign_batch(batch, times, wm, out, late)
        return self._finish_batch(out, late), self._last_ts

    # ---- event-time sessions with a trigger ----
    # A session is [start, end, contents (or _EMPTY once purged), records
    # counted since its last count firing, time of its next early firing or
    # None]. Merging sessions sums their counts and keeps the earliest
    # pending early firing (Flink's onMerge of CountTrigger and
    # ContinuousEventTimeTrigger).
    def _add_to_triggered_session(self, k, t, x, wm, out) -> bool:
        start, end = t, t + self.assigner.gap
        sess = self.sessions.get(k)
        if sess is None:
            sess = self.sessions[k] = []
        hits = [s for s in sess if s[0] <= end and start <= s[1]]
        lo = min([start] + [s[0] for s in hits])
        hi = max([end] + [s[1] for s in hits])
        lateness = self.lateness
        if hi + lateness <= wm:
            if not sess:
                del self.sessions[k]
            return False
        event, merge = self.timers.event, self._merge
        acc = _MISSING
        count = 0
        early = None
        for s in hits:
            sess.remove(s)
            wk = (k, s[0], s[1])
            event.delete((0, wk), s[1])
            if s[4] is not None:
                event.delete((1, wk), s[4])
            self.cleanup.delete(wk, s[1] + lateness)
            if s[2] is not _EMPTY:
                acc = s[2] if acc is _MISSING else merge(acc, s[2])
            count += s[3]
            if s[4] is not None and (early is None or s[4] < early):
                early = s[4]
        if acc is _MISSING:
            acc = self._create()
        acc = self._add(x, acc)
        wk = (k, lo, hi)
        if hi > wm:
            if self.at_end:
                event.register((0, wk), hi)
            if self.interval is not None and early is None:
                f = _next_multiple(t, self.interval)
                early = f if f < hi else None
            if early is not None:
                event.register((1, wk), early)
        else:
            early = None
        self.cleanup.register(wk, hi + lateness)
        entry = [lo, hi, acc, count, early]
        bisect.insort(sess, entry, key=lambda s: s[0])
        if self.every is not None:
            entry[3] += 1
            if entry[3] >= self.every:
                entry[3] = 0
                self._fire_session(k, entry, "late" if hi <= wm else "early", out)
        elif self.at_end and hi <= wm:
            self._fire_session(k, entry, "late", out)
        return True

    def _fire_session(self, k, entry, firing, out):
        if entry[2] is _EMPTY:
            return
        self._emit(k, entry[0], entry[1], entry[2], out, firing)
        if self.purge:
            entry[2] = _EMPTY

    def _session(self, wk):
        for s in self.sessions.get(wk[0], ()):
            if s[0] == wk[1] and s[1] == wk[2]:
                return s
        return None

    def _new_window(self, wk, t, wm):
        end = wk[2]
        if self.processing:
            self._register_processing(wk, end)      # its firing (or cleanup) at its end
            return
        if end > wm:
            if self.at_end:
                self.timers.event.register((0, wk), end)
            if self.interval is not None:
                f = _next_multiple(t, self.interval)
                if f < end:
                    self.timers.event.register((1, wk), f)
        self.cleanup.register(wk, end + self.lateness)

    def _fire(self, wk, firing, out):
        acc = self.windows.get(wk, _MISSING)
        if acc is _MISSING or acc is _EMPTY:
            return
        self._emit(wk[0], wk[1], wk[2], acc, out, firing)
        if self.purge:
            self.windows[wk] = _EMPTY

    def _end_register(self, wk, t):
        if self.processing:
            self._register_processing(wk, t)
        else:
            self.timers.event.register(wk, t)

    def _end_delete(self, wk, t):
        (self.timers.processing if self.processing else self.timers.event).delete(wk, t)

    # ---- time ----
    def _fire_event(self, watermark):
        """Windows (or sessions) at their end and at their early firings; the
        cleanup of those past their allowed lateness."""
        if self.processing:
            return []
        out: list = []
        merging, windows, interval = self.merging, self.windows, self.interval
        pop, register = self.timers.event.pop_due, self.timers.event.register
        while True:
            due = pop(watermark)
            if due is None:
                break
            (tag, wk), t = due
            entry = self._session(wk) if merging else wk if wk in windows else None
            if entry is None:
                continue
            firing = "on_time" if tag == 0 else "early"
            if merging:
                self._fire_session(wk[0], entry, firing, out)
            else:
                self._fire(wk, firing, out)
            if tag != 0:
                f = _next_multiple(t, interval)
                if f >= wk[2]:
                    f = None
                if merging:
                    entry[4] = f
                if f is not None:
                    register((1, wk), f)    # due now if the watermark is past it: fires in this loop
        pop = self.cleanup.pop_due
        while True:
            due = pop(watermark)
            if due is None:
                break
            wk = due[0]
            if merging:
                entry = self._session(wk)
                self.unfired_dropped += entry[3] if entry is not None else 0
            else:
                self.unfired_dropped += self.counts.pop(wk, 0)
            self._purge(wk)
        return self._checked(out)

    def _fire_processing(self, now):
        out: list = []
        pop = self.timers.processing.pop_due
        while True:
            due = pop(now)
            if due is None:
                break
            wk = due[0]
            if self.merging:
                acc = self._acc(wk)
                if acc is not _MISSING:
                    self._emit(wk[0], wk[1], wk[2], acc, out, "on_time")
                    self._purge(wk)
                continue
            if self.at_end:
                self._fire(wk, "on_time", out)
            self.windows.pop(wk, None)
            self.unfired_dropped += self.counts.pop(wk, 0)
        return self._checked(out)

    def finish(self):
        # end of a bounded input: processing-time windows still open fire now,
        # as event-time windows do at the +inf watermark
        out = self.fire_processing(math.inf) if self.processing else []
        super().finish()
        return out

    # ---- checkpoints ----
    def snapshot_state(self):
        if self.merging and self.processing:
            return super().snapshot_state()
        if self.merging:
            # an emptied session's contents go in as None, flagged
            sessions = {k: [[s, e, None if a is _EMPTY else _copy_acc(a), a is _EMPTY, n, f] for s, e, a, n, f in v]
                        for k, v in self.sessions.items()}
            return {"windows": None, "sessions": None, "trigger_sessions": sessions,
                    "timers": self.timers.snapshot(), "cleanup": self.cleanup.snapshot(),
                    "late_dropped": self.late_dropped, "unfired_dropped": self.unfired_dropped}
        return {"windows": {wk: _copy_acc(a) for wk, a in self.windows.items() if a is not _EMPTY},
                "purged": [wk for wk, a in self.windows.items() if a is _EMPTY],
                "counts": dict(self.counts), "sessions": None, "timers": self.timers.snapshot(),
                "cleanup": self.cleanup.snapshot(), "late_dropped": self.late_dropped,
                "unfired_dropped": self.unfired_dropped}

    def restore_state(self, state):
        if not state:
            return
        super().restore_state(state)
        if state.get("trigger_sessions") is not None:
            self.sessions = {k: [[s, e, _EMPTY if empty else _copy_acc(a), n, f] for s, e, a, empty, n, f in v]
                             for k, v in state["trigger_sessions"].items()}
        for wk in state.get("purged") or ():
            self.windows[wk] = _EMPTY
        self.counts = dict(state.get("counts") or {})
        self.unfired_dropped = state.get("unfired_dropped", 0)

    # ---- key groups: windows, counts, emptied windows and trigger sessions per key ----
    def keyed_parts(self, state):
        if self.merging and self.processing:
            return WindowOperator.keyed_parts(self, state)      # the base class's sessions
        if self.merging:
            maps = {"trigger_sessions": (state["trigger_sessions"] or {}, None)}
        else:
            maps = {"windows": (state["windows"] or {}, _window_key),
                    "purged": ({wk: None for wk in state.get("purged") or ()}, _window_key),
                    "counts": (state.get("counts") or {}, _window_key)}
        timers = state["timers"]
        return (maps,
                {"event": (timers["event"], _trigger_timer_key),
                 "processing": (timers["processing"], _trigger_timer_key),
                 "cleanup": (state["cleanup"], _window_key)},
                {"watermark": timers["watermark"], "late_dropped": state.get("late_dropped", 0),
                 "unfired_dropped": state.get("unfired_dropped", 0)})

    def from_keyed_parts(self, maps, timers, commons):
        if self.merging and self.processing:
            return WindowOperator.from_keyed_parts(self, maps, timers, commons)
        owned = [c for c in commons if c and c.get("owner", True)]
        state = {"windows": None, "sessions": None, "timers": timer_service_snapshot(timers, commons),
                 "cleanup": timers.get("cleanup", []),
                 "late_dropped": sum(c.get("late_dropped", 0) for c in owned),
                 "unfired_dropped": sum(c.get("unfired_dropped", 0) for c in owned)}
        if self.merging:
            state["trigger_sessions"] = maps.get("trigger_sessions", {})
        else:
            state.update(windows=maps.get("windows", {}), purged=list(maps.get("purged", {})),
                         counts=maps.get("counts", {}))
        return state

    def metrics(self) -> dict:
        return {**super().metrics(), "unfired_records_dropped": self.unfired_dropped}


def _next_multiple(t, interval):
    """The first multiple of ``interval`` above ``t`` (an early firing's time)."""
    f = (math.floor(t / interval) + 1) * interval
    return f if f > t else f + interval


class CountWindowOperator(_WindowOutput, Operator):
    """``CountWindow(size, slide)`` per key: tumbling (``slide`` None), each
    ``size`` records of a key fire and are dropped; sliding, every ``slide``
    records the key's last ``size`` records fire. State per key: [records
    seen, accumulator] (tumbling) or [records seen, last ``size`` records]."""

    clock = staticmethod(time.time)

    def __init__(self, name, spec: WindowSpec, how, fn, window_function=None, with_ctx=False):
        super().__init__(name)
        a = spec.assigner
        self.size, self.slide, self.partial = a.size, a.slide, a.emit_partial
        self.key_fn = spec.key_fn
        self.how, self.fn, self.window_function = how, fn, window_function
        self.with_ctx = with_ctx
        self.ctx = WindowContext(self) if with_ctx else None
        self._create, self._add, self._result, _ = _functions(how, fn)
        self.keys: dict = {}
        self.unfired_dropped = 0        # records of windows left incomplete at the end

    def process_batch(self, batch):
        key_fn, keys, add, create, size = self.key_fn, self.keys, self._add, self._create, self.size
        out: list = []
        slide = self.slide
        for x in batch:
            k = key_fn(x)
            st = keys.get(k)
            if slide is None:
                if st is None:
                    st = keys[k] = [0, create()]
                st[1] = add(x, st[1])
                n = st[0] = st[0] + 1
                if n % size == 0:
                    self._emit_window(k, RecordRange(n - size, n), st[1], out, "on_time")
                    st[1] = create()
            else:
                if st is None:
                    st = keys[k] = [0, []]
                buf = st[1]
                buf.append(x)
                if len(buf) > size:
                    del buf[0]
                n = st[0] = st[0] + 1
                if n % slide == 0:
                    self._emit_window(k, RecordRange(n - len(buf), n), self._fold(buf), out, "on_time")
        return self._checked(out)

    def _fold(self, buf):
        if self.how == PROCESS:
            return list(buf)
        add = self._add
        acc = self._create()
        for x in buf:
            acc = add(x, acc)
        return acc

    def finish(self):
        if not self.partial:
            step = self.size if self.slide is None else self.slide
            self.unfired_dropped += sum(n % step for n, _ in self.keys.values())
            return []
        out: list = []
        for k, (n, held) in self.keys.items():
            if self.slide is None:
                rest = n % self.size
                if rest:
                    self._emit_window(k, RecordRange(n - rest, n), held, out, "partial")
            elif n % self.slide and held:
                self._emit_window(k, RecordRange(n - len(held), n), self._fold(held), out, "partial")
        return self._checked(out)

    def snapshot_state(self):
        # a reduce's empty accumulator is a marker object: it goes in as None, flagged
        return {"keys": {k: (n, None, True) if held is _MISSING else
                         (n, list(held) if self.slide is not None else _copy_acc(held), False)
                         for k, (n, held) in self.keys.items()}}

    def restore_state(self, state):
        if state:
            self.keys = {k: [n, _MISSING if empty else (list(held) if self.slide is not None else _copy_acc(held))]
                         for k, (n, held, empty) in state["keys"].items()}

    def metrics(self) -> dict:
        return {"late_records_dropped": 0, "late_records_out": 0, "unfired_records_dropped": self.unfired_dropped}


def window_operator_class(spec: WindowSpec):
    """The operator for a window declaration: the default event-time path,
    the trigger path, or count windows."""
    domain = spec.assigner.domain
    if domain == "count":
        return CountWindowOperator
    if domain == "processing" or spec.trigger is not None:
        return TriggerWindowOperator
    return WindowOperator


def _append(x, acc):
    acc.append(x)
    return acc


_IMMUTABLE = (int, float, str, bytes, bool, type(None), tuple, frozenset)


def _copy_acc(acc):
    """An accumulator for a snapshot, which the task goes on changing while
    the snapshot is written: plain values as they are, a process window's
    list of records one level deep (records are not changed in place), any
    other object (an AggregateFunction's accumulator may be changed in place
    by ``add``) deeply."""
    t = type(acc)
    if t in _IMMUTABLE:
        return acc
    if t is list:
        return list(acc)
    return copy.deepcopy(acc)
