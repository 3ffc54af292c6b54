"""The stream classes: ``Stream``, ``KeyedStream``, ``ConnectedStreams`` and
``WindowResult`` (the stream of a window's results)."""
from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from pyflowbuf._validation import (_callable, _check_arity, _check_kind, _common_kind, _job_name, _parallelism,
                                   _positive_int, note_key_function)
from pyflowbuf.api.joined import IntervalJoin, JoinedStreams
from pyflowbuf.api.side_outputs import LATE_TAG, declare_side_outputs, declared_tag
from pyflowbuf.api.connectors import ConnectorSinkDeclarations
from pyflowbuf.api.sinks import SinkDeclarations
from pyflowbuf.api.windowed import AllWindowedStream, WindowedStream, _no_key
from pyflowbuf.errors import ConfigurationError, RecordTypeError, UnitWarning
from pyflowbuf.operators import basic as ops
from pyflowbuf.jobgraph.graph import Input, Node, carried_timestamps, set_uid
from pyflowbuf.operators.keyed import KeyedReduce
from pyflowbuf.time.process import (CoProcess, KeyedCoProcess, KeyedCoProcessOperator, KeyedProcess,
                                    KeyedProcessFunction, KeyedProcessOperator, ProcessOperator,
                                    plain_process_function_parts, process_function_parts, takes_context)
from pyflowbuf.time.watermarks import UNITS, TimestampsAssigner, check_seconds, in_unit
from pyflowbuf.serializers import get_serializer, short_repr
from pyflowbuf.windows.assigners import CountWindow


