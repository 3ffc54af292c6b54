"""What ``KeyedStream.window()`` and ``Stream.window_all()`` return
(``WindowedStream``, ``AllWindowedStream``). The stream of a window's results
(``WindowResult``) is a ``Stream`` and lives with it in ``stream.py``: this
module makes streams through the stream it came from (``Stream._derive``)
and never imports ``stream.py``, which imports it."""
from __future__ import annotations

import warnings
from typing import Any, Callable


from pyflowbuf import errors
from pyflowbuf._validation import _callable, _check_arity, _check_kind, _kind_identity
from pyflowbuf.api.side_outputs import LATE, LATE_TAG, OutputTag, declare_side_outputs
from pyflowbuf.time.process import takes_context
from pyflowbuf.jobgraph.graph import carried_timestamps as _carried
from pyflowbuf.jobgraph.graph import has_timestamps
from pyflowbuf.time.watermarks import check_seconds
from pyflowbuf.windows.aggregates import AggregateFunction, Sum, _identity
from pyflowbuf.windows.arrow import ArrowWindowOperator, check_arrow_spec
from pyflowbuf.windows.assigners import WindowAssigner
from pyflowbuf.windows.operator import AGGREGATE, PROCESS, REDUCE, WindowSpec, window_operator_class
from pyflowbuf.windows.triggers import EventTimeTrigger, ProcessingTimeTrigger, Trigger

_RESERVED = {LATE: "a window's late records are result.late()"}


_NOT_NUMBERS = ("struct", "str", "bytes", "arrow", "pandas")


def _check_aggregate(agg, merging, kind=None):
    if isinstance(agg, type):
        raise TypeError(f"aggregate takes an AggregateFunction instance: {agg.__name__}() (with parentheses), "
                        f"not the class {agg.__name__}")
    if isinstance(agg, Sum) and agg.fn is _identity and kind is not None:

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

def _stream_timestamps(stream, what):
    """What an event-time operator reads a record's time with: the assigner's
    function or column, or (timestamps that travel with the records, as after
    a map or a window) a marker; a ConfigurationError on a stream without."""
    ts = getattr(stream.node, "timestamps", None)
    carried = has_timestamps(stream.node)
    if (ts is None or ts is _carried) and carried:
        return _carried
    if ts is None or ts is _carried:
        raise errors.ConfigurationError(
            f"{what} works in event time, and the stream {stream.node.name!r} has no timestamps: call "
            "assign_timestamps(fn, out_of_orderness=...) on it, or on a stream it comes from (timestamps "
            "travel through map, filter, flat_map, process, union, connect, key_by, windows, joins and "
            "side outputs; a source has none, nor has a count window's result, and a union or "
            "connect has them only when all its inputs do)")
    return ts


def _check_trigger(assigner, trigger):
    """The trigger the operator runs (None: the default event-time path), or
    a typed error for a combination that has no meaning here."""
    if trigger is None:
        return None
    if isinstance(trigger, type) and issubclass(trigger, Trigger):
        raise TypeError(f"trigger= (and .trigger()) takes a Trigger instance: {trigger.__name__}(...) (with its arguments, e.g. "
                        f"CountTrigger(3)), not the class {trigger.__name__}")
    if not isinstance(trigger, Trigger):
        raise TypeError(f"trigger= (and .trigger()) takes EventTimeTrigger(), ContinuousEventTimeTrigger(s), CountTrigger(n) or "
                        f"PurgingTrigger(...), got {type(trigger).__name__}")
    domain = assigner.domain
    if domain == "count":
        raise errors.ConfigurationError(
            f"{assigner!r} fires by its own count: trigger= does not apply to count windows (use a time "
            "window with CountTrigger(n) for count firings within time windows)")
    if trigger.domain is not None and trigger.domain != domain:
        raise errors.ConfigurationError(
            f"trigger {trigger!r} works in {trigger.domain} time and the windows {assigner!r} in {domain} time")
    if trigger == EventTimeTrigger() or trigger == ProcessingTimeTrigger():
        return None if domain == "event" else trigger
    if assigner.merging and domain == "processing":
        raise errors.ConfigurationError(
            f"{assigner!r} windows merge in processing time, and take only their default trigger here "
            f"(not {trigger!r}): use TumblingProcessingTime or SlidingProcessingTime with it")
    return trigger


