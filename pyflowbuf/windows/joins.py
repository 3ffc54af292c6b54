"""The join operators on event time: windowed and interval joins.

On streams whose timestamps travel, the operators read each record's time
from the batch's times, and a joined record carries the larger time of its
two records (Flink's interval join does the same)."""
from __future__ import annotations

import math
from array import array as _array

from pyflowbuf.time.timers import TimerOperator
from pyflowbuf.time.watermarks import to_seconds


class WindowJoinOperator(TimerOperator):
    """Two keyed inputs cut into the same windows; when a window fires, each
    pair (left, right) of one key in it gives ``fn(left, right)``. Records
    later than their windows are dropped and counted."""

    def __init__(self, name, assigner, key_fns, ts_fns, fn):
        super().__init__(name)
        self.assigner = assigner
        self.key_fns = key_fns
        self.ts_fns = ts_fns
        self.fn = fn
        self.windows: dict = {}          # (key, start, end) -> ([left], [right])
        self.times: dict = {}            # timestamped output: (key, start, end) -> ([left's], [right's])
        self.late_dropped = 0

    def process_batch(self, batch):
        raise TypeError(f"operator {self.name!r} has two inputs: it takes batches with their input index")

    def process_input(self, batch, input_index):
        return self._add(batch, map(self.ts_fns[input_index], batch), input_index)

    def process_input_ts(self, batch, ts, input_index):
        if ts is None:
            return self.process_input(batch, input_index), None
        return self._add(batch, ts, input_index), None

    def _add(self, batch, ts, input_index):
        key_fn = self.key_fns[input_index]
        wm, windows, assign = self.timers.watermark, self.windows, self.assigner.assign
        times = self.times if self.timestamped else None
        register = self.timers.event.register
        for x, t in zip(batch, ts):
            if type(t) is not float:
                t = to_seconds(t)
            placed = False
            k = key_fn(x)
            for start, end in assign(t):
                if end <= wm:
                    continue
                wk = (k, start, end)
                sides = windows.get(wk)
                if sides is None:
                    sides = windows[wk] = ([], [])
                    register(wk, end)
                    if times is not None:
                        times[wk] = ([], [])
                sides[input_index].append(x)
                if times is not None:
                    times[wk][input_index].append(t)
                placed = True
            if not placed:
                self.late_dropped += 1
        return []

    def fire_event(self, watermark):
        out: list = []
        fn, pop = self.fn, self.timers.event.pop_due
        stamped = self.timestamped
        ots: list = []
        while True:
            due = pop(watermark)
            if due is None:
                break
            left, right = self.windows.pop(due[0], ((), ()))
            if stamped:
                lt, rt = self.times.pop(due[0], ((), ()))
                for a, ta in zip(left, lt):
                    for b, tb in zip(right, rt):
                        out.append(fn(a, b))
                        ots.append(ta if ta > tb else tb)
                continue
            for a in left:
                for b in right:
                    out.append(fn(a, b))
        if stamped:
            self.fired_ts = ots
        return self._checked(out)

    def fire_processing(self, now):
        return []

    def snapshot_state(self):
        return {"windows": {wk: (list(a), list(b)) for wk, (a, b) in self.windows.items()},
                "times": {wk: (list(a), list(b)) for wk, (a, b) in self.times.items()},
                "timers": self.timers.snapshot(), "late_dropped": self.late_dropped}

    def restore_state(self, state):
        if state:
            self.windows = {wk: (list(a), list(b)) for wk, (a, b) in state["windows"].items()}
            self.times = {wk: (list(a), list(b)) for wk, (a, b) in state.get("times", {}).items()}
            self.timers.restore(state["timers"])
            self.late_dropped = state["late_dropped"]

    def metrics(self):
        return {"late_records_dropped": self.late_dropped}


class IntervalJoinOperator(TimerOperator):
    """Flink's interval join: a left record at time t meets the right records
    of its key with times in [t + lower, t + upper]; ``fn(left, right)``
    returns an iterable of outputs (or None). Each side keeps its records
    only as long as a record of the other side could still match them (the
    watermark decides); a record below the watermark is late: dropped and
    counted."""

    def __init__(self, name, key_fns, ts_fns, lower, upper, fn):
        super().__init__(name)
        self.key_fns = key_fns
        self.ts_fns = ts_fns
        self.lower, self.upper = lower, upper
        self.fn = fn
        self.buffers = ({}, {})          # per side: key -> [(t, record)]
        self.late_dropped = 0

    def process_batch(self, batch):
        raise TypeError(f"operator {self.name!r} has two inputs: it takes batches with their input index")

    def process_input(self, batch, side):
        return self._match(batch, map(self.ts_fns[side], batch), side)[0]

    def process_input_ts(self, batch, ts, input_index):
        if ts is None:
            return self.process_input(batch, input_index), None
        return self._match(batch, ts, input_index)

    def _match(self, batch, ts, side):
        key_fn = self.key_fns[side]
        wm, fn, add = self.timers.watermark, self.fn, self._extend
        ots = [] if self.timestamped else None
        mine, theirs = self.buffers[side], self.buffers[1 - side]
        lower, upper = self.lower, self.upper
        # the other side's times that match time t: [t + lo, t + hi]
        lo, hi = (lower, upper) if side == 0 else (-upper, -lower)
        # how long a record of this side may still meet a later one of the other
        keep = upper if side == 0 else -lower
        register = self.timers.event.register
        out: list = []
        for x, t in zip(batch, ts):
            if type(t) is not float:
                t = to_seconds(t)
            if t < wm:
                self.late_dropped += 1
                continue
            k = key_fn(x)
            for t2, y in theirs.get(k, ()):
                if t + lo <= t2 <= t + hi:
                    n = len(out)
                    add(out, fn(x, y) if side == 0 else fn(y, x))
                    if ots is not None and len(out) > n:
                        ots.extend([t if t > t2 else t2] * (len(out) - n))
            lst = mine.get(k)
            if lst is None:
                lst = mine[k] = []
            lst.append((t, x))
            # gone once the watermark is past t + keep: nothing at or above it can match
            register((side, k), _after(t + keep))
        return self._checked(out), (None if ots is None else _array("d", ots))

    def fire_event(self, watermark):
        pop = self.timers.event.pop_due
        while True:
            due = pop(watermark)
            if due is None:
                break
            (side, k), limit = due
            keep = self.upper if side == 0 else -self.lower
            buf = self.buffers[side]
            lst = buf.get(k)
            if lst is not None:
                lst[:] = [(t, x) for t, x in lst if _after(t + keep) > watermark]
                if not lst:
                    del buf[k]
        return []

    def fire_processing(self, now):
        return []

    def snapshot_state(self):
        return {"buffers": [{k: list(v) for k, v in b.items()} for b in self.buffers],
                "timers": self.timers.snapshot(), "late_dropped": self.late_dropped}

    def restore_state(self, state):
        if state:
            self.buffers = tuple({k: list(v) for k, v in b.items()} for b in state["buffers"])
            self.timers.restore(state["timers"])
            self.late_dropped = state["late_dropped"]

    def metrics(self):
        return {"late_records_dropped": self.late_dropped}


def _after(t: float) -> float:
    """The least float above ``t``: a timer there fires once the watermark is past ``t``."""
    return math.nextafter(t, math.inf)