class Stream(SinkDeclarations, ConnectorSinkDeclarations):
    """A stream of records produced by one node of the graph.

    Streams are declared, not run: each method adds an operator to the
    Environment's graph and returns the stream of its output;
    ``env.execute()`` runs the whole graph.

    Example::

        doubled = env.from_sequence(0, 10).map(lambda x: 2 * x, name="double")
    """

    _keyed = False      # a KeyedStream's is True (joined.py asks it, not isinstance)

    def __init__(self, env, node: Node, key_fn: Callable | None = None):
        self.env = env
        self.node = node
        self._partitioner = None  # None: forward when parallelism matches, else rebalance
        self._key_fn = key_fn

    def _input_to(self, parallelism: int) -> Input:
        """How this stream feeds an operator of ``parallelism``: the partitioner
        set on it, else forward when the parallelism matches, else rebalance."""
        part = self._partitioner or ("forward" if parallelism == self.node.parallelism else "rebalance")
        inp = Input(self.node, part, self._key_fn)
        # set_parallelism may change the parallelism later: a partitioner
        # chosen by it is chosen again then
        inp.by_default = self._partitioner is None
        return inp

    def _derive(self, node: Node, window_result: bool = False) -> "Stream":
        # windowed.py and joined.py make their streams here: they do not import this module
        return (WindowResult if window_result else Stream)(self.env, node)

    def _then(self, name, make_operator, parallelism, kind, *, sink=False) -> Node:
        p = _parallelism(self.env.parallelism, parallelism)
        return self.env._add(name=name, parallelism=p, make_operator=make_operator,
                             inputs=[self._input_to(p)], kind=kind, is_sink=sink)

    def uid(self, uid: str) -> "Stream":
        """Give the operator that makes this stream a stable id: checkpoints
        and savepoints store its state under it, and a restore gives the
        state back to the operator with that id, whatever else changed in
        the job (operators added, removed, renamed, chained differently).
        Without one, the id is derived from the operator's place in the
        graph (its type, its inputs' ids, its rank among operators of its
        type reading them: docs/checkpoints.md), which an operator inserted
        or removed before it changes. Returns this stream.

        Example::

            counts = words.key_by(lambda w: w).reduce(add).uid("word-counts")
        """
        set_uid(self.env.nodes, self.node, uid)
        return self

    def migrate_keys(self, fn: Callable) -> "Stream":
        """Declare that the keyed operator making this stream keys its state
        differently from the job whose checkpoint it restores: each stored
        key ``k`` becomes ``fn(k)`` (the key the new key function computes
        for the same records), and its state moves to that key's group.
        Without it, a restore whose operator computes keys of another kind
        (``str(x % 10)`` where the state holds ``x % 10``) fails with
        ``KeyKindError`` at its first key. A checkpoint taken after the
        migration holds the new keys, so keeping the call in the job is
        harmless: it applies only to state written without it. Two stored
        keys that ``fn`` makes one are refused. Returns this stream.

        Example::

            counts = (nums.key_by(lambda x: str(x % 10)).reduce(add)
                          .uid("counts").migrate_keys(str))
        """
        _callable(fn, "migrate_keys")
        make = self.node.make_operator
        if make is None or not getattr(make(), "keyed_state", False):
            raise ConfigurationError(
                f"migrate_keys: operator {self.node.name!r} keeps no keyed state; call it on the stream a "
                "keyed operator makes (key_by(...).reduce(...), .process(...), a window's aggregate)")
        self.node.key_migration = fn
        return self

    def name(self, name: str) -> "Stream":
        """Rename the operator that makes this stream (PyFlink's
        ``.name()``; ours is also the ``name=`` of each declaration): the name
        shows in task names, metrics and errors. Returns this stream.

        A ``name`` that is not a non-empty str is a ``ConfigurationError``,
        and so is a call on a ``key_by``/``rebalance()``/... stream (no
        operator of its own).

        Example::

            counts = keyed.window(fb.Tumbling(60)).aggregate(fb.Count()).name("per-minute")
        """
        _job_name("name", name)
        self._operator_itself("name")
        node = self.node
        node.name = name
        make = node.make_operator
        if make is not None:
            node.make_operator = _Renamed(make, name)
        return self

    def set_parallelism(self, parallelism: int) -> "Stream":
        """Run the operator that makes this stream in ``parallelism``
        subtasks (PyFlink's ``.set_parallelism()``; ours is also the
        ``parallelism=`` of each declaration). Call it before the stream is
        used by another operator or sink. Returns this stream.

        A ``parallelism`` that is not an int >= 1 is a ``ConfigurationError``,
        and so is a call on a ``key_by``/``rebalance()``/... stream, on a source (give the source ``parallelism=``), on
        an operator that runs in one subtask (``window_all``) with another
        number, or on a stream already used (its consumers were planned for
        the parallelism it had).

        Example::

            sums = keyed.window(fb.Tumbling(60)).reduce(lambda a, b: a + b).set_parallelism(4)
        """
        _positive_int("parallelism", parallelism)
        self._operator_itself("set_parallelism")
        node = self.node
        if not node.inputs:
            raise ConfigurationError(
                f"set_parallelism on the source {node.name!r}: a source's subtasks are fixed where it is "
                "declared: pass parallelism= to it (e.g. env.from_sequence(0, 100, parallelism=4))")
        if node.single_subtask and parallelism != 1:
            raise ConfigurationError(
                f"set_parallelism({parallelism}) on {node.name!r}: this operator runs in one subtask (a "
                "window_all, or the vectorized window's combining step); key_by(...).window(...) spreads "
                "windows over subtasks")
        if node.consumers:
            used = ", ".join(repr(c.name) for c in node.consumers)
            raise ConfigurationError(
                f"set_parallelism on {node.name!r} after its stream was used (by {used}): call it right "
                f"after the operator, before using the stream, or pass parallelism= to the operator")
        for inp in node.inputs:
            if getattr(inp, "by_default", False):
                inp.partitioner = "forward" if inp.node.parallelism == parallelism else "rebalance"
        node.parallelism = parallelism
        return self

    def _operator_itself(self, what):
        if self._partitioner is not None:
            how = "key_by" if self._partitioner == "hash" else f"{self._partitioner}()"
            raise ConfigurationError(
                f"{what}() on a {how} stream: {how} says how records reach the next operator and is no "
                f"operator itself (PyFlink refuses it too); call {what}() on the operator before it, "
                f"or on the one after it")

    # ---- partitioning ----
    def _with(self, partitioner, key_fn=None) -> "Stream":
        s = Stream(self.env, self.node, key_fn)
        s._partitioner = partitioner
        return s

    def forward(self) -> "Stream":
        """Send each record to the subtask of the same index in the next operator
        (no exchange across subtasks; chained when possible). The next operator
        must have the same parallelism: otherwise ``execute()`` (and ``plan()``)
        raise ``ValueError``. Returns a ``Stream`` to declare that operator on.

        Example::

            s.forward().map(fn)        # same parallelism as s
        """
        return self._with("forward")

    def rebalance(self) -> "Stream":
        """Spread the records over the next operator's subtasks round-robin, to
        even out skewed subtasks or change parallelism. Returns a ``Stream``.

        Example::

            s.rebalance().map(expensive, parallelism=8)
        """
        return self._with("rebalance")

    def broadcast(self) -> "Stream":
        """Send every record to every subtask of the next operator. Returns a
        ``Stream``.

        Example::

            rules.broadcast().connect(events).process(on_rule, on_event)
        """
        return self._with("broadcast")

    def key_by(self, key_fn: Callable) -> "KeyedStream":
        """Partition by ``key_fn(record)``: records with equal keys reach the same
        subtask (a stable hash, the same in every process), where keyed
        operators keep per-key state.

        ``key_fn`` may be a column name (a str) only on a stream of Arrow or
        pandas batches, for the vectorized windows. Returns a ``KeyedStream``.
        A ``key_fn`` that is not callable (or a column name on another stream)
        is a ``TypeError``.

        Example::

            totals = orders.key_by(lambda o: o["customer"]).reduce(
                lambda a, b: {**a, "amount": a["amount"] + b["amount"]})
        """
        if isinstance(key_fn, str):
            return _key_by_column(self, key_fn)
        if not callable(key_fn):
            raise TypeError("key_by takes a function record -> key")
        note_key_function(self.env._salted_key_functions, key_fn, f"key_by after {self.node.name!r}")
        ks = KeyedStream(self.env, self.node, key_fn)
        ks._partitioner = "hash"
        return ks

    # ---- event time ----
    def assign_timestamps(self, fn: Callable | str, out_of_orderness: float = 0.0,
                          idle_timeout: float | None = None, *, watermark_interval: float = 0.2,
                          unit: str = "s", parallelism: int | None = None,
                          name: str = "timestamps") -> "Stream":
        """Event time for this stream: ``fn(record)`` is a record's timestamp in
        seconds (a float or int; a datetime is converted), or in ``unit``
        ("ms", "us", "ns" since 1970) when given; timestamps that look like
        milliseconds while read as seconds warn once (``UnitWarning``), and a
        NaN timestamp is an ``InvalidTimestampError``. Watermarks follow
        the records: the highest timestamp seen minus ``out_of_orderness``,
        sent every ``watermark_interval`` seconds (Flink's 200 ms; 0: after
        every batch). A subtask that gets no records for ``idle_timeout``
        seconds is marked idle, so it does not hold back the watermark of
        the tasks it feeds. On an Arrow/pandas stream ``fn`` may be a column
        name. See ``pyflowbuf.windows``.

        The timestamps then travel with the records through map, filter,
        flat_map, process, union, connect, key_by and windows (see
        docs/event-time.md). Right after a source (same parallelism) the
        assigner runs in the source's task, even with ``chaining=False``.

        Returns a ``Stream`` with timestamps (the same records). Bad durations
        or ``unit`` are a ``ConfigurationError``, a ``fn`` that is not callable
        a ``TypeError``.

        Example::

            timed = events.assign_timestamps(lambda e: e["ts"], out_of_orderness=2.0, idle_timeout=30)
            in_ms = events.assign_timestamps(lambda e: e["ts_ms"], unit="ms")
        """

        if not isinstance(fn, str):
            _callable(fn, "assign_timestamps")
        if not isinstance(unit, str) or unit not in UNITS:
            raise ConfigurationError(f"unit must be one of {', '.join(map(repr, UNITS))}, got {unit!r}")
        if unit != "s":
            if isinstance(fn, str):
                raise ConfigurationError(
                    f"unit={unit!r} applies to a timestamp function; the column {fn!r} is read as seconds, "
                    "or as an Arrow timestamp column, whose type carries its unit (pa.timestamp('ms'))")
            fn = in_unit(fn, unit)
        ooo = check_seconds("out_of_orderness", out_of_orderness)
        idle = check_seconds("idle_timeout", idle_timeout, optional=True, positive=True)
        interval = check_seconds("watermark_interval", watermark_interval)
        if interval >= 60:
            warnings.warn(UnitWarning(
                f"assign_timestamps {name!r}: watermark_interval={watermark_interval!r} is in seconds; "
                f"values this large are usually milliseconds: for {interval / 1000:g} s pass "
                f"watermark_interval={interval / 1000:g}"), stacklevel=2)
        shared: dict = {}
        node = self._then(name, lambda: TimestampsAssigner(name, fn, ooo, idle, interval, unit, shared),
                          parallelism, self.node.kind)
        node.timestamps = fn
        node.assigns_timestamps = True      # chained to a source it follows (runtime.graph.plan)
        node.event_time = True
        return Stream(self.env, node)

    # ---- operators ----
    def map(self, fn: Callable, *, parallelism: int | None = None, name: str = "map", kind: Any = None) -> "Stream":
        """One output record ``fn(record)`` per input record.

        ``kind`` declares the output record kind (None: inferred from the first
        output); ``parallelism`` defaults to the Environment's. Returns a
        ``Stream``. A ``fn`` that is not callable is a ``TypeError``, a bad
        ``kind`` a ``ConfigurationError``; an output that does not fit the kind
        fails the job with ``RecordTypeError`` naming the operator.

        Example::

            lengths = words.map(len, kind="int64")
            pairs = words.map(lambda w: (w, 1), name="pair")
        """
        _callable(fn, "map")
        kind = _check_kind(kind, f"map {name!r}")
        return Stream(self.env, self._then(name, lambda: ops.Map(name, fn), parallelism, kind))

    def filter(self, fn: Callable, *, parallelism: int | None = None, name: str = "filter") -> "Stream":
        """The records for which ``fn(record)`` is true, unchanged (they keep
        their kind and their timestamps). Returns a ``Stream``. A ``fn`` that is
        not callable is a ``TypeError``.

        Example::

            errors_only = lines.filter(lambda line: line.startswith("ERROR"))
        """
        _callable(fn, "filter")
        node = self._then(name, lambda: ops.Filter(name, fn), parallelism, self.node.kind)
        node.timestamps = self.node.timestamps    # the records stay as they were
        return Stream(self.env, node)

    def flat_map(self, fn: Callable, *, parallelism: int | None = None, name: str = "flat_map",
                 kind: Any = None) -> "Stream":
        """Zero or more output records per input record: ``fn(record)`` returns an
        iterable of them (a list, a generator, a set).

        A str, bytes, tuple, dict or None returned by ``fn`` is never taken
        apart: the job fails with ``RecordTypeError`` (return ``[record]`` for
        one record). ``kind`` as for ``map``. Returns a ``Stream``. A ``fn`` that
        is not callable is a ``TypeError``.

        Example::

            words = lines.flat_map(str.split)
            pairs = lines.flat_map(lambda line: [(w, 1) for w in line.split()])
        """
        _callable(fn, "flat_map")
        kind = _check_kind(kind, f"flat_map {name!r}")
        return Stream(self.env, self._then(name, lambda: ops.FlatMap(name, fn), parallelism, kind))

    def map_batches(self, fn: Callable, *, parallelism: int | None = None, name: str = "map_batches",
                    kind: Any = None) -> "Stream":
        """Apply ``fn`` to whole batches: to NumPy array chunks on a rows stream
        (``from_arrays``), to each RecordBatch/DataFrame on an arrow/pandas stream.

        ``fn`` returns the output batch (an array chunk, a RecordBatch or a
        DataFrame). On a rows stream the output keeps the input's dtype unless
        ``kind`` says otherwise. Returns a ``Stream``. A ``fn`` that is not
        callable is a ``TypeError``.

        Example::

            scaled = rows.map_batches(lambda chunk: chunk * 2)             # a rows stream
            big = batches.map_batches(lambda df: df[df["amount"] > 100])   # pandas batches
        """
        _callable(fn, "map_batches")
        kind = _check_kind(kind, f"map_batches {name!r}")
        per_record = not isinstance(self.node.kind, np.dtype)
        if kind is None and not per_record:
            kind = self.node.kind
        return Stream(self.env, self._then(name, lambda: ops.MapBatch(name, fn, per_record), parallelism, kind))

    def process(self, fn: Callable, *, side_outputs=None, parallelism: int | None = None,
                name: str = "process", kind: Any = None) -> "Stream":
        """``fn(record, ctx) -> iterable of outputs (or None)`` per record, on
        any stream (Flink's ProcessFunction; ``KeyedStream.process`` adds
        per-key state and timers).

        ``ctx.output(tag, value)`` emits ``value`` to the side output
        ``tag``, an ``OutputTag`` declared in ``side_outputs`` (or, with
        none declared, any tag ``side_output(tag)`` asks for); take its
        stream with ``side_output(tag)``. ``ctx.timestamp`` is the record's
        event time when the stream has timestamps, ``ctx.watermark`` the
        operator's watermark. ``kind`` declares the main output's kind.
        ``fn`` may also be an object with PyFlink's ProcessFunction methods:
        ``process_element(value, ctx)``, and ``open(runtime_context)`` /
        ``close()`` if it has them, their signatures checked here.

        Returns a ``Stream``. A ``fn`` that is not callable, or
        ``side_outputs`` that are not OutputTags, is a ``TypeError``; a
        ``fn`` that cannot take (record, ctx), or two tags of one name and
        different kinds, a ``ConfigurationError``, all raised here.
        ``ctx.output`` to an undeclared tag fails the job with
        ``ConfigurationError``.

        Example::

            bad = fb.OutputTag("bad", kind="str")

            def parse(line, ctx):
                try:
                    yield int(line)
                except ValueError:
                    ctx.output(bad, line)

            numbers = lines.process(parse, side_outputs=[bad])
            rejects = numbers.side_output(bad)
        """
        opener = closer = None
        if isinstance(fn, type) and callable(getattr(fn, "process_element", None)):
            raise TypeError(f"process takes a process function instance: {fn.__name__}() (with parentheses), "
                            f"not the class {fn.__name__}")
        if not callable(fn) and callable(getattr(fn, "process_element", None)):
            # PyFlink's ProcessFunction: process_element(value, ctx), open, close
            fn, opener, closer = plain_process_function_parts(fn, f"process {name!r}", name)
        else:
            _callable(fn, "process")
            _check_arity(fn, f"process {name!r}", "fn(record, ctx)", 2)
        tags = declare_side_outputs(side_outputs, f"process {name!r}")
        kind = _check_kind(kind, f"process {name!r}")
        ts_fn = _timestamp_fn(self.node)
        if isinstance(ts_fn, str):
            ts_fn = None
        node = self._then(name, lambda: ProcessOperator(name, fn, ts_fn, opener, closer), parallelism, kind)
        node.side_tags = tags
        # declaring no tags, side_output(tag) may name any (PyFlink's habit); declaring some, only those
        node.open_tags = not tags
        return Stream(self.env, node)

    def side_output(self, tag, *, name: str | None = None) -> "Stream":
        """The stream of the records this stream's operator emitted to the
        side output ``tag`` (``ctx.output(tag, value)``), of the tag's kind.
        They travel as any output does (checkpointed, exactly once, across
        workers). It may be taken before or after the main stream is used;
        taking it again returns the same stream.

        Returns a ``Stream``. A ``tag`` that is not an ``OutputTag`` is a
        ``TypeError``; a tag the operator did not declare
        (``side_outputs=``), one declared with another kind, or a stream
        whose operator cannot emit side outputs (anything but a process
        function) is a ``ConfigurationError``.

        Example::

            errors = fb.OutputTag("errors")
            parsed = lines.process(parse, side_outputs=[errors])
            parsed.side_output(errors).write_text("rejected")
        """
        late = getattr(self, "_late_tag", None)
        if late is not None and tag == late:        # side_output_late_data(tag)
            return self.late()
        tag = declared_tag(self.node, tag, "side_output")
        return _side_stream(self, tag, name or f"{self.node.name}.{tag.name}", tag.kind)

    def get_side_output(self, tag, *, name: str | None = None) -> "Stream":
        """PyFlink's spelling of ``side_output(tag)``: the stream of the
        records this stream's operator emitted to ``tag``. As in PyFlink, a
        process function's tags need no declaring beforehand: the tags
        asked for here are the ones its ``ctx.output`` may reach. Returns a
        ``Stream``; errors as for ``side_output``.

        Example::

            odd = fb.OutputTag("odd", kind="int64")

            def split(x, ctx):
                if x % 2:
                    ctx.output(odd, x)
                else:
                    yield x

            evens = env.from_sequence(0, 10).process(split)
            odds = evens.get_side_output(odd)
        """
        return self.side_output(tag, name=name)

    # ---- several inputs ----
    def union(self, *others: "Stream", parallelism: int | None = None, name: str = "union") -> "Stream":
        """The records of this stream and of ``others``, in arrival order.

        Every stream must belong to this Environment, and the kinds the streams
        declare (or that their sources fixed) must agree: the union carries
        that kind. Each input is partitioned as its stream says (forward when
        the parallelism matches, else rebalance, or what key_by / rebalance /
        broadcast set on it). The union is a task of its own, reading one gate
        per input; the operators after it chain to it.

        Returns a ``Stream``. A stream of another Environment or of another kind
        is a ``ConfigurationError``, something that is not a Stream a
        ``TypeError``.

        Example::

            everything = clicks.union(views, purchases)
        """
        streams = (self,) + others
        for s in others:
            _same_env(self.env, s, "union")
        kind = _common_kind(streams, f"union {name!r}")
        p = _parallelism(self.env.parallelism, parallelism)
        node = self.env._add(name=name, parallelism=p, make_operator=lambda: ops.Union(name),
                             inputs=[s._input_to(p) for s in streams], kind=kind)
        return Stream(self.env, node)

    def window_all(self, assigner, trigger=None) -> "Any":
        """Windows over the whole stream, without a key (Flink's windowAll):
        any assigner and trigger of ``KeyedStream.window``; then
        ``.reduce``, ``.aggregate`` or ``.process``, whose functions take no
        key (``process(fn(window, records))``).

        Note: the window operator has parallelism 1 — every record of the
        stream goes through one subtask, which caps the throughput of this
        step at what one thread can do. Pre-aggregate upstream (``key_by``
        then ``window``) when the stream is large.

        Returns an ``AllWindowedStream``; errors as for
        ``KeyedStream.window``, and a ``parallelism`` other than 1 on its
        ``reduce``/``aggregate``/``process`` is a ``ConfigurationError``.

        Example::

            per_minute = timed.window_all(fb.Tumbling(60)).aggregate(
                fb.Count(), window_function=lambda w, n: (w.start, n))
        """
        # no hash exchange: every record goes to the single subtask (forward
        # from a single upstream subtask, else rebalance into one)
        return AllWindowedStream(KeyedStream(self.env, self.node, _no_key), assigner, trigger)

    def join(self, other: "Stream"):
        """A window join: ``a.join(b).where(key_a).equal_to(key_b)
        .window(Tumbling(5)).apply(fn(left, right))``, one output per pair
        of records with equal keys in the same window (Flink's join).

        Returns a ``JoinedStreams`` to finish with ``where``, ``equal_to``,
        ``window`` and ``apply``. Both streams need timestamps. A stream of
        another Environment is a ``ConfigurationError``.

        Example::

            pairs = (orders.join(payments)
                           .where(lambda o: o["id"]).equal_to(lambda p: p["order"])
                           .window(fb.Tumbling(60))
                           .apply(lambda o, p: (o["id"], p["amount"])))
        """
        _same_env(self.env, other, "join")
        return JoinedStreams(self, other)

    def connect(self, other: "Stream") -> "ConnectedStreams":
        """Two streams read by one operator with a function per input
        (``.process(fn1, fn2)``, ``.map(fn1, fn2)``); the inputs may carry
        different kinds. Connect two KeyedStreams for per-key state that both
        inputs share.

        Returns ``ConnectedStreams``. A stream of another Environment is a
        ``ConfigurationError``.

        Example::

            out = commands.connect(readings).map(lambda c: ("cmd", c), lambda r: ("reading", r))
        """
        _same_env(self.env, other, "connect")
        return ConnectedStreams(self, other)


