"""Event-time windows: assigners, aggregate functions, and the operators.

    env = fb.Environment()
    counts = (env.from_iterable(words)                        # (word, seconds)
                .assign_timestamps(lambda r: r[1], out_of_orderness=0.5)
                .key_by(lambda r: r[0])
                .window(fb.Tumbling(60.0))
                .aggregate(fb.windows.Count(), window_function=lambda k, w, n: (k, w.start, n))
                .collect())

A window is ``TimeWindow(start, end)``, holding timestamps ``start <= t < end``.
It fires once the watermark reaches ``end``; with ``allowed_lateness(s)`` its
state is kept until the watermark reaches ``end + s``, and each record that
arrives in between fires it again with the updated result (Flink's
EventTimeTrigger). A record whose every window is past that point is late:
dropped and counted (``late_records_dropped`` in ``env.metrics()``), or sent to
the stream ``result.late()`` returns.

Windows over Arrow/pandas batch streams are computed a batch at a time with
pyarrow compute (``key_by("column")`` with ``assign_timestamps("column")``,
then ``aggregate({"out": ("column", "sum"), ...})``): see ``ArrowWindowOperator``.
"""
from __future__ import annotations

import bisect
import copy
import math
from typing import Any, Callable, NamedTuple

from pyflowbuf import errors
from pyflowbuf.api import Stream, _callable, _check_kind
from pyflowbuf.runtime.operators import Operator
from pyflowbuf.runtime.timers import TimerOperator, TimerQueue
from pyflowbuf.runtime.watermarks import check_seconds, to_seconds


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
        """The window's ``end`` in seconds: the watermark at which it fires (its
        records' timestamps are all below it).

        Example::

            TimeWindow(0.0, 10.0).max_timestamp      # 10.0
        """
        return self.end

    def __repr__(self):
        return f"TimeWindow({self.start!r}, {self.end!r})"


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


# ---- aggregate functions (Flink's AggregateFunction) ----

class AggregateFunction:
    """``create_accumulator()``, ``add(value, acc) -> acc``, ``get_result(acc)``,
    and ``merge(acc_a, acc_b) -> acc`` (needed by Session windows).

    Example::

        class Mean(fb.AggregateFunction):
            def create_accumulator(self):
                return (0, 0.0)                      # count, total
            def add(self, value, acc):
                return (acc[0] + 1, acc[1] + value["price"])
            def get_result(self, acc):
                return acc[1] / acc[0]
            def merge(self, a, b):
                return (a[0] + b[0], a[1] + b[1])

        mean_price = trades.key_by(lambda t: t["sym"]).window(fb.Tumbling(60)).aggregate(Mean())
    """

    def create_accumulator(self):
        """A new, empty accumulator for one window of one key.

        Example::

            def create_accumulator(self):
                return (0, 0.0)
        """
        raise NotImplementedError

    def add(self, value, accumulator):
        """Add record ``value`` to ``accumulator`` and return the accumulator (a
        new one, or the one given, changed).

        Example::

            def add(self, value, acc):
                return (acc[0] + 1, acc[1] + value["price"])
        """
        raise NotImplementedError

    def get_result(self, accumulator):
        """The window's result from its accumulator (by default the accumulator
        itself); it is what ``window_function`` receives, or the output record.

        Example::

            def get_result(self, acc):
                return acc[1] / acc[0]
        """
        return accumulator

    def merge(self, a, b):
        """The accumulator of two merged windows (Session windows merge). Without
        an override, ``aggregate`` on Session windows is refused with a
        ``ConfigurationError`` where it is declared.

        Example::

            def merge(self, a, b):
                return (a[0] + b[0], a[1] + b[1])
        """
        raise NotImplementedError(f"{type(self).__name__} has no merge(), which Session windows need")


class Count(AggregateFunction):
    """The number of records in the window.

    Example::

        counts = keyed.window(fb.Tumbling(60)).aggregate(fb.Count())
    """

    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        return acc + 1

    def merge(self, a, b):
        return a + b


def _identity(x):
    return x


