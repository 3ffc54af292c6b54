"""The process operators: a user's function with state, and for keyed
streams a context that registers timers (``process``, ``key_by(...).process``,
``connect(...).process``, ``KeyedProcessFunction``).

Those without a context (``KeyedProcess``, ``CoProcess``,
``KeyedCoProcess``) keep a per-key (or per-subtask) dict; the keyed ones
with a context (``KeyedProcessOperator``, ``KeyedCoProcessOperator``) also
keep timers (``pyflowbuf.time.timers``), which is why the whole family
lives here, one layer above ``pyflowbuf/operators/``; the unkeyed
``ProcessOperator`` gives its function a context for side outputs and the
record's time. Also here: the checks
of a process function object's methods where it is declared (ours or
PyFlink's signatures) and the ``RuntimeContext`` PyFlink's
``open(runtime_context)`` gets.
"""
from __future__ import annotations

import inspect
import time
from array import array as _array
from typing import Callable

from pyflowbuf import errors
from pyflowbuf._core.serde import ts_repeat
from pyflowbuf._validation import _check_arity
from pyflowbuf.operators.basic import _TwoInput
from pyflowbuf.operators.contracts import Operator
from pyflowbuf.operators.keyed import _Keyed, _PerKeyState
from pyflowbuf.operators.side_outputs import unknown_tag
from pyflowbuf.time.timers import TimerOperator, _seconds, timer_service_snapshot
from pyflowbuf.time.watermarks import NO_WATERMARK, to_seconds


def _copy_key_dicts(state) -> dict:
    """Per-key dict state, copied one level deep: a snapshot the task can keep
    mutating while it is written, and a restore that owns its dicts."""
    return {k: dict(v) for k, v in (state or {}).items()}


class _KeyDictState(_PerKeyState):
    """A dict per key (the keyed process operators, one input or two): copied
    one level deep on snapshot and restore."""

    def snapshot_state(self):
        return _copy_key_dicts(self.state)

    def restore_state(self, state):
        self.state = _copy_key_dicts(state)


class KeyedProcess(_KeyDictState, _Keyed):
    """``fn(key, value, state) -> iterable`` with ``state`` a per-key dict that
    lives in the task (and goes into checkpoints)."""

    def process_batch(self, batch):
        return _process_per_key(self, batch, self.key_fn, self.fn)

    def process_ts(self, batch, ts):
        if ts is None:
            return self.process_batch(batch), None
        return _process_per_key(self, batch, self.key_fn, self.fn, ts)


def _process_per_key(op, batch, key_fn, fn, ts=None):
    """``fn(key, record, state)`` for each record, ``state`` the key's dict in
    ``op.state`` (created on first use); the records it returns, checked.
    With ``ts`` (the batch's times): ``(records, their times)``, each record
    the time of the input it came from."""
    state, add = op.state, op._extend
    mark = None if op.touched is None else op.touched.add     # incremental checkpoints
    out: list = []
    if ts is None:
        for x in batch:
            k = key_fn(x)
            if mark is not None:
                mark(k)
            st = state.get(k)
            if st is None:
                st = state[k] = {}
            add(out, fn(k, x, st))
        return op._checked(out)
    counts: list = []
    for x in batch:
        k = key_fn(x)
        if mark is not None:
            mark(k)
        st = state.get(k)
        if st is None:
            st = state[k] = {}
        n = len(out)
        add(out, fn(k, x, st))
        counts.append(len(out) - n)
    return op._checked(out), ts_repeat(ts, counts)


class CoProcess(_TwoInput):
    """``fn_i(record, state) -> iterable`` with one ``state`` dict per
    subtask, shared by both inputs (and going into checkpoints)."""

    def __init__(self, name, fn1, fn2):
        super().__init__(name, fn1, fn2)
        self.state: dict = {}

    def process_input(self, batch, input_index):
        fn, state = self.fns[input_index], self.state
        out: list = []
        for x in batch:
            self._extend(out, fn(x, state))
        return self._checked(out)

    def process_input_ts(self, batch, ts, input_index):
        if ts is None:
            return self.process_input(batch, input_index), None
        fn, state = self.fns[input_index], self.state
        out: list = []
        counts: list = []
        for x in batch:
            n = len(out)
            self._extend(out, fn(x, state))
            counts.append(len(out) - n)
        return self._checked(out), ts_repeat(ts, counts)

    def snapshot_state(self):
        return dict(self.state)

    def restore_state(self, state):
        self.state = dict(state or {})