class KeyedStream(Stream):
    """A stream partitioned by key; keyed operators keep per-key state in their task.

    Made by ``Stream.key_by``; besides the ``Stream`` methods it has the
    keyed operators ``reduce``, ``process``, ``window`` and
    ``interval_join``.

    Example::

        keyed = words.key_by(lambda w: w)
    """

    _keyed = True

    def reduce(self, fn: Callable, *, parallelism: int | None = None, name: str = "reduce",
               kind: Any = None) -> Stream:
        """A rolling reduce per key: each record is folded into its key's value
        with ``fn(previous, record)``, and every updated value is emitted (the
        first record of a key as it is).

        ``kind`` declares the output kind. The per-key values live in the task
        and go into checkpoints. Returns a ``Stream``. A ``fn`` that is not
        callable is a ``TypeError``.

        Example::

            counts = (words.map(lambda w: (w, 1))
                           .key_by(lambda kv: kv[0])
                           .reduce(lambda a, b: (a[0], a[1] + b[1])))
            # "a", "b", "a" -> ("a", 1), ("b", 1), ("a", 2)
        """
        _callable(fn, "reduce")
        kind = _check_kind(kind, f"reduce {name!r}")
        key_fn = self._key_fn
        node = self._then(name, lambda: KeyedReduce(name, key_fn, fn), parallelism, kind)
        return Stream(self.env, node)

    def process(self, fn: Callable, *, on_timer: Callable | None = None, on_end: Callable | None = None,
                side_outputs=None, parallelism: int | None = None, name: str = "process",
                kind: Any = None) -> Stream:
        """``fn(key, record, state_dict) -> iterable of outputs (or None)``.

        A ``fn`` that takes a fourth argument gets a context
        (``pyflowbuf.time.process.Context``): ``ctx.timestamp`` (the
        record's event time), ``ctx.watermark``,
        ``ctx.register_event_time_timer(t)``,
        ``ctx.register_processing_time_timer(t)``. On a stream with
        timestamps, the records a call returns carry ``ctx.timestamp``
        (the input's time unless the function set another). Timers call
        ``on_timer(key, t, state, ctx)``; they are per key, deduplicated, fire
        in time order in the task's thread, and go into checkpoints. At end of
        input every event-time timer fires (the watermark goes to +inf), then
        ``on_end(key, state, ctx)`` runs for every key with state. ``fn`` may
        also be a ``KeyedProcessFunction`` (process_element, on_timer, on_end).
        ``ctx.output(tag, value)`` (in all three) emits to a side output
        declared in ``side_outputs`` (``OutputTag``s): ``side_output(tag)``
        is its stream.

        Returns a ``Stream``. A function that cannot take the arguments it will
        be called with is a ``ConfigurationError``, one that is not callable a
        ``TypeError``, both raised here.

        Example::

            def count(key, record, state):
                state["n"] = state.get("n", 0) + 1
                return [(key, state["n"])]

            def alarm(key, record, state, ctx):
                ctx.register_event_time_timer(ctx.timestamp + 60)    # seconds

            counts = events.key_by(lambda e: e["user"]).process(count)
            alarms = timed.key_by(lambda e: e["user"]).process(
                alarm, on_timer=lambda key, t, state, ctx: [(key, t)])
        """

        if isinstance(fn, type) and issubclass(fn, KeyedProcessFunction):
            raise TypeError(f"process takes a KeyedProcessFunction instance: {fn.__name__}() (with parentheses), "
                            f"not the class {fn.__name__}")
        is_class = isinstance(fn, KeyedProcessFunction) or (
            not callable(fn) and callable(getattr(fn, "process_element", None)))
        if is_class:
            # its methods' signatures, checked here rather than at the first record
            process_function_parts(fn, f"process {name!r}", name)
        else:
            _callable(fn, "process")
            _check_arity(fn, f"process {name!r}", "fn(key, record, state) or fn(key, record, state, ctx)", 3, 4)
        if on_timer is not None:
            _callable(on_timer, "process on_timer")
            _check_arity(on_timer, f"process {name!r} on_timer", "on_timer(key, t, state, ctx)", 4)
        if on_end is not None:
            _callable(on_end, "process on_end")
            _check_arity(on_end, f"process {name!r} on_end", "on_end(key, state, ctx)", 3)
        kind = _check_kind(kind, f"process {name!r}")
        tags = declare_side_outputs(side_outputs, f"process {name!r}")
        key_fn = self._key_fn
        with_ctx = is_class or takes_context(fn, 3)
        if tags and not (with_ctx or on_timer or on_end):
            raise ConfigurationError(
                f"process {name!r} declares side outputs, but its function takes no ctx to emit to them: "
                "fn(key, record, state, ctx), then ctx.output(tag, value)")
        if not (with_ctx or on_timer or on_end):
            node = self._then(name, lambda: KeyedProcess(name, key_fn, fn), parallelism, kind)
            node.side_tags = tags
            return Stream(self.env, node)
        ts_fn = _timestamp_fn(self.node)
        if isinstance(ts_fn, str):
            ts_fn = None
        node = self._then(name, lambda: KeyedProcessOperator(name, key_fn, ts_fn, fn, on_timer, on_end,
                                                             with_ctx), parallelism, kind)
        node.event_time = True
        node.side_tags = tags
        # declaring no tags, side_output(tag) may name any (PyFlink's habit); declaring some, only those
        node.open_tags = not tags
        return Stream(self.env, node)

    # ---- PyFlink's rolling aggregations ----
    def _aggregate_field(self, how, field, name):
        if isinstance(field, bool) or not isinstance(field, (int, str)):
            raise TypeError(f"{how} takes a field position (an int) or a field name (a str) of the records, "
                            f"got {field!r}")
        return self.reduce(_FieldAggregate(how, field), name=name or how)

    def sum(self, position_to_sum: int | str = 0, *, name: str | None = None) -> Stream:
        """A rolling sum per key of one field (PyFlink's ``KeyedStream.sum``):
        each record's field is added to its key's running value, and the
        key's first record, with that field replaced by the sum, is emitted
        for every input. The field is a position (tuples, lists, named
        tuples), a name (dicts, named tuples), or 0 for records that are
        numbers themselves.

        Returns a ``Stream``. A field that is neither int nor str is a
        ``TypeError``; a record without the field fails the job with a
        ``RecordTypeError`` naming it.

        Example::

            totals = pairs.key_by(lambda p: p[0]).sum(1)      # ("a", 1), ("a", 2) -> ("a", 1), ("a", 3)
        """
        return self._aggregate_field("sum", position_to_sum, name)

    def min(self, position_to_min: int | str = 0, *, name: str | None = None) -> Stream:
        """A rolling minimum per key of one field (PyFlink's
        ``KeyedStream.min``): the key's first record with that field replaced
        by the smallest value seen. Fields as for ``sum``; ``min_by`` gives
        the whole record that holds the minimum instead.

        Example::

            lowest = pairs.key_by(lambda p: p[0]).min(1)
        """
        return self._aggregate_field("min", position_to_min, name)

    def max(self, position_to_max: int | str = 0, *, name: str | None = None) -> Stream:
        """A rolling maximum per key of one field (PyFlink's
        ``KeyedStream.max``): the key's first record with that field replaced
        by the largest value seen. Fields as for ``sum``.

        Example::

            highest = pairs.key_by(lambda p: p[0]).max(1)
        """
        return self._aggregate_field("max", position_to_max, name)

    def min_by(self, position_to_min_by: int | str = 0, *, name: str | None = None) -> Stream:
        """Per key, the record with the smallest value of one field so far
        (the first one on ties), emitted for every input (PyFlink's
        ``KeyedStream.min_by``). Fields as for ``sum``.

        Example::

            cheapest = orders.key_by(lambda o: o["item"]).min_by("price")
        """
        return self._aggregate_field("min_by", position_to_min_by, name)

    def max_by(self, position_to_max_by: int | str = 0, *, name: str | None = None) -> Stream:
        """Per key, the record with the largest value of one field so far
        (the first one on ties), emitted for every input (PyFlink's
        ``KeyedStream.max_by``). Fields as for ``sum``.

        Example::

            biggest = orders.key_by(lambda o: o["item"]).max_by("price")
        """
        return self._aggregate_field("max_by", position_to_max_by, name)

    def count_window(self, size: int, slide: int = 0) -> "Any":
        """Windows of ``size`` records per key (PyFlink's
        ``KeyedStream.count_window``): ``window(CountWindow(size))``, or with
        a ``slide`` (0: none), ``window(CountWindow(size, slide))``. Returns
        a ``WindowedStream``; a size or slide that is not an int >= 1 (slide
        >= 0) is a ``ConfigurationError``.

        Example::

            per_10 = keyed.count_window(10).aggregate(fb.Count())
        """
        return self.window(CountWindow(size, None if slide == 0 else slide))

    def window(self, assigner, trigger=None) -> "Any":
        """Windows per key: event time (``Tumbling(size)``, ``Sliding(size,
        slide)``, ``Session(gap)``), processing time
        (``TumblingProcessingTime``, ``SlidingProcessingTime``,
        ``SessionProcessingTime``) or counts (``CountWindow(size, slide)``);
        then ``.reduce``, ``.aggregate`` or ``.process``
        (``allowed_lateness(s)`` first, if wanted). Event-time windows need
        timestamps (``assign_timestamps``). ``trigger`` says when windows
        fire: ``EventTimeTrigger()`` (the default),
        ``ContinuousEventTimeTrigger(s)`` (early firings), ``CountTrigger(n)``,
        ``PurgingTrigger(t)``. See ``pyflowbuf.windows``.

        Returns a ``WindowedStream``. An ``assigner`` or ``trigger`` that is
        not one of those is a ``TypeError``; an event-time window on a stream
        without timestamps, or a trigger that does not fit the windows, a
        ``ConfigurationError``.

        Example::

            per_minute = (timed.key_by(lambda e: e["page"])
                               .window(fb.Tumbling(60))
                               .aggregate(fb.Count(), window_function=lambda page, w, n: (page, w.start, n)))
            early = timed.key_by(lambda e: e["page"]).window(
                fb.Tumbling(3600), trigger=fb.ContinuousEventTimeTrigger(60)).aggregate(fb.Count())
        """
        return WindowedStream(self, assigner, trigger)

    def interval_join(self, other: "KeyedStream", lower: float | None = None, upper: float | None = None):
        """Join each record of this stream with the records of ``other`` of
        the same key whose time lies in [t + lower, t + upper]:
        ``a.interval_join(b).between(lower, upper).process(fn)``, or
        ``a.interval_join(b, lower, upper).process(fn)``.

        ``lower`` and ``upper`` are seconds of event time (finite, ``lower <=
        upper``, either sign). Returns an ``IntervalJoin`` (finish it with
        ``process``). Streams that are not both keyed are a
        ``ConfigurationError``.

        Example::

            matched = (clicks.key_by(lambda c: c["ad"])
                             .interval_join(views.key_by(lambda v: v["ad"]), -5.0, 0.0)
                             .process(lambda click, view: [(click["ad"], view["ts"], click["ts"])]))
        """
        join = IntervalJoin(self, other)
        return join if lower is None and upper is None else join.between(lower, upper)