class Sum(AggregateFunction):
    """The sum of ``fn(record)`` over the window (of the records themselves
    without ``fn``: a stream of numbers).

    ``fn`` picks the number from a record. Without ``fn`` on a stream of a
    kind that holds no numbers (str, bytes, structs, Arrow) ``aggregate`` is
    refused with ``ConfigurationError``; a record that is no number fails
    the job with ``RecordTypeError``. A ``fn`` that is not callable is a
    ``TypeError``.

    Example::

        totals = orders_by_user.window(fb.Tumbling(3600)).aggregate(fb.Sum(lambda o: o["amount"]))
    """

    def __init__(self, fn: Callable = _identity):
        _callable(fn, "Sum")
        self.fn = fn

    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        try:
            return acc + self.fn(value)
        except TypeError:
            if self.fn is not _identity:
                raise
            # the first such record, where a declaration could not know the
            # stream's kind (aggregate() refuses the kinds it does know)
            raise errors.RecordTypeError(
                f"Sum() adds up the records themselves, and this record is a {type(value).__name__} "
                f"({value!r:.80}): give Sum a function that picks the number, e.g. Sum(lambda r: r[1])"
            ) from None

    def merge(self, a, b):
        return a + b


# kinds whose records are never numbers: Sum() of the records cannot work
_NOT_NUMBERS = ("struct", "str", "bytes", "arrow", "pandas")


def _check_aggregate(agg, merging, kind=None):
    if isinstance(agg, type):
        raise TypeError(f"aggregate takes an AggregateFunction instance: {agg.__name__}() (with parentheses), "
                        f"not the class {agg.__name__}")
    if isinstance(agg, Sum) and agg.fn is _identity and kind is not None:
        from pyflowbuf.api import _kind_identity

        name = _kind_identity(kind)
        if name in _NOT_NUMBERS or (hasattr(name, "names") and name.names):
            raise errors.ConfigurationError(
                f"aggregate(Sum()) adds up the records themselves, and this stream's records are {name} "
                "(not numbers): give Sum a function that picks the number, e.g. Sum(lambda r: r[1])")
    for m in ("create_accumulator", "add", "get_result"):
        if not callable(getattr(agg, m, None)):
            raise TypeError(f"aggregate takes an AggregateFunction (create_accumulator, add, get_result, "
                            f"merge), got {type(agg).__name__} without {m}()")
    if merging:
        m = getattr(agg, "merge", None)
        base = getattr(type(agg), "merge", None) is AggregateFunction.merge
        if not callable(m) or base:
            raise errors.ConfigurationError(
                f"Session windows merge accumulators: {type(agg).__name__} needs a merge(a, b) method")


# ---- the window operator ----

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

    def metrics(self) -> dict:
        return {"late_records_dropped": self.late_dropped, "late_records_out": self.late_out}


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


# ---- the API: what KeyedStream.window() returns ----

def _stream_timestamps(stream, what):
    ts = getattr(stream.node, "timestamps", None)
    if ts is None:
        raise errors.ConfigurationError(
            f"{what} works in event time, and the stream {stream.node.name!r} has no timestamps: call "
            "assign_timestamps(fn, out_of_orderness=...) on it first (a map, flat_map or process after "
            "assign_timestamps makes new records whose timestamps it cannot know: assign them after it)")
    return ts


