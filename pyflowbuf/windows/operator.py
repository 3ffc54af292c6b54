"""The keyed event-time window operator (records a record at a time)."""
from __future__ import annotations

import bisect
import copy

from pyflowbuf.runtime.operators import Operator
from pyflowbuf.runtime.timers import TimerOperator, TimerQueue, timer_service_snapshot
from pyflowbuf.runtime.watermarks import to_seconds
from pyflowbuf.windows.aggregates import Count
from pyflowbuf.windows.assigners import TimeWindow, Tumbling


REDUCE, AGGREGATE, PROCESS = "reduce", "aggregate", "process"
_MISSING = object()


class WindowSpec:
    """What ``KeyedStream.window(...)...`` builds: everything the operator
    needs besides its function, picklable for worker processes."""

    def __init__(self, assigner, key_fn, ts_fn, allowed_lateness=0.0):
        self.assigner = assigner
        self.key_fn = key_fn
        self.ts_fn = ts_fn
        self.allowed_lateness = allowed_lateness


class WindowOperator(TimerOperator):
    """Keyed windows over records. ``how`` is reduce (``fn(a, b)``), aggregate
    (an AggregateFunction) or process (``fn(key, window, records)``);
    ``window_function(key, window, result)`` (reduce/aggregate) turns each
    result into the output record. ``late_tagged``: results and late records
    leave wrapped as (0, result) / (1, record), for ``late()``'s split."""

    def __init__(self, name, spec: WindowSpec, how, fn, window_function=None, late_tagged=False):
        super().__init__(name)
        self.assigner = spec.assigner
        self.merging = spec.assigner.merging
        self.key_fn = spec.key_fn
        self.ts_fn = spec.ts_fn
        self.lateness = spec.allowed_lateness
        self.how = how
        self.fn = fn
        self.window_function = window_function
        self.late_tagged = late_tagged
        self.windows: dict = {}         # (key, start, end) -> accumulator   (non-merging)
        self.sessions: dict = {}        # key -> sorted [[start, end, acc], ...]  (merging)
        self.cleanup = TimerQueue()     # (key, start, end) at end + lateness
        self.late_dropped = 0
        self.late_out = 0
        if how == AGGREGATE:
            agg = fn
            self._create, self._add, self._result = agg.create_accumulator, agg.add, agg.get_result
            self._merge = getattr(agg, "merge", None)
        elif how == REDUCE:
            self._create = lambda: _MISSING
            self._add = lambda x, acc, _f=fn: x if acc is _MISSING else _f(acc, x)
            self._result = lambda acc: acc
            self._merge = fn
        else:
            self._create = list
            self._add = _append
            self._result = None
            self._merge = lambda a, b: a + b

    # ---- records ----
    def process_batch(self, batch):
        key_fn, ts_fn = self.key_fn, self.ts_fn
        wm = self.timers.watermark
        out: list = []
        late: list = []
        if self.merging:
            for x in batch:
                t = ts_fn(x)
                if type(t) is not float:
                    t = to_seconds(t)
                if not self._add_to_session(key_fn(x), t, x, wm, out):
                    late.append(x)
            return self._finish_batch(out, late)
        windows, add, create, lateness = self.windows, self._add, self._create, self.lateness
        assign = self.assigner.assign
        register = self.timers.event.register
        if type(self.assigner) is Tumbling:
            self._tumbling_batch(batch, out, late)
            return self._finish_batch(out, late)
        for x in batch:
            t = ts_fn(x)
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
                    acc = create()
                    if end > wm:
                        register(wk, end)
                    else:       # fires right below, once; only its cleanup is ahead
                        self.cleanup.register(wk, end + lateness)
                windows[wk] = add(x, acc)
                placed = True
                if end <= wm:                   # fired before: fire again with this record
                    self._emit(k, start, end, windows[wk], out)
            if not placed:
                late.append(x)
        return self._finish_batch(out, late)

    def _tumbling_batch(self, batch, out, late):
        """``process_batch`` for tumbling windows, the common case: one window
        per record, its start computed inline, and a count kept inline."""
        key_fn, ts_fn = self.key_fn, self.ts_fn
        wm, lateness = self.timers.watermark, self.lateness
        windows, add, create = self.windows, self._add, self._create
        get = windows.get
        register, cleanup = self.timers.event.register, self.cleanup.register
        size, offset = self.assigner.size, self.assigner.offset
        count = type(self.fn) is Count and self.how == AGGREGATE
        missing = _MISSING
        for x in batch:
            t = ts_fn(x)
            if type(t) is not float:
                t = to_seconds(t)
            start = t - (t - offset) % size
            end = start + size
            if end + lateness <= wm:
                late.append(x)
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
        if late:
            if self.late_tagged:
                out.extend((1, x) for x in late)
                self.late_out += len(late)
            else:
                self.late_dropped += len(late)
        return self._checked(out) if not self.late_tagged else out

    def _emit(self, k, start, end, acc, out):
        if self.how == PROCESS:
            res = self.fn(k, TimeWindow(start, end), acc)
            if self.late_tagged:
                tmp: list = []
                self._extend(tmp, res)
                out.extend((0, r) for r in tmp)
            else:
                self._extend(out, res)
            return
        r = self._result(acc)
        if self.window_function is not None:
            r = self.window_function(k, TimeWindow(start, end), r)
        out.append((0, r) if self.late_tagged else r)

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
            self.timers.event.delete((k, s[0], s[1]), s[1])
            self.cleanup.delete((k, s[0], s[1]), s[1] + self.lateness)
            acc = s[2] if acc is _MISSING else merge(acc, s[2])
        if acc is _MISSING:
            acc = self._create()
        acc = self._add(x, acc)
        bisect.insort(sess, [lo, hi, acc], key=lambda s: s[0])
        if hi > wm:
            self.timers.event.register((k, lo, hi), hi)
        else:
            self.cleanup.register((k, lo, hi), hi + self.lateness)
            self._emit(k, lo, hi, acc, out)
        return True

    # ---- time ----
    def fire_event(self, watermark):
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
            self._emit(wk[0], wk[1], end, acc, out)
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
        return self._checked(out) if not self.late_tagged else out

    def fire_processing(self, now):
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


class TagSelect(Operator):
    """One side of ``late()``'s split: the records of one tag, unwrapped."""

    def __init__(self, name, tag):
        super().__init__(name)
        self.tag = tag

    def process_batch(self, batch):
        tag = self.tag
        return self._checked([r for t, r in batch if t == tag])