class ConnectedStreams:
    """Two streams connected for one operator with two inputs (``Stream.connect``).

    ``fn1`` handles the records of the first stream, ``fn2`` those of the
    second. When both streams are keyed (``a.key_by(k1).connect(b.key_by(k2))``)
    both are hash partitioned with the same stable hash, so records with equal
    keys from either side reach the same subtask and share its per-key state.

    Example::

        a = orders.key_by(lambda o: o["id"])
        b = payments.key_by(lambda p: p["order"])
        both = a.connect(b)
    """

    def __init__(self, first: Stream, second: Stream):
        self.env = first.env
        self.first = first
        self.second = second

    @property
    def keyed(self) -> bool:
        """Whether both connected streams are keyed (``key_by``), so the inputs
        share per-key state.

        Example::

            assert orders.key_by(k1).connect(payments.key_by(k2)).keyed
        """
        return isinstance(self.first, KeyedStream) and isinstance(self.second, KeyedStream)

    def _node(self, name, make_operator, parallelism, kind) -> Stream:
        p = _parallelism(self.env.parallelism, parallelism)
        node = self.env._add(name=name, parallelism=p, make_operator=make_operator,
                             inputs=[self.first._input_to(p), self.second._input_to(p)], kind=kind)
        return Stream(self.env, node)

    def process(self, fn1: Callable, fn2: Callable, *, on_timer: Callable | None = None,
                on_end: Callable | None = None, side_outputs=None, parallelism: int | None = None,
                name: str = "co_process", kind: Any = None) -> Stream:
        """Keyed: ``fn_i(key, record, state) -> iterable of outputs (or None)``,
        ``state`` the per-key dict both inputs share. Unkeyed:
        ``fn_i(record, state)`` with one ``state`` dict per subtask.

        Keyed, a ``fn_i`` taking a fourth argument gets the context of
        ``KeyedStream.process`` (timestamps, watermark, timers, and
        ``ctx.output`` to the side outputs declared in ``side_outputs``), and
        ``on_timer(key, t, state, ctx)`` / ``on_end(key, state, ctx)`` work as
        there; the watermark is the minimum of the two inputs'.

        Returns a ``Stream``. One input keyed and the other not, timers on
        unkeyed inputs, or functions that cannot take their arguments are a
        ``ConfigurationError``; a function that is not callable a ``TypeError``.

        Example::

            def on_order(key, order, state):
                state["order"] = order

            def on_payment(key, payment, state):
                order = state.pop("order", None)
                return None if order is None else [(key, order["amount"], payment["amount"])]

            paid = (orders.key_by(lambda o: o["id"])
                          .connect(payments.key_by(lambda p: p["order"]))
                          .process(on_order, on_payment))
        """
        _callable(fn1, "process (fn1, for the first input)")
        _callable(fn2, "process (fn2, for the second input)")
        kind = _check_kind(kind, f"process {name!r}")
        first_keyed = isinstance(self.first, KeyedStream)
        if first_keyed != isinstance(self.second, KeyedStream):
            keyed, plain = ("first", "second") if first_keyed else ("second", "first")
            raise ConfigurationError(
                f"process {name!r}: the {keyed} connected stream is keyed and the {plain} is not, so "
                "records with equal keys would not meet in one subtask and the per-key state could not "
                "be shared: key_by both streams, or neither for one state dict per subtask")

        for i, f in ((1, fn1), (2, fn2)):
            if first_keyed:
                _check_arity(f, f"process {name!r} (fn{i})",
                             f"fn{i}(key, record, state) or fn{i}(key, record, state, ctx)", 3, 4)
            else:
                _check_arity(f, f"process {name!r} (fn{i})", f"fn{i}(record, state)", 2)
        if on_timer is not None:
            _check_arity(on_timer, f"process {name!r} on_timer", "on_timer(key, t, state, ctx)", 4)
        if on_end is not None:
            _check_arity(on_end, f"process {name!r} on_end", "on_end(key, state, ctx)", 3)
        ctx = (takes_context(fn1, 3 if first_keyed else 2), takes_context(fn2, 3 if first_keyed else 2))
        tags = declare_side_outputs(side_outputs, f"process {name!r}")
        if tags and not (first_keyed and (any(ctx) or on_timer is not None or on_end is not None)):
            raise ConfigurationError(
                f"process {name!r} declares side outputs, which a function reaches through its ctx: key_by "
                "both connected streams and take a ctx, fn_i(key, record, state, ctx)")
        if first_keyed and (any(ctx) or on_timer is not None or on_end is not None):
            k1, k2 = self.first._key_fn, self.second._key_fn
            ts = tuple(None if isinstance(t, str) else t
                       for t in (_timestamp_fn(s.node) for s in (self.first, self.second)))
            make = lambda: KeyedCoProcessOperator(name, (k1, k2), ts, (fn1, fn2), on_timer,  # noqa: E731
                                                  on_end, ctx)
            stream = self._node(name, make, parallelism, kind)
            stream.node.event_time = True
            stream.node.side_tags = tags
            stream.node.open_tags = not tags
            return stream
        if on_timer is not None or on_end is not None:
            raise ConfigurationError(f"process {name!r}: timers are per key: key_by both connected streams")
        if first_keyed:
            k1, k2 = self.first._key_fn, self.second._key_fn
            make = lambda: KeyedCoProcess(name, k1, k2, fn1, fn2)  # noqa: E731
        else:
            make = lambda: CoProcess(name, fn1, fn2)  # noqa: E731
        return self._node(name, make, parallelism, kind)

    def map(self, fn1: Callable, fn2: Callable, *, parallelism: int | None = None,
            name: str = "co_map", kind: Any = None) -> Stream:
        """One output per record: ``fn1(record)`` for the first input,
        ``fn2(record)`` for the second.

        Returns a ``Stream``; a function that is not callable is a ``TypeError``.

        Example::

            tagged = clicks.connect(views).map(lambda c: ("click", c), lambda v: ("view", v))
        """
        _callable(fn1, "map (fn1, for the first input)")
        _callable(fn2, "map (fn2, for the second input)")
        kind = _check_kind(kind, f"map {name!r}")
        return self._node(name, lambda: ops.CoMap(name, fn1, fn2), parallelism, kind)