class KeyedCoProcess(_KeyDictState, _TwoInput):
    """``fn_i(key, record, state) -> iterable`` where ``key = key_fn_i(record)``
    and ``state`` is the per-key dict both inputs share: both inputs are hash
    partitioned with the same stable hash, so equal keys meet in one subtask."""

    def __init__(self, name, key_fn1, key_fn2, fn1, fn2):
        super().__init__(name, fn1, fn2)
        self.key_fns = (key_fn1, key_fn2)
        self.state: dict = {}

    def process_input(self, batch, input_index):
        return _process_per_key(self, batch, self.key_fns[input_index], self.fns[input_index])

    def process_input_ts(self, batch, ts, input_index):
        if ts is None:
            return self.process_input(batch, input_index), None
        return _process_per_key(self, batch, self.key_fns[input_index], self.fns[input_index], ts)


def _stamp(t, operator) -> float:
    """``ctx.timestamp`` as the time of the records a call returned."""
    if type(t) is float:
        return t
    if t is None:
        raise errors.ConfigurationError(
            f"operator {operator!r}: records it emits on a stream with timestamps need a time, and "
            "ctx.timestamp is None: set ctx.timestamp (seconds) before returning them")
    t = to_seconds(t)
    if t != t:
        raise errors.InvalidTimestampError(f"operator {operator!r}: ctx.timestamp is NaN")
    return t


class Context:
    """What ``process`` functions and timers see, besides key, record and state.

    timestamp
        The record's event time (None when the stream has no timestamps), or
        in ``on_timer`` the timer's time. On a stream with timestamps, the
        records a call returns carry ``ctx.timestamp`` as it stands when the
        call is done: set it (seconds) to give them another time. In
        ``on_end`` it starts as the highest time the operator saw.
    watermark
        The operator's current watermark (-inf before the first).
    key
        The current key.
    time_domain
        In ``on_timer``: "event_time" or "processing_time".
    """

    __slots__ = ("_op", "key", "timestamp", "time_domain")

    def __init__(self, op):
        self._op = op
        self.key = None
        self.timestamp = None
        self.time_domain = None

    @property
    def watermark(self) -> float:
        return self._op.timers.watermark

    def current_processing_time(self) -> float:
        return time.time()

    def current_watermark(self) -> float:
        """PyFlink's ``timer_service().current_watermark()``: ``ctx.watermark``."""
        return self._op.timers.watermark

    def get_current_key(self):
        """PyFlink's spelling of ``ctx.key``."""
        return self.key

    def timer_service(self) -> "Context":
        """PyFlink's ``ctx.timer_service()``: the timers are the context's own
        methods here (``register_event_time_timer``, ``current_watermark``,
        ``current_processing_time``...), so this returns the context."""
        return self

    def register_event_time_timer(self, t) -> None:
        """Call ``on_timer(key, t, state, ctx)`` once the watermark reaches ``t``."""
        self._op._register_event(self.key, _seconds(t, "register_event_time_timer"))

    def register_processing_time_timer(self, t) -> None:
        """Call ``on_timer(key, t, state, ctx)`` once ``time.time()`` reaches ``t``."""
        self._op._register_processing(self.key, _seconds(t, "register_processing_time_timer"))

    def delete_event_time_timer(self, t) -> None:
        self._op.timers.event.delete(self.key, to_seconds(t))

    def delete_processing_time_timer(self, t) -> None:
        self._op.timers.processing.delete(self.key, to_seconds(t))

    def output(self, tag, value) -> None:
        """Emit ``value`` to the side output ``tag`` (an ``OutputTag`` the
        operator declared with ``side_outputs=``), in ``process``,
        ``on_timer`` and ``on_end`` alike."""
        side = self._op.side
        if side is None:
            raise unknown_tag(self._op.name, tag, ())
        side.output(tag, value, self.timestamp)


