"""What ``KeyedStream.window()`` returns (``WindowedStream``) and the window
result stream with its ``late()`` side output."""
from __future__ import annotations

from typing import Any, Callable


from pyflowbuf import errors
from pyflowbuf._validation import _callable, _check_kind, _kind_identity
from pyflowbuf.api.stream import Stream
from pyflowbuf.runtime.graph import has_timestamps
from pyflowbuf.runtime.watermarks import check_seconds
from pyflowbuf.windows.aggregates import AggregateFunction, Sum, _identity
from pyflowbuf.windows.arrow import ArrowWindowOperator, check_arrow_spec
from pyflowbuf.windows.assigners import WindowAssigner
from pyflowbuf.windows.operator import AGGREGATE, PROCESS, REDUCE, TagSelect, WindowOperator, WindowSpec


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

def _carried(record):
    """The timestamp "function" of a stream whose times travel with its
    records: a job hands the operator the times, so only an operator run
    without them (an OperatorHarness) ever calls it."""
    raise errors.ConfigurationError(
        "this stream's timestamps travel with its records (assign_timestamps came before a map, flat_map, "
        "process, union or window), and this operator was fed records without their times: in an "
        "OperatorHarness, pass them with process(records, timestamps=[...])")


def _stream_timestamps(stream, what):
    """What an event-time operator reads a record's time with: the assigner's
    function or column, or (timestamps that travel with the records, as after
    a map or a window) a marker; a ConfigurationError on a stream without."""
    ts = getattr(stream.node, "timestamps", None)
    if ts is None and has_timestamps(stream.node):
        return _carried
    if ts is None:
        raise errors.ConfigurationError(
            f"{what} works in event time, and the stream {stream.node.name!r} has no timestamps: call "
            "assign_timestamps(fn, out_of_orderness=...) on it, or on a stream it comes from (timestamps "
            "travel through map, filter, flat_map, process, union, connect, key_by, windows and joins; "
            "a source has none, and a union or connect has them only when all its inputs do)")
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