def _key_by_column(stream, column):
    """``key_by("column")`` of an Arrow/pandas batch stream: for the
    vectorized windows (``window(...).aggregate({...})``), which group rows
    by that column themselves."""
    kind = stream.node.kind
    name = None
    if kind is not None and not isinstance(kind, np.dtype):
        name = get_serializer(kind).name
    if name not in ("arrow", "pandas"):
        raise TypeError(f"key_by takes a function record -> key; a column name ({column!r}) keys only a stream "
                        "declared as Arrow or pandas batches (kind='arrow' / 'pandas')")

    def no_record_key(batch):
        raise ConfigurationError(
            f"key_by({column!r}) names a column of Arrow/pandas batches; it keys the vectorized windows "
            "(window(...).aggregate({...})) only: key other operators with a function")
    ks = KeyedStream(stream.env, stream.node, no_record_key)
    ks._partitioner = "hash"
    ks._key_column = column
    return ks


def _side_stream(stream, tag, name, kind) -> Stream:
    """The stream of ``tag``'s records of ``stream``'s node: a node reading
    that side output (one per tag, made on first request)."""
    up = stream.node
    node = up.side_readers.get(tag.name)
    if node is None:
        kind = _check_kind(kind, f"side_output {name!r}")
        node = up.side_readers[tag.name] = stream.env._add(
            name=name, parallelism=up.parallelism, make_operator=lambda: ops.Forward(name),
            inputs=[Input(up, "forward", None, tag=tag.name)], kind=kind)
    # the same Stream each time (the node holds no API object: the runtime receives it)
    made = stream.env._side_streams
    side = made.get(node.id)
    if side is None:
        side = made[node.id] = Stream(stream.env, node)
    return side