class WindowedStream:
    """A keyed stream cut into windows (``KeyedStream.window``): finish it with
    ``reduce``, ``aggregate`` or ``process``; ``allowed_lateness`` first if
    late records should still update their windows.

    Example::

        w = timed.key_by(lambda e: e["page"]).window(fb.Sliding(60, 10))
        hits = w.aggregate(fb.Count())
    """

    def __init__(self, keyed, assigner):
        if not isinstance(assigner, WindowAssigner):
            raise TypeError(f"window takes Tumbling(size), Sliding(size, slide) or Session(gap), "
                            f"got {type(assigner).__name__}")
        self.keyed = keyed
        self.assigner = assigner
        self.lateness = 0.0
        self.ts = _stream_timestamps(keyed, "window()")

    def late(self, *args, **kwargs):
        """Late records come from the window's result, once it has a function.

        Always raises ``ConfigurationError`` pointing to ``WindowResult.late``.

        Example::

            res = keyed.window(fb.Tumbling(60)).aggregate(fb.Count())
            late = res.late()          # not keyed.window(...).late()
        """
        raise errors.ConfigurationError(
            "late() is called on the result of the window, once reduce, aggregate or process gave it "
            "its function: res = ...window(...).aggregate(...); late = res.late()")

    def allowed_lateness(self, seconds) -> "WindowedStream":
        """Keep each window's state ``seconds`` past its end: records arriving
        in that time fire it again with the updated result.

        ``seconds`` is a number or ``timedelta`` >= 0 (else
        ``ConfigurationError``). Returns this ``WindowedStream``.

        Example::

            res = keyed.window(fb.Tumbling(60)).allowed_lateness(30).aggregate(fb.Count())
        """
        self.lateness = check_seconds("allowed_lateness", seconds)
        return self

    def _spec(self):
        return WindowSpec(self.assigner, self.keyed._key_fn, self.ts, self.lateness)

    def _node(self, how, fn, window_function, parallelism, name, kind):
        kind = _check_kind(kind, f"window {name!r}")
        spec = self._spec()
        holder: dict = {"tagged": False}

        def make():
            return WindowOperator(name, spec, how, fn, window_function, late_tagged=holder["tagged"])
        node = self.keyed._then(name, make, parallelism, kind)
        node.event_time = True
        res = WindowResult(self.keyed.env, node, holder, kind)
        res._ts = self.ts
        return res

    def reduce(self, fn: Callable, *, window_function: Callable | None = None, parallelism=None,
               name: str = "window_reduce", kind: Any = None) -> "WindowResult":
        """Per key and window, the records folded with ``fn(a, b)``; the output
        is the reduced record, or ``window_function(key, window, reduced)``.

        Returns a ``WindowResult``. A ``fn`` or ``window_function`` that is not
        callable is a ``TypeError``.

        Example::

            biggest = keyed.window(fb.Tumbling(60)).reduce(
                lambda a, b: a if a["amount"] >= b["amount"] else b,
                window_function=lambda key, w, order: (key, w.start, order["amount"]))
        """
        _callable(fn, "reduce")
        if window_function is not None:
            _callable(window_function, "window_function")
        return self._node(REDUCE, fn, window_function, parallelism, name, kind)

    def aggregate(self, agg, *, window_function: Callable | None = None, parallelism=None,
                  name: str = "window_aggregate", kind: Any = None):
        """Per key and window, an AggregateFunction's ``get_result``, or
        ``window_function(key, window, result)``. On an Arrow/pandas stream
        keyed by a column name, ``agg`` is a dict ``{output column: (column,
        function)}`` computed with pyarrow (see ``ArrowWindowOperator``).

        Returns a ``WindowResult`` (a ``Stream`` of RecordBatches on the
        vectorized path). An AggregateFunction class instead of an instance, or
        an object without its methods, is a ``TypeError``; one without
        ``merge`` on Session windows, ``Sum()`` of records that are no numbers,
        or a bad column spec is a ``ConfigurationError``.

        Example::

            counts = keyed.window(fb.Tumbling(60)).aggregate(
                fb.Count(), window_function=lambda key, w, n: (key, w.start, n))
            per_word = (batches.assign_timestamps("ts").key_by("word").window(fb.Tumbling(60))
                               .aggregate({"n": ("word", "count"), "total": ("amount", "sum")}))
        """
        if isinstance(agg, dict):
            return self._arrow_node(agg, parallelism, name)
        _check_aggregate(agg, self.assigner.merging, self.keyed.node.kind)
        if window_function is not None:
            _callable(window_function, "window_function")
        return self._node(AGGREGATE, agg, window_function, parallelism, name, kind)

    def process(self, fn: Callable, *, parallelism=None, name: str = "window_process", kind: Any = None):
        """``fn(key, window, records) -> iterable of outputs`` once per window
        (and again per record arriving within the allowed lateness).

        ``window`` is a ``TimeWindow``, ``records`` a list of the window's
        records. Returns a ``WindowResult``; a ``fn`` that is not callable
        is a ``TypeError``.

        Example::

            def median(key, window, records):
                values = sorted(r["latency"] for r in records)
                return [(key, window.start, values[len(values) // 2])]

            medians = keyed.window(fb.Tumbling(60)).process(median)
        """
        _callable(fn, "process")
        return self._node(PROCESS, fn, None, parallelism, name, kind)

    def _arrow_node(self, spec, parallelism, name):
        column_key = getattr(self.keyed, "_key_column", None)
        if column_key is None or not isinstance(self.ts, str):
            raise errors.ConfigurationError(
                "aggregate({column: (source column, function)}) is the vectorized path for Arrow/pandas "
                "streams: key_by a column name and assign_timestamps a column name first")
        aggs = check_arrow_spec(spec)
        assigner, lateness, ts = self.assigner, self.lateness, self.ts
        if assigner.merging:
            raise errors.ConfigurationError("the vectorized window path takes Tumbling or Sliding windows")
        env = self.keyed.env
        p = 1 if parallelism is None else parallelism
        # batches are not split by key: with one subtask it sees every row; with
        # more, each aggregates the batches it gets and one subtask combines
        # their partial results per window once its watermark (the minimum of
        # theirs) passes the window's end, when every partial result is in
        plain = Stream(env, self.keyed.node)
        if p == 1:
            node = plain._then(name, lambda: ArrowWindowOperator(name, column_key, ts, assigner, aggs, lateness),
                               1, "arrow")
            node.event_time = True
            return Stream(env, node)
        if lateness:
            raise errors.ConfigurationError(
                "the vectorized window path takes allowed_lateness only with parallelism 1: its partial "
                "results are combined once per window")
        part = plain._then(f"{name}.partial", lambda: ArrowWindowOperator(
            f"{name}.partial", column_key, ts, assigner, aggs, 0.0, mode="partial"), p, "arrow")
        part.event_time = True
        node = Stream(env, part)._then(name, lambda: ArrowWindowOperator(
            name, column_key, ts, assigner, aggs, 0.0, mode="final"), 1, "arrow")
        node.event_time = True
        return Stream(env, node)