class ProcessContext:
    """What an unkeyed ``Stream.process`` function sees: ``fn(record, ctx)``.

    timestamp
        The record's event time (None when the stream has no timestamps).
    watermark
        The operator's current watermark (-inf before the first).
    """

    __slots__ = ("_op", "timestamp", "watermark")

    def __init__(self, op):
        self._op = op
        self.timestamp = None
        self.watermark = NO_WATERMARK

    def current_processing_time(self) -> float:
        return time.time()

    def current_watermark(self) -> float:
        """PyFlink's ``timer_service().current_watermark()``: ``ctx.watermark``."""
        return self.watermark

    def timer_service(self) -> "ProcessContext":
        """PyFlink's ``ctx.timer_service()``: the context itself, whose
        ``current_watermark()`` and ``current_processing_time()`` it has;
        timers are per key (``key_by(...).process``)."""
        return self

    def _no_timers(self, *args, **kwargs):
        raise errors.ConfigurationError(
            f"operator {self._op.name!r}: timers are per key, and this process function runs on a stream "
            "without one: key_by(...).process(...) registers timers (as Flink allows timers only on keyed "
            "streams)")

    register_event_time_timer = register_processing_time_timer = _no_timers
    delete_event_time_timer = delete_processing_time_timer = _no_timers

    def get_current_key(self):
        raise errors.ConfigurationError(
            f"operator {self._op.name!r}: get_current_key() is for keyed streams; this process function "
            "runs on a stream without a key (key_by(...).process(...) has one)")

    def output(self, tag, value) -> None:
        """Emit ``value`` to the side output ``tag`` (an ``OutputTag`` the
        operator declared with ``side_outputs=``)."""
        side = self._op.side
        if side is None:
            raise unknown_tag(self._op.name, tag, ())
        side.output(tag, value, self.timestamp)


class ProcessOperator(Operator):
    """``Stream.process(fn)``: ``fn(record, ctx) -> iterable of outputs (or
    None)`` per record, on a stream that need not be keyed (Flink's
    ProcessFunction); ``ctx.output(tag, value)`` emits to side outputs."""

    def __init__(self, name, fn, ts_fn=None, opener=None, closer=None):
        super().__init__(name)
        self.fn = fn
        self.ts_fn = ts_fn
        self.ctx = ProcessContext(self)
        self.user_open, self.user_close = opener, closer

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        if self.user_open is not None:
            self.user_open(subtask, parallelism)

    def on_watermark(self, watermark):
        # for ctx.watermark; the watermark goes on as it came
        if watermark > self.ctx.watermark:
            self.ctx.watermark = watermark
        return [], watermark

    def finish(self):
        if self.user_close is not None:
            self.user_close()
        return []

    def process_batch(self, batch):
        fn, ctx, ts_fn, add = self.fn, self.ctx, self.ts_fn, self._extend
        out: list = []
        if ts_fn is None:
            for x in batch:
                add(out, fn(x, ctx))
        else:
            for x in batch:
                t = ts_fn(x)
                ctx.timestamp = t if type(t) is float else to_seconds(t)
                add(out, fn(x, ctx))
        return self._checked(out)

    def process_ts(self, batch, ts):
        """On a stream with timestamps: ``ctx.timestamp`` is each record's time,
        and what a call returns carries ``ctx.timestamp`` as the call left it."""
        if ts is None:
            return self.process_batch(batch), None
        fn, ctx, add = self.fn, self.ctx, self._extend
        out: list = []
        out_ts: list = []
        for x, t in zip(batch, ts):
            ctx.timestamp = t
            n = len(out)
            add(out, fn(x, ctx))
            if len(out) > n:
                out_ts.extend([_stamp(ctx.timestamp, self.name)] * (len(out) - n))
        return self._checked(out), _array("d", out_ts)


class RuntimeContext:
    """What ``open(self, runtime_context)`` of a ``KeyedProcessFunction``
    gets (PyFlink's RuntimeContext): the subtask it runs in. Keyed state is
    not reached through it here: each call gets its key's ``state`` dict.

    Example::

        class Count(fb.KeyedProcessFunction):
            def open(self, runtime_context):
                self.me = runtime_context.get_index_of_this_subtask()
    """

    __slots__ = ("task_name", "subtask", "parallelism")

    def __init__(self, task_name: str, subtask: int, parallelism: int):
        self.task_name = task_name
        self.subtask = subtask
        self.parallelism = parallelism

    def get_task_name(self) -> str:
        """The operator's name (``name=`` or ``.name()``)."""
        return self.task_name

    def get_index_of_this_subtask(self) -> int:
        """This subtask's index, 0 to parallelism - 1."""
        return self.subtask

    def get_number_of_parallel_subtasks(self) -> int:
        """The operator's parallelism."""
        return self.parallelism

    def get_task_name_with_subtasks(self) -> str:
        """``"name (i/p)"``, i counted from 1, as task names show."""
        return f"{self.task_name} ({self.subtask + 1}/{self.parallelism})"

    def get_state(self, *args, **kwargs):
        """PyFlink's state descriptors are not how state is reached here: a
        ``ConfigurationError`` that names the ``state`` dict."""
        raise errors.ConfigurationError(
            "runtime_context.get_state(...) (PyFlink's keyed state) is not how state is reached here: "
            "process_element(self, key, record, state, ctx) gets its key's state, a dict that goes into "
            "checkpoints (state['count'] = ...)")

    get_list_state = get_map_state = get_reducing_state = get_aggregating_state = get_state