def _same_env(env, stream, what):
    if not isinstance(stream, Stream):
        raise TypeError(f"{what} takes Streams, got {type(stream).__name__}")
    if stream.env is not env:
        raise ConfigurationError(f"{what}: the streams belong to different Environments; "
                                 "a job reads streams of its own Environment only")


def _timestamp_fn(node):
    """The function a process operator reads record times with where none
    travel with the records (None: no times, or times that travel)."""
    ts = node.timestamps
    return None if ts is carried_timestamps else ts


class WindowResult(Stream):
    """The results of a window operator; ``late()`` is the stream of its
    late records (Flink's ``side_output_late_data`` / ``get_side_output``),
    a side output of the window operator.

    Example::

        res = keyed.window(fb.Tumbling(60)).aggregate(fb.Count())
        counts = res.collect()
        late = res.late().collect()
    """

    def __init__(self, env, node):
        super().__init__(env, node)
        self._late = None
        self._late_tag = None

    def _window_setting(self, what):
        raise ConfigurationError(
            f"{what} belongs to the windowed stream, before its function: "
            f"....window(...).{what}.aggregate(...), not ....aggregate(...).{what}")

    def trigger(self, trigger):
        """Too late here: a ``ConfigurationError`` saying that ``trigger()``
        comes between ``window(...)`` and ``reduce``/``aggregate``/``process``.

        Example::

            res = keyed.window(fb.Tumbling(10)).trigger(fb.CountTrigger(3)).aggregate(fb.Count())
        """
        self._window_setting("trigger(...)")

    def allowed_lateness(self, seconds):
        """Too late here: a ``ConfigurationError`` saying that
        ``allowed_lateness()`` comes between ``window(...)`` and its function.

        Example::

            res = keyed.window(fb.Tumbling(60)).allowed_lateness(30).aggregate(fb.Count())
        """
        self._window_setting("allowed_lateness(...)")

    def side_output_late_data(self, tag):
        """Too late here: a ``ConfigurationError`` saying that
        ``side_output_late_data()`` comes between ``window(...)`` and its
        function (or use ``late()`` on this result).

        Example::

            res = keyed.window(fb.Tumbling(60)).side_output_late_data(tag).aggregate(fb.Count())
        """
        self._window_setting("side_output_late_data(...)")

    def late(self, *, name: str = "late") -> Stream:
        """The records that came too late for every window they belong to
        (past the watermark plus the allowed lateness), instead of being
        dropped. It may be called before or after the results are used
        (``res.collect(); late = res.late()``): the late records are a
        side output of the window operator, beside its results.

        Returns a ``Stream`` of the late records as they came (with their
        timestamps); calling it again returns the same stream.

        Example::

            res = keyed.window(fb.Tumbling(60)).aggregate(fb.Count())
            res.late().write_text("late-records")
        """
        if self._late is None:
            late = _side_stream(self, LATE_TAG, name, self._input_kind)
            late.node.timestamps = self._ts
            self._late = late
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
    raise ConfigurationError(
        "late() is a method of the window's result stream, not of the handle collect() returns: "
        "res = ....aggregate(...); counts = res.collect(); late = res.late().collect()")