def _no_key(record):
    """The key of every record of ``window_all``: one window state per window."""
    return 0


class _DropKey:
    """A window function of ``window_all`` (no key) called as a keyed one."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, key, *args):
        return self.fn(*args)


class WindowedStream:
    """A keyed stream cut into windows (``KeyedStream.window``): finish it with
    ``reduce``, ``aggregate`` or ``process``; ``allowed_lateness`` first if
    late records should still update their windows.

    Example::

        w = timed.key_by(lambda e: e["page"]).window(fb.Sliding(60, 10))
        hits = w.aggregate(fb.Count())
    """

    _all = False        # window_all: no key, one subtask

    def __init__(self, keyed, assigner, trigger=None):
        if not isinstance(assigner, WindowAssigner):
            raise TypeError(f"window takes Tumbling(size), Sliding(size, slide), Session(gap), their "
                            f"ProcessingTime versions or CountWindow(size), got {type(assigner).__name__}")
        self.keyed = keyed
        self.assigner = assigner
        self.lateness = 0.0
        self._trigger = _check_trigger(assigner, trigger)
        self._late_tag = None       # side_output_late_data(tag): the tag get_side_output(tag) reads
        what = "window_all()" if self._all else "window()"
        self.ts = _stream_timestamps(keyed, what) if assigner.domain == "event" else None

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

    def _not_yet(self, what, keyword, example):
        raise errors.ConfigurationError(
            f"{what} is set on the window operator, which reduce, aggregate, process or apply makes: "
            f"call it on their result ({example}), or pass {keyword}= to them")

    def name(self, name: str):
        """The window has no operator yet: a ``ConfigurationError`` saying to
        name the result of ``reduce``/``aggregate``/``process``/``apply``
        (PyFlink's order), or to pass ``name=`` to them.

        Example::

            res = keyed.window(fb.Tumbling(60)).aggregate(fb.Count()).name("per-minute")
        """
        self._not_yet("name(...)", "name", "....aggregate(...).name('per-minute')")

    def uid(self, uid: str):
        """The window has no operator yet: a ``ConfigurationError`` saying to
        give the result of ``reduce``/``aggregate``/``process``/``apply`` its
        uid.

        Example::

            res = keyed.window(fb.Tumbling(60)).aggregate(fb.Count()).uid("per-minute")
        """
        raise errors.ConfigurationError(
            "uid(...) is set on the window operator, which reduce, aggregate, process or apply makes: call "
            "it on their result (....aggregate(...).uid('per-minute'))")

    def set_parallelism(self, parallelism: int):
        """The window has no operator yet: a ``ConfigurationError`` saying to
        call it on the result of ``reduce``/``aggregate``/``process``/
        ``apply``, or to pass ``parallelism=`` to them.

        Example::

            res = keyed.window(fb.Tumbling(60)).aggregate(fb.Count()).set_parallelism(4)
        """
        self._not_yet("set_parallelism(...)", "parallelism", "....aggregate(...).set_parallelism(4)")

    def allowed_lateness(self, seconds) -> "WindowedStream":
        """Keep each window's state ``seconds`` past its end: records arriving
        in that time fire it again with the updated result.

        ``seconds`` is a number or ``timedelta`` >= 0 (else
        ``ConfigurationError``); 1000 or more warns (``UnitWarning``: PyFlink's
        takes milliseconds). Returns this ``WindowedStream``.

        Example::

            res = keyed.window(fb.Tumbling(60)).allowed_lateness(30).aggregate(fb.Count())
        """
        lateness = check_seconds("allowed_lateness", seconds)
        if lateness >= 1000:
            # PyFlink's allowed_lateness takes milliseconds: the same call here
            # would keep windows open 1000 times longer
            warnings.warn(errors.UnitWarning(
                f"allowed_lateness({seconds!r}) is in seconds ({lateness / 3600:g} h); PyFlink's takes "
                f"milliseconds: for {lateness / 1000:g} s pass allowed_lateness({lateness / 1000:g})"),
                stacklevel=2)
        if lateness and self.assigner.domain != "event":
            raise errors.ConfigurationError(
                f"allowed_lateness is for event-time windows: no record is late in {self.assigner!r} windows")
        self.lateness = lateness
        return self

    def trigger(self, trigger) -> "WindowedStream":
        """When the windows fire (Flink's ``WindowedStream.trigger``), the
        same as ``window(assigner, trigger=...)``: ``EventTimeTrigger()``,
        ``ContinuousEventTimeTrigger(s)``, ``CountTrigger(n)``,
        ``PurgingTrigger(t)``. Call it before ``reduce``, ``aggregate``,
        ``process`` or ``apply``; a later call replaces the trigger.

        Returns this ``WindowedStream``. Something that is not a trigger
        (or a trigger class instead of an instance) is a ``TypeError``; a
        trigger that does not fit the windows (another time domain, a count
        window) a ``ConfigurationError``.

        Example::

            every_3 = keyed.window(fb.Tumbling(10)).trigger(fb.CountTrigger(3)).aggregate(fb.Count())
        """
        self._trigger = _check_trigger(self.assigner, trigger)
        return self

    def side_output_late_data(self, tag) -> "WindowedStream":
        """PyFlink's spelling of ``late()``: the records too late for their
        windows go to the side output ``tag`` (an ``OutputTag``), read with
        ``get_side_output(tag)`` (or ``late()``) on the window's result.

        Returns this ``WindowedStream``; a ``tag`` that is not an
        ``OutputTag`` is a ``TypeError``, one named "late" (ours, for
        ``late()``) works as well.

        Example::

            late_tag = fb.OutputTag("late-data")
            res = keyed.window(fb.Tumbling(60)).side_output_late_data(late_tag).aggregate(fb.Count())
            late = res.get_side_output(late_tag)          # the same stream as res.late()
        """
        if not isinstance(tag, OutputTag):
            raise TypeError(f"side_output_late_data takes an OutputTag, got {type(tag).__name__}")
        self._late_tag = tag
        return self

    def apply(self, fn, *, parallelism=None, name: str = "window_apply", kind: Any = None) -> "WindowResult":
        """Flink's ``WindowedStream.apply``: ``fn(key, window, records)`` once
        per window firing, returning an iterable of outputs: the same as
        ``process``. ``fn`` may also be an object with an ``apply(key,
        window, records)`` method (PyFlink's ``WindowFunction``).

        Returns a ``WindowResult``; errors as for ``process``.

        Example::

            sizes = keyed.window(fb.Tumbling(60)).apply(lambda key, w, recs: [(key, w.start, len(recs))])
        """
        if not callable(fn) and callable(getattr(fn, "apply", None)):
            fn = fn.apply
        return self.process(fn, parallelism=parallelism, name=name, kind=kind)

    def _spec(self):
        return WindowSpec(self.assigner, self.keyed._key_fn, self.ts, self.lateness, self._trigger)

    def _node(self, how, fn, window_function, parallelism, name, kind, tags=None):
        kind = _check_kind(kind, f"window {name!r}")
        user_fn = fn if how == PROCESS else window_function
        base = 2 if self._all else 3
        with_ctx = user_fn is not None and takes_context(user_fn, base)
        if self._all:
            if parallelism not in (None, 1):
                raise errors.ConfigurationError(
                    f"window_all runs in one subtask (every record goes through it): parallelism={parallelism!r} "
                    "is not possible; key_by(...).window(...) spreads windows over subtasks")
            parallelism = 1
            if how == PROCESS:
                fn = _DropKey(fn)
            elif window_function is not None:
                window_function = _DropKey(window_function)
        spec = self._spec()
        op_class = window_operator_class(spec)
        node = self.keyed._then(name, lambda: op_class(name, spec, how, fn, window_function, with_ctx=with_ctx),
                                parallelism, kind)
        node.event_time = self.assigner.domain == "event"
        # a count window has no time to give its results (Flink's GlobalWindow
        # gives them the end of time): its stream carries no timestamps
        node.drops_timestamps = self.assigner.domain == "count"
        # late records leave through a side output, read when late() is taken
        node.side_tags = {LATE: LATE_TAG, **(tags or {})}
        node.window_late = True
        # a window_all runs in one subtask: set_parallelism may not change that
        node.single_subtask = self._all
        # declaring no tags, ctx.output reaches a tag side_output(tag) names
        # later (PyFlink's habit); declaring some, only those
        node.open_tags = with_ctx and not tags
        res = self.keyed._derive(node, window_result=True)
        res._ts = self.ts
        res._input_kind = self.keyed.node.kind
        res._late_tag = self._late_tag
        return res

    def reduce(self, fn: Callable, *, window_function: Callable | None = None, parallelism=None,
               name: str = "window_reduce", kind: Any = None) -> "WindowResult":
        """Per key and window, the records folded with ``fn(a, b)``; the output
        is the reduced record, or ``window_function(key, window, reduced)``
        (``window_function(key, window, reduced, ctx)`` gets the
        ``WindowContext``, whose ``firing`` says which kind of firing it is).

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
        ``window_function(key, window, result)`` (with a fourth argument it
        gets the ``WindowContext``). On an Arrow/pandas stream
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
            if self._all or self.assigner.domain != "event" or self._trigger is not None:
                raise errors.ConfigurationError(
                    "aggregate({column: ...}) (the vectorized path) takes keyed event-time windows with the "
                    f"default trigger; here: {'window_all, ' if self._all else ''}{self.assigner!r}"
                    f"{', trigger ' + repr(self._trigger) if self._trigger is not None else ''}")
            return self._arrow_node(agg, parallelism, name)
        _check_aggregate(agg, self.assigner.merging, self.keyed.node.kind)
        if window_function is not None:
            _callable(window_function, "window_function")
        return self._node(AGGREGATE, agg, window_function, parallelism, name, kind)

    def process(self, fn: Callable, *, side_outputs=None, parallelism=None, name: str = "window_process",
                kind: Any = None):
        """``fn(key, window, records) -> iterable of outputs`` once per window
        (and again per record arriving within the allowed lateness), or at
        each firing of the window's trigger.

        ``window`` is a ``TimeWindow`` (a ``RecordRange`` for ``CountWindow``),
        ``records`` a list of the window's records. A ``fn`` that takes a
        fourth argument gets a ``WindowContext``: ``ctx.firing`` says which
        kind of firing this is ("early", "on_time", "late", "partial"), and
        ``ctx.output(tag, value)`` emits to a side output declared in
        ``side_outputs`` (``res.side_output(tag)`` is its stream). The
        context also reaches ``window_function`` of ``reduce`` and
        ``aggregate`` when it takes one more argument. Returns a
        ``WindowResult``; a ``fn`` that is not callable is a ``TypeError``,
        one that cannot take those arguments a ``ConfigurationError``.

        Example::

            def median(key, window, records):
                values = sorted(r["latency"] for r in records)
                return [(key, window.start, values[len(values) // 2])]

            medians = keyed.window(fb.Tumbling(60)).process(median)
        """
        _callable(fn, "process")
        if self._all:
            _check_arity(fn, f"window_all process {name!r}", "fn(window, records) or fn(window, records, ctx)", 2, 3)
        else:
            _check_arity(fn, f"window process {name!r}",
                         "fn(key, window, records) or fn(key, window, records, ctx)", 3, 4)
        tags = declare_side_outputs(side_outputs, f"window process {name!r}", reserved=_RESERVED)
        return self._node(PROCESS, fn, None, parallelism, name, kind, tags)

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
        p = 1 if parallelism is None else parallelism
        # batches are not split by key: with one subtask it sees every row; with
        # more, each aggregates the batches it gets and one subtask combines
        # their partial results per window once its watermark (the minimum of
        # theirs) passes the window's end, when every partial result is in
        plain = self.keyed._derive(self.keyed.node)
        if p == 1:
            node = plain._then(name, lambda: ArrowWindowOperator(name, column_key, ts, assigner, aggs, lateness),
                               1, "arrow")
            node.event_time = True
            node.single_subtask = True      # its state holds every row: one subtask
            return plain._derive(node)
        if lateness:
            raise errors.ConfigurationError(
                "the vectorized window path takes allowed_lateness only with parallelism 1: its partial "
                "results are combined once per window")
        part = plain._then(f"{name}.partial", lambda: ArrowWindowOperator(
            f"{name}.partial", column_key, ts, assigner, aggs, 0.0, mode="partial"), p, "arrow")
        part.event_time = True
        node = plain._derive(part)._then(name, lambda: ArrowWindowOperator(
            name, column_key, ts, assigner, aggs, 0.0, mode="final"), 1, "arrow")
        node.event_time = True
        node.single_subtask = True          # combines every partial result: one subtask
        return plain._derive(node)


class AllWindowedStream(WindowedStream):
    """An unkeyed stream cut into windows (``Stream.window_all``): one
    subtask sees every record. Finish it with ``reduce``, ``aggregate`` or
    ``process``, whose functions take no key: ``process(fn(window, records
    [, ctx]))``, ``window_function(window, result[, ctx])``.

    Example::

        per_minute = timed.window_all(fb.Tumbling(60)).aggregate(
            fb.Count(), window_function=lambda w, n: (w.start, n))
    """

    _all = True

    def reduce(self, fn: Callable, *, window_function: Callable | None = None, parallelism=None,
               name: str = "window_all_reduce", kind: Any = None) -> "WindowResult":
        """Per window, the records folded with ``fn(a, b)``; the output is the
        reduced record, or ``window_function(window, reduced)``. Runs in one
        subtask: ``parallelism`` other than 1 is a ``ConfigurationError``.

        Example::

            largest = timed.window_all(fb.Tumbling(60)).reduce(max)
        """
        return super().reduce(fn, window_function=window_function, parallelism=parallelism, name=name,
                              kind=kind)

    def aggregate(self, agg, *, window_function: Callable | None = None, parallelism=None,
                  name: str = "window_all_aggregate", kind: Any = None) -> "WindowResult":
        """Per window, an AggregateFunction's ``get_result``, or
        ``window_function(window, result)``. Runs in one subtask:
        ``parallelism`` other than 1 is a ``ConfigurationError``.

        Example::

            totals = timed.window_all(fb.Tumbling(60)).aggregate(
                fb.Sum(lambda o: o["amount"]), window_function=lambda w, total: (w.start, total))
        """
        return super().aggregate(agg, window_function=window_function, parallelism=parallelism, name=name,
                                 kind=kind)

    def process(self, fn: Callable, *, side_outputs=None, parallelism=None, name: str = "window_all_process",
                kind: Any = None) -> "WindowResult":
        """``fn(window, records) -> iterable of outputs`` per firing (a third
        argument, if ``fn`` takes one, is the ``WindowContext``). Runs in one
        subtask: ``parallelism`` other than 1 is a ``ConfigurationError``.

        Example::

            top3 = timed.window_all(fb.Tumbling(60)).process(
                lambda w, recs: [(w.start, sorted(recs, key=lambda r: -r["score"])[:3])])
        """
        return super().process(fn, side_outputs=side_outputs, parallelism=parallelism, name=name, kind=kind)