class WindowResult(Stream):
    """The results of a window operator; ``late()`` is the stream of its
    late records (Flink's ``side_output_late_data`` / ``get_side_output``).

    Example::

        res = keyed.window(fb.Tumbling(60)).aggregate(fb.Count())
        counts = res.collect()
        late = res.late().collect()
    """

    def __init__(self, env, node, holder, kind):
        super().__init__(env, node)
        self._window_node = node
        self._holder = holder
        self._result_kind = kind
        self._late = None

    def late(self, *, name: str = "late") -> Stream:
        """The records that came too late for every window they belong to
        (past the watermark plus the allowed lateness), instead of being
        dropped. It may be called before or after the results are used
        (``res.collect(); late = res.late()``): what reads the results
        keeps reading them.

        Returns a ``Stream`` of the late records as they came (with their
        timestamps); calling it again returns the same stream.

        Example::

            res = keyed.window(fb.Tumbling(60)).aggregate(fb.Count())
            res.late().write_text("late-records")
        """
        if self._late is not None:
            return self._late
        wnode = self._window_node
        env, p = self.env, wnode.parallelism
        readers = list(wnode.consumers)
        wnode.consumers.clear()
        self._holder["tagged"] = True
        # the window's output now carries (tag, record), a forward hop each
        # (always within one process) to the two selectors that split it
        wnode.kind = "pickle"
        rname = wnode.name
        main = Stream(env, wnode)._then(f"{rname}.results", lambda: TagSelect(f"{rname}.results", 0),
                                         p, self._result_kind)
        late = Stream(env, wnode)._then(name, lambda: TagSelect(name, 1), p, None)
        late.timestamps = self._ts
        # Operators declared on the results before this call read the
        # selector of the results now, as does anything declared later on a
        # stream taken from them (Environment._add follows split_into).
        for reader in readers:
            for inp in reader.inputs:
                if inp.node is wnode:
                    inp.node = main
                    main.consumers.append(reader)
        wnode.split_into = main
        # the plan reads the nodes in declaration order, upstream first
        nodes = env.nodes
        for n in (main, late):
            nodes.remove(n)
        at = nodes.index(wnode) + 1
        nodes[at:at] = [main, late]
        self.node = main
        self._late = Stream(env, late)
        return self._late

    def collect(self, **kw):
        """``Stream.collect`` of the window's results. The handle it returns has
        no ``late()``: calling it raises ``ConfigurationError`` pointing to
        ``res.late()`` on the result stream.

        Example::

            res = keyed.window(fb.Tumbling(60)).aggregate(fb.Count())
            counts = res.collect()
            late = res.late().collect()
        """
        handle = super().collect(**kw)
        handle.late = _late_after_collect
        return handle


def _late_after_collect(*args, **kwargs):
    raise errors.ConfigurationError(
        "late() is a method of the window's result stream, not of the handle collect() returns: "
        "res = ....aggregate(...); counts = res.collect(); late = res.late().collect()")


# ---- the vectorized path: Arrow/pandas batches, pyarrow compute ----