class _Renamed:
    """A node's operator factory after ``Stream.name()``: the operator
    carries the new name into task names, metrics and errors."""

    def __init__(self, make, name):
        self.make = make
        self.name = name

    def __call__(self):
        op = self.make()
        op.name = self.name
        return op


class _FieldAggregate:
    """The reduce function of ``KeyedStream.sum/min/max/min_by/max_by``
    (PyFlink's rolling aggregations of one field). Records are never changed
    in place: the previous value may already have gone downstream."""

    def __init__(self, how, field):
        self.how = how
        self.field = field

    def _get(self, record):
        f = self.field
        try:
            if isinstance(record, dict):
                return record[f]
            if isinstance(record, (tuple, list)):
                if isinstance(f, str):
                    names = getattr(type(record), "_fields", None)
                    if names is None:
                        raise KeyError(f)
                    return record[names.index(f)]
                return record[f]
        except (KeyError, IndexError, ValueError):
            pass
        else:
            if f == 0 and not isinstance(record, (dict, tuple, list)):
                return record       # a basic value is its own field 0
        raise RecordTypeError(
            f"{self.how}({f!r}): the record {short_repr(record)} ({type(record).__name__}) has no field {f!r}; "
            "give a position of a tuple or list, a key of a dict, a name of a named tuple, or 0 for "
            "records that are numbers")

    def _with(self, record, value):
        f = self.field
        if isinstance(record, dict):
            return {**record, f: value}
        if isinstance(record, (tuple, list)):
            if isinstance(f, str):
                return record._replace(**{f: value})
            items = list(record)
            items[f] = value
            if isinstance(record, list):
                return items
            names = getattr(type(record), "_fields", None)
            return type(record)(*items) if names is not None else tuple(items)
        return value

    def __call__(self, a, b):
        va, vb = self._get(a), self._get(b)
        how = self.how
        if how == "min_by":
            return b if vb < va else a
        if how == "max_by":
            return b if vb > va else a
        if how == "sum":
            return self._with(a, va + vb)
        if how == "min":
            return a if not vb < va else self._with(a, vb)
        return a if not vb > va else self._with(a, vb)