def _binds(fn, n) -> bool:
    try:
        inspect.signature(fn).bind(*range(n))
        return True
    except TypeError:
        return False
    except ValueError:          # no signature: left to the call
        return True


def process_function_parts(pf, what: str, task_name: str = ""):
    """A process function object's methods as the keyed operator calls
    them: ``(fn(key, record, state, ctx), on_timer(key, t, state, ctx) or
    None, on_end or None, open(subtask, parallelism), close())``. Each
    method's signature is checked here, where the operator is declared
    (ours, or PyFlink's: ``process_element(value, ctx)``,
    ``on_timer(timestamp, ctx)``, ``open(runtime_context)``); one that fits
    neither is a ConfigurationError naming it."""
    cls = type(pf).__name__
    pe = getattr(pf, "process_element", None)
    if not callable(pe):
        raise TypeError(f"{what}: {cls} has no process_element method")
    _check_arity(pe, f"{what}: {cls}.process_element",
                 "process_element(self, key, record, state, ctx) or PyFlink's process_element(self, value, ctx)",
                 4, 2)
    fn = pe if _binds(pe, 4) else (lambda k, x, st, ctx, _f=pe: _f(x, ctx))
    on_timer = getattr(pf, "on_timer", None)
    if on_timer is not None and getattr(type(pf), "on_timer", None) is KeyedProcessFunction.on_timer:
        on_timer_fn = on_timer         # the base's: nothing to fire, refused if a timer is registered
    elif callable(on_timer):
        _check_arity(on_timer, f"{what}: {cls}.on_timer",
                     "on_timer(self, key, timestamp, state, ctx) or PyFlink's on_timer(self, timestamp, ctx)", 4, 2)
        on_timer_fn = on_timer if _binds(on_timer, 4) else (lambda k, t, st, ctx, _f=on_timer: _f(t, ctx))
    else:
        on_timer_fn = None
    on_end = getattr(pf, "on_end", None)
    if callable(on_end):
        _check_arity(on_end, f"{what}: {cls}.on_end", "on_end(self, key, state, ctx)", 3)
    else:
        on_end = None
    opener, close = _open_and_close(pf, what, cls, task_name,
                                    "open(self, subtask, parallelism) or PyFlink's open(self, runtime_context)", (2, 1))
    return fn, on_timer_fn, on_end, opener, close


def plain_process_function_parts(pf, what: str, task_name: str = ""):
    """A PyFlink-style ProcessFunction object of ``Stream.process``, as the
    operator calls it: ``(fn(record, ctx), open(subtask, parallelism) or
    None, close() or None)``, its methods' signatures checked here."""
    cls = type(pf).__name__
    pe = pf.process_element
    _check_arity(pe, f"{what}: {cls}.process_element", "process_element(self, value, ctx)", 2)
    opener, closer = _open_and_close(pf, what, cls, task_name,
                                     "open(self, runtime_context) or open(self, subtask, parallelism)", (1, 2))
    return pe, opener, closer


def _open_and_close(pf, what: str, cls: str, task_name: str, open_form: str, open_arities: tuple):
    """A process function object's optional ``open`` (ours, with subtask and
    parallelism, or PyFlink's, with a RuntimeContext: called as ours either
    way) and ``close()``, their signatures checked; None where absent."""
    opener = None
    open_ = getattr(pf, "open", None)
    if callable(open_):
        _check_arity(open_, f"{what}: {cls}.open", open_form, *open_arities)
        if _binds(open_, 2):
            opener = open_
        else:
            opener = lambda subtask, parallelism, _f=open_, _n=task_name: _f(  # noqa: E731
                RuntimeContext(_n, subtask, parallelism))
    close = getattr(pf, "close", None)
    if callable(close):
        _check_arity(close, f"{what}: {cls}.close", "close(self)", 0)
    else:
        close = None
    return opener, close