_ARROW_FUNCS = ("count", "sum", "min", "max", "mean")
# how a function's partial results combine: count and sum add up, min/max stay
_COMBINE = {"count": "sum", "sum": "sum", "min": "min", "max": "max"}


def check_arrow_spec(spec: dict) -> list:
    """``{out: (column, function)}`` as [(out, column, function)], checked."""
    out = []
    for name, what in spec.items():
        if not isinstance(name, str) or not isinstance(what, tuple) or len(what) != 2 \
                or not isinstance(what[0], str) or what[1] not in _ARROW_FUNCS:
            raise errors.ConfigurationError(
                f"aggregate({{...}}) takes {{output column: (input column, function)}} with a function among "
                f"{', '.join(_ARROW_FUNCS)}; got {name!r}: {what!r}")
        if name in ("window_start", "window_end"):
            raise errors.ConfigurationError(f"aggregate: {name!r} is the name of a column the windows add")
        out.append((name, what[0], what[1]))
    if not out:
        raise errors.ConfigurationError("aggregate({...}) needs at least one output column")
    return out


class ArrowWindowOperator(TimerOperator):
    """Keyed event-time windows over Arrow RecordBatches (or pandas
    DataFrames), a batch at a time: the window start of every row and a
    group-by (key, window) with pyarrow compute, keeping per window only
    partial aggregates (counts, sums, minima, maxima), which are combined
    when the watermark fires the window. The output is one RecordBatch per
    firing: the key column, ``window_start``, ``window_end`` and the
    aggregates, sorted by window and key.

    Records arriving within the allowed lateness update their window, which
    is emitted again at the next watermark.

    ``mode``: "full" (the above), "partial" (emits the partial aggregates of
    its own rows per window, for a "final" one to combine) or "final" (its
    input is those partial aggregates)."""

    def __init__(self, name, key_column, ts_column, assigner, aggs, lateness, mode="full"):
        super().__init__(name)
        self.mode = mode
        self.key = key_column
        self.ts = ts_column
        self.assigner = assigner
        self.aggs = aggs
        self.lateness = lateness
        self.parts: list = []           # partial tables not combined yet
        self.state = None               # one combined table of the open windows
        self.fired_end = -float("inf")  # windows ending at or before this have fired
        self.late_dropped = 0
        # partial columns: (partial name, source column, pyarrow function)
        partial = {}
        for out, col, fn in aggs:
            for f in (("sum", "count") if fn == "mean" else (fn,)):
                partial[f"{col}_{f}"] = (col, f)
        self.partial = [(n, c, f) for n, (c, f) in partial.items()]

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        import pyarrow as pa
        import pyarrow.compute as pc
        self.pa, self.pc = pa, pc

    def _table(self, b):
        pa = self.pa
        if isinstance(b, pa.RecordBatch):
            return pa.Table.from_batches([b])
        if isinstance(b, pa.Table):
            return b
        return pa.Table.from_pandas(b, preserve_index=False)

    def process_batch(self, batch):
        from pyflowbuf.runtime.watermarks import seconds_column
        pa, pc = self.pa, self.pc
        if self.mode == "final":
            # partial results, grouped already; they come before the watermark
            # that passes their window, so none is late
            self.parts.extend(self._table(b) for b in batch)
            if len(self.parts) >= 64:
                self._combine()
            return []
        wm, lateness = self.timers.watermark, self.lateness
        a = self.assigner
        for b in batch:
            t = self._table(b)
            if t.num_rows == 0:
                continue
            ts = seconds_column(t.column(self.ts))
            step = a.slide if isinstance(a, Sliding) else a.size
            last = pc.add(pc.multiply(pc.floor(pc.divide(pc.subtract(ts, a.offset), step)), step), a.offset)
            n_windows = 1 if not isinstance(a, Sliding) else max(1, -int(-a.size // a.slide))
            cols = {self.key: t.column(self.key)}
            for _, col, _f in self.partial:
                if col != self.key:
                    cols[col] = t.column(col)
            pieces = []
            for j in range(n_windows):
                start = pc.subtract(last, j * step) if j else last
                end = pc.add(start, a.size)
                keep = pc.and_(pc.greater(end, ts), pc.greater(pc.add(end, lateness), wm))
                piece = pa.table(dict(cols, window_start=start, window_end=end)).filter(keep)
                pieces.append(piece)
                if j == 0:
                    on_time = keep
            # a row is late when none of its windows takes it
            if n_windows == 1:
                placed = on_time
            else:
                placed = None
                for j in range(n_windows):
                    start = pc.subtract(last, j * step) if j else last
                    end = pc.add(start, a.size)
                    k = pc.and_(pc.greater(end, ts), pc.greater(pc.add(end, lateness), wm))
                    placed = k if placed is None else pc.or_(placed, k)
            self.late_dropped += t.num_rows - pc.sum(pc.cast(placed, pa.int64())).as_py()
            rows = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
            if rows.num_rows:
                self.parts.append(rows.group_by([self.key, "window_start", "window_end"], use_threads=False)
                                  .aggregate([(c, f) for _, c, f in self.partial]))
                if len(self.parts) >= 64:
                    self._combine()
        return []

    def _combine(self):
        """Fold the pending partial tables into the state table."""
        pa = self.pa
        tables = ([self.state] if self.state is not None else []) + self.parts
        self.parts = []
        if not tables:
            return
        t = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        names = [n for n, _, _ in self.partial]
        t = t.group_by([self.key, "window_start", "window_end"], use_threads=False).aggregate(
            [(n, _COMBINE[f]) for n, _, f in self.partial])
        # group_by names a combined column "<partial>_<function>": back to the partial's name
        rename = {f"{n}_{_COMBINE[f]}": n for n, _, f in self.partial}
        self.state = t.rename_columns([rename.get(c, c) for c in t.column_names]).select(
            [self.key, "window_start", "window_end"] + names)

    def on_watermark(self, watermark):
        if not self.timers.advance(watermark):
            return [], None
        return self._fire(watermark), watermark

    def _fire(self, wm):
        pa, pc = self.pa, self.pc
        keys = [self.key, "window_start", "window_end"]
        # windows that fired before and got rows since (within the allowed lateness)
        dirty = None
        if self.parts and self.lateness:
            fired = [p.filter(pc.less_equal(p.column("window_end"), self.fired_end)).select(keys)
                     for p in self.parts]
            fired = pa.concat_tables(fired)
            if fired.num_rows:
                dirty = fired.group_by(keys, use_threads=False).aggregate([])
        self._combine()
        st = self.state
        if st is None or st.num_rows == 0:
            return []
        end = st.column("window_end")
        due = st.filter(pc.and_(pc.less_equal(end, wm), pc.greater(end, self.fired_end)))
        if dirty is not None:
            due = pa.concat_tables([due, st.join(dirty, keys, join_type="left semi")])
        self.fired_end = max(self.fired_end, wm)
        self.state = st.filter(pc.greater(pc.add(end, self.lateness), wm))
        if due.num_rows == 0:
            return []
        if self.mode == "partial":
            return due.combine_chunks().to_batches()
        due = due.sort_by([("window_start", "ascending"), (self.key, "ascending")])
        cols = {self.key: due.column(self.key), "window_start": due.column("window_start"),
                "window_end": due.column("window_end")}
        for out, col, fn in self.aggs:
            if fn == "mean":
                cols[out] = pc.divide(pc.cast(due.column(f"{col}_sum"), pa.float64()),
                                      pc.cast(due.column(f"{col}_count"), pa.float64()))
            else:
                cols[out] = due.column(f"{col}_{fn}")
        table = pa.table(cols).combine_chunks()
        return table.to_batches()

    def fire_event(self, watermark):
        return self._fire(watermark)

    def fire_processing(self, now):
        return []

    def snapshot_state(self):
        self._combine()
        st = self.state
        data = None
        if st is not None:
            sink = self.pa.BufferOutputStream()
            with self.pa.ipc.new_stream(sink, st.schema) as w:
                w.write_table(st)
            data = sink.getvalue().to_pybytes()
        return {"state": data, "fired_end": self.fired_end, "timers": self.timers.snapshot(),
                "late_dropped": self.late_dropped}

    def restore_state(self, state):
        if not state:
            return
        import pyarrow as pa
        if state["state"] is not None:
            self.state = pa.ipc.open_stream(pa.py_buffer(state["state"])).read_all()
        self.fired_end = state["fired_end"]
        self.timers.restore(state["timers"])
        self.late_dropped = state["late_dropped"]

    def metrics(self) -> dict:
        return {"late_records_dropped": self.late_dropped}


# ---- joins on event time ----

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
        self.late_dropped = 0

    def process_batch(self, batch):
        raise TypeError(f"operator {self.name!r} has two inputs: it takes batches with their input index")

    def process_input(self, batch, input_index):
        key_fn, ts_fn = self.key_fns[input_index], self.ts_fns[input_index]
        wm, windows, assign = self.timers.watermark, self.windows, self.assigner.assign
        register = self.timers.event.register
        for x in batch:
            t = ts_fn(x)
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
                sides[input_index].append(x)
                placed = True
            if not placed:
                self.late_dropped += 1
        return []

    def fire_event(self, watermark):
        out: list = []
        fn, pop = self.fn, self.timers.event.pop_due
        while True:
            due = pop(watermark)
            if due is None:
                break
            left, right = self.windows.pop(due[0], ((), ()))
            for a in left:
                for b in right:
                    out.append(fn(a, b))
        return self._checked(out)

    def fire_processing(self, now):
        return []

    def snapshot_state(self):
        return {"windows": {wk: (list(a), list(b)) for wk, (a, b) in self.windows.items()},
                "timers": self.timers.snapshot(), "late_dropped": self.late_dropped}

    def restore_state(self, state):
        if state:
            self.windows = {wk: (list(a), list(b)) for wk, (a, b) in state["windows"].items()}
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
        key_fn, ts_fn = self.key_fns[side], self.ts_fns[side]
        wm, fn, add = self.timers.watermark, self.fn, self._extend
        mine, theirs = self.buffers[side], self.buffers[1 - side]
        lower, upper = self.lower, self.upper
        # the other side's times that match time t: [t + lo, t + hi]
        lo, hi = (lower, upper) if side == 0 else (-upper, -lower)
        # how long a record of this side may still meet a later one of the other
        keep = upper if side == 0 else -lower
        register = self.timers.event.register
        out: list = []
        for x in batch:
            t = ts_fn(x)
            if type(t) is not float:
                t = to_seconds(t)
            if t < wm:
                self.late_dropped += 1
                continue
            k = key_fn(x)
            for t2, y in theirs.get(k, ()):
                if t + lo <= t2 <= t + hi:
                    add(out, fn(x, y) if side == 0 else fn(y, x))
            lst = mine.get(k)
            if lst is None:
                lst = mine[k] = []
            lst.append((t, x))
            # gone once the watermark is past t + keep: nothing at or above it can match
            register((side, k), _after(t + keep))
        return self._checked(out)

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


class JoinedStreams:
    """``a.join(b).where(key_a).equal_to(key_b).window(assigner).apply(fn)``.

    Both streams need timestamps; each pair of records with equal keys in
    one window gives one output.

    Example::

        pairs = (orders.join(payments)
                       .where(lambda o: o["id"]).equal_to(lambda p: p["order"])
                       .window(fb.Tumbling(60))
                       .apply(lambda o, p: (o["id"], p["amount"])))
    """

    def __init__(self, first, second):
        self.first, self.second = first, second
        self.key_a = self.key_b = None
        self.assigner = None

    def where(self, key_fn):
        """The key of the first stream's records. Returns this ``JoinedStreams``;
        a ``key_fn`` that is not callable is a ``TypeError``.

        Example::

            orders.join(payments).where(lambda o: o["id"])
        """
        _callable(key_fn, "where")
        self.key_a = key_fn
        return self

    def equal_to(self, key_fn):
        """The key of the second stream's records, compared with ``where``'s.
        Returns this ``JoinedStreams``. Called before ``where`` it is a
        ``ConfigurationError``; a ``key_fn`` that is not callable a
        ``TypeError``.

        Example::

            orders.join(payments).where(lambda o: o["id"]).equal_to(lambda p: p["order"])
        """
        _callable(key_fn, "equal_to")
        if self.key_a is None:
            raise errors.ConfigurationError("join: call where(key_a) before equal_to(key_b)")
        self.key_b = key_fn
        return self

    def window(self, assigner):
        """The windows both streams are cut into: ``Tumbling`` or ``Sliding`` (a
        ``Session`` or anything else is a ``ConfigurationError``, as is a call
        before ``where(...).equal_to(...)``). Returns this ``JoinedStreams``.

        Example::

            joined.window(fb.Tumbling(60))
        """
        if self.key_b is None:
            raise errors.ConfigurationError("join: call where(key_a).equal_to(key_b) before window()")
        if not isinstance(assigner, WindowAssigner) or assigner.merging:
            raise errors.ConfigurationError(
                f"a window join takes Tumbling or Sliding windows, got {assigner!r}")
        self.assigner = assigner
        return self

    def apply(self, fn, *, parallelism=None, name: str = "window_join", kind: Any = None) -> Stream:
        """``fn(left, right) -> record`` for every pair of one key in one window.

        Returns a ``Stream``. Called before ``window`` it is a
        ``ConfigurationError``; a ``fn`` that is not callable a ``TypeError``.

        Example::

            pairs = joined.window(fb.Tumbling(60)).apply(lambda o, p: (o["id"], p["amount"]))
        """
        _callable(fn, "apply")
        if self.assigner is None:
            raise errors.ConfigurationError("join: call window(...) before apply()")
        ts = (_stream_timestamps(self.first, "join"), _stream_timestamps(self.second, "join"))
        a, b = self.first.key_by(self.key_a), self.second.key_by(self.key_b)
        keys, assigner = (self.key_a, self.key_b), self.assigner
        return _two_input(a, b, name, lambda: WindowJoinOperator(name, assigner, keys, ts, fn),
                          parallelism, kind)


class IntervalJoin:
    """``a.key_by(ka).interval_join(b.key_by(kb)).between(lower, upper).process(fn)``.

    Both streams need timestamps. A record of either side is kept only as
    long as a record of the other side could still match it (the watermark
    decides); a record below the watermark is late: dropped and counted.

    Example::

        matched = (clicks.key_by(lambda c: c["ad"])
                         .interval_join(views.key_by(lambda v: v["ad"]))
                         .between(-5.0, 0.0)
                         .process(lambda click, view: [(click["ad"], click["ts"] - view["ts"])]))
    """

    def __init__(self, first, second):
        from pyflowbuf.api import KeyedStream
        if not isinstance(first, KeyedStream) or not isinstance(second, KeyedStream):
            raise errors.ConfigurationError("interval_join joins two keyed streams: key_by both first")
        if first.env is not second.env:
            raise errors.ConfigurationError("interval_join: the streams belong to different Environments")
        self.first, self.second = first, second
        self.bounds = None

    def between(self, lower, upper):
        """Right records with time in [t + lower, t + upper] meet a left record at t.

        ``lower`` and ``upper`` are finite seconds, either sign, ``lower <=
        upper`` (else ``ConfigurationError``). Returns this ``IntervalJoin``.

        Example::

            a.interval_join(b).between(-5.0, 0.0)      # b's records from 5 s before a's up to a's
        """
        for n, v in (("lower", lower), ("upper", upper)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise errors.ConfigurationError(f"interval_join: {n} must be finite seconds, got {v!r}")
        if lower > upper:
            raise errors.ConfigurationError(f"interval_join: lower ({lower}) must be <= upper ({upper})")
        self.bounds = (float(lower), float(upper))
        return self

    def process(self, fn, *, parallelism=None, name: str = "interval_join", kind: Any = None) -> Stream:
        """``fn(left, right) -> iterable of outputs (or None)`` per matching pair.

        Returns a ``Stream``. Called before ``between`` it is a
        ``ConfigurationError``; a ``fn`` that is not callable a ``TypeError``.

        Example::

            a.interval_join(b).between(0.0, 1.0).process(lambda l, r: [(l["id"], r["id"])])
        """
        _callable(fn, "process")
        if self.bounds is None:
            raise errors.ConfigurationError("interval_join: call between(lower, upper) before process()")
        ts = (_stream_timestamps(self.first, "interval_join"), _stream_timestamps(self.second, "interval_join"))
        keys = (self.first._key_fn, self.second._key_fn)
        lo, hi = self.bounds
        return _two_input(self.first, self.second, name,
                          lambda: IntervalJoinOperator(name, keys, ts, lo, hi, fn), parallelism, kind)


def _two_input(a, b, name, make, parallelism, kind):
    from pyflowbuf.api import _parallelism
    kind = _check_kind(kind, f"{name!r}")
    env = a.env
    p = _parallelism(env, parallelism)
    node = env._add(name=name, parallelism=p, make_operator=make,
                    inputs=[a._input_to(p), b._input_to(p)], kind=kind)
    node.event_time = True
    return Stream(env, node)


__all__ = ["TimeWindow", "Tumbling", "Sliding", "Session", "AggregateFunction", "Count", "Sum",
           "WindowedStream", "WindowResult", "JoinedStreams", "IntervalJoin"]