class KeyedProcessFunction:
    """A keyed process function as a class (Flink's KeyedProcessFunction):
    override ``process_element``, and ``on_timer`` / ``on_end`` when used.
    Each returns an iterable of output records, or None. ``open`` runs in
    each subtask before the first record, ``close`` after the end of input.

    PyFlink's signatures work too, checked where ``process`` is declared:
    ``process_element(self, value, ctx)`` (the key is
    ``ctx.get_current_key()``), ``on_timer(self, timestamp, ctx)`` and
    ``open(self, runtime_context)`` (a ``RuntimeContext``).
    """

    def open(self, subtask: int, parallelism: int) -> None:
        pass

    def close(self) -> None:
        pass

    def process_element(self, key, record, state: dict, ctx: Context):
        raise NotImplementedError

    def on_timer(self, key, timestamp: float, state: dict, ctx: Context):
        return None

    def on_end(self, key, state: dict, ctx: Context):
        return None


def takes_context(fn: Callable, base: int) -> bool:
    """Whether ``fn`` takes one more positional argument than ``base`` (the
    context), or any number of them."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):     # a builtin without a signature
        return False
    n = 0
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            return True
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            n += 1
    return n > base


class KeyedProcessOperator(TimerOperator):
    """``key_by(...).process(fn, on_timer=..., on_end=...)`` with a context:
    ``fn(key, record, state, ctx)``, ``on_timer(key, t, state, ctx)``, and
    at end of input (after the +inf watermark fired every event-time timer)
    ``on_end(key, state, ctx)`` for every key with state. ``state`` is the
    per-key dict, shared by all three and going into checkpoints with the
    timers."""

    def __init__(self, name, key_fn, ts_fn, fn, on_timer=None, on_end=None, with_ctx=True):
        super().__init__(name)
        self.key_fn = key_fn
        self.ts_fn = ts_fn
        self.user_open = self.user_close = None
        if not callable(fn) or isinstance(fn, KeyedProcessFunction):
            fn, on_timer, on_end, self.user_open, self.user_close = process_function_parts(
                fn, f"process {name!r}", name)
            with_ctx = True
        self.fn = fn if with_ctx else (lambda k, x, st, ctx, _f=fn: _f(k, x, st))
        self.on_timer_fn = on_timer
        self.on_end_fn = on_end
        self.state: dict = {}
        self.ctx = Context(self)
        self._high = NO_WATERMARK      # the highest record time seen: on_end's default time

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        if self.user_open is not None:
            self.user_open(subtask, parallelism)

    def _key_state(self, k):
        st = self.state.get(k)
        if st is None:
            st = self.state[k] = {}
        return st

    def process_batch(self, batch):
        key_fn, ts_fn, fn, add = self.key_fn, self.ts_fn, self.fn, self._extend
        state, ctx = self.state, self.ctx
        ctx.time_domain = None
        out: list = []
        for x in batch:
            k = key_fn(x)
            st = state.get(k)
            if st is None:
                st = state[k] = {}
            ctx.key = k
            if ts_fn is not None:
                t = ts_fn(x)
                ctx.timestamp = t if type(t) is float else to_seconds(t)
            add(out, fn(k, x, st, ctx))
        return self._checked(out)

    def process_ts(self, batch, ts):
        if ts is None:
            return self.process_batch(batch), None
        key_fn, fn, add = self.key_fn, self.fn, self._extend
        state, ctx = self.state, self.ctx
        ctx.time_domain = None
        out: list = []
        out_ts: list = []
        for x, t in zip(batch, ts):
            k = key_fn(x)
            st = state.get(k)
            if st is None:
                st = state[k] = {}
            ctx.key = k
            ctx.timestamp = t
            n = len(out)
            add(out, fn(k, x, st, ctx))
            if len(out) > n:
                out_ts.extend([_stamp(ctx.timestamp, self.name)] * (len(out) - n))
        if ts:
            high = max(ts)
            if high > self._high:
                self._high = high
        return self._checked(out), _array("d", out_ts)

    def _fire(self, queue, limit, domain):
        if self.on_timer_fn is None:
            if len(queue):
                raise errors.ConfigurationError(
                    f"operator {self.name!r} registered a timer but has no on_timer: pass "
                    "process(fn, on_timer=...) or a KeyedProcessFunction with on_timer")
            return []
        out: list = []
        out_ts: list = []
        ctx, on_timer = self.ctx, self.on_timer_fn
        ctx.time_domain = domain
        while True:
            due = queue.pop_due(limit)
            if due is None:
                break
            k, t = due
            ctx.key, ctx.timestamp = k, t
            n = len(out)
            self._extend(out, on_timer(k, t, self._key_state(k), ctx))
            if self.timestamped and len(out) > n:
                out_ts.extend([_stamp(ctx.timestamp, self.name)] * (len(out) - n))
        ctx.time_domain = None
        if self.timestamped:
            self.fired_ts = out_ts
        return self._checked(out)

    def fire_event(self, watermark):
        return self._fire(self.timers.event, watermark, "event_time")

    def fire_processing(self, now):
        return self._fire(self.timers.processing, now, "processing_time")

    def finish(self):
        super().finish()
        try:
            return self._end()
        finally:
            if self.user_close is not None:
                self.user_close()

    def _end(self):
        if self.on_end_fn is None:
            return []
        out: list = []
        out_ts: list = []
        ctx = self.ctx
        ctx.time_domain = None
        high = self._high if self._high > NO_WATERMARK else None
        for k in list(self.state):
            ctx.key = k
            ctx.timestamp = high
            n = len(out)
            self._extend(out, self.on_end_fn(k, self.state[k], ctx))
            if self.timestamped and len(out) > n:
                out_ts.extend([_stamp(ctx.timestamp, self.name)] * (len(out) - n))
        if self.timestamped:
            self.fired_ts = out_ts
        return self._checked(out)

    def snapshot_state(self):
        return {"state": _copy_key_dicts(self.state), "timers": self.timers.snapshot(), "high": self._high}

    def restore_state(self, state):
        if state:
            self.state = _copy_key_dicts(state["state"])
            self.timers.restore(state["timers"])
            self._high = state.get("high", NO_WATERMARK)

    keyed_state = True

    def keyed_parts(self, state):
        timers = state["timers"]
        return ({"state": (state["state"], None)},
                {"event": (timers["event"], None), "processing": (timers["processing"], None)},
                {"watermark": timers["watermark"], "high": state.get("high", NO_WATERMARK)})

    def from_keyed_parts(self, maps, timers, commons):
        # on_end's default time: the highest record time any of the merged subtasks saw
        highs = [c.get("high", NO_WATERMARK) for c in commons if c]
        return {"state": maps.get("state", {}), "timers": timer_service_snapshot(timers, commons),
                "high": max(highs) if highs else NO_WATERMARK}


class KeyedCoProcessOperator(KeyedProcessOperator):
    """``connect(...).process(fn1, fn2, on_timer=..., on_end=...)`` on two keyed
    streams, with a context: ``fn_i(key, record, state, ctx)``; the timers
    and the per-key state are shared by both inputs, and the watermark is
    the minimum of the two inputs'."""

    def __init__(self, name, key_fns, ts_fns, fns, on_timer=None, on_end=None, with_ctx=(True, True)):
        super().__init__(name, key_fns[0], ts_fns[0], fns[0], on_timer, on_end, with_ctx[0])
        second = fns[1] if with_ctx[1] else (lambda k, x, st, ctx, _f=fns[1]: _f(k, x, st))
        self.inputs = ((key_fns[0], ts_fns[0], self.fn), (key_fns[1], ts_fns[1], second))

    def process_batch(self, batch):
        raise TypeError(f"operator {self.name!r} has two inputs: it takes batches with their input index")

    def process_input(self, batch, input_index):
        self.key_fn, self.ts_fn, self.fn = self.inputs[input_index]
        return KeyedProcessOperator.process_batch(self, batch)

    def process_input_ts(self, batch, ts, input_index):
        self.key_fn, self.ts_fn, self.fn = self.inputs[input_index]
        if ts is None:
            return KeyedProcessOperator.process_batch(self, batch), None
        return KeyedProcessOperator.process_ts(self, batch, ts)
