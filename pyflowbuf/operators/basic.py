"""Operators work on batches: a list of records in, a list of records out.

Batching is what keeps the Python layer thin: a chain of operators runs a list
comprehension per operator per batch, and the batch crosses into the C core in
one call on each side of an exchange.

Every operator that makes records checks its output batch against its output
stream's kind (declared, or inferred from its first record), whether the next
step is a chained operator or a RecordWriter: a record that does not fit fails
the same way with chaining on or off, naming the operator and the value.

On a stream that carries timestamps the task calls ``process_ts(batch, ts)``
instead, ``ts`` the batch's times (an array('d'), one per record): it returns
the output and its times. One output per input keeps the times as they are
(no work per record); a filter, a flat_map or a process function derive
them in one C loop (``ts_select``, ``ts_repeat``): each output record gets the
time of the input it came from.
"""
from __future__ import annotations

import types
from collections.abc import Mapping
from itertools import compress
from typing import Any, Callable

import numpy as np

from pyflowbuf import errors
from pyflowbuf._core.serde import ts_repeat, ts_select
from pyflowbuf.serializers import get_serializer, infer_kind, misfit_finder, record_type_error, short_repr

_ANY = object()       # a kind every record fits (pickle): nothing to check
# Iterable, but never taken as the records a flat_map/process call emits:
# text and bytes would be split into characters, a tuple is as likely one
# record as several, and a dict (any Mapping) would give its keys.
_NOT_RECORDS = (str, bytes, bytearray, memoryview, tuple, dict)
_GENERATOR = types.GeneratorType


class Output:
    """What an operator is given instead of its task (``op.chain_output``, set
    before ``open``): where it sends what it makes outside of a batch, and
    how it gets called back in its task's thread. The task's chain gives each
    of its operators one (``runtime.task.chain.ChainOutput``); so does
    ``pyflowbuf.testing.OperatorHarness``. Records returned from
    ``process_batch``, ``on_watermark`` and ``finish`` never go through it.

    Example (an operator that fires on a processing-time tick)::

        def open(self, subtask, parallelism):
            super().open(subtask, parallelism)
            self.chain_output.schedule(time.time() + 1.0, self.tick)

        def tick(self):                     # in the task's thread
            self.chain_output.emit(self.flush_buffered())
    """

    def post(self, mail) -> None:
        """Run ``mail()`` in the task's thread, between batches."""
        raise NotImplementedError

    def schedule(self, deadline: float, mail):
        """Post ``mail`` at wall-clock ``deadline`` (``time.time()`` seconds);
        a handle for ``ProcessingTimeService.cancel``, or None where there is
        no wall clock (the harness)."""
        raise NotImplementedError

    def emit(self, records: list) -> None:
        """Records made outside of a batch (a processing-time timer), with
        their times in ``fired_ts`` on a timestamped stream: through the
        operators after this one, then to the task's outputs."""
        raise NotImplementedError

    def emit_watermark(self, watermark: float, force: bool = False) -> None:
        """Watermark ``watermark`` made here (an assigner): through the
        operators after this one, then downstream if it rose (or ``force``)."""
        raise NotImplementedError

    def emit_idle(self) -> None:
        """This operator's input went idle (an assigner's idle timeout)."""
        raise NotImplementedError


class Operator:
    """One step of a chain. ``name`` shows in metrics and errors.

    out_kind
        The declared kind of the output stream (a kind name, Serializer or
        NumPy dtype); None: the kind of the first record emitted. The job
        sets it from the graph.
    check_output
        False where a RecordWriter takes the output straight away (the task
        sets it for the last operator of a chain with outputs): the writer
        checks every record as it serializes it, so checking here too would
        be paid twice.
    """

    kind = "operator"
    out_kind: Any = None
    check_output = True
    _find_misfit: Any = None
    # set by the job: whether the output stream carries timestamps; and the
    # times of what on_watermark / finish / a timer made (see runtime.task.chain)
    timestamped = False
    fired_ts: Any = None
    # the side outputs it declared (an operators.side_outputs.SideOutputs), set
    # by its task; None for the operators that declare none
    side: Any = None
    # its Output (set by its task before open); None while not running
    chain_output: Any = None
    # The optional parts of the contract, declared with the value that means
    # "not used" so that the runtime reads them instead of probing for them
    # (``timestamped`` above is one too). An operator whose output is its
    # input, unchanged, says so: the writers then check a source's records
    # once, not the task too.
    passes_records = False
    # ``on_watermark(watermark) -> (records, watermark or None)``: an
    # operator of event time defines it (what it fired, and the watermark to
    # pass on, None to hold it back); None: watermarks go past it untouched.
    on_watermark: Any = None
    # ``metrics() -> dict``: counters of its own (late records of windows),
    # summed over a chain; None: it has none.
    metrics: Any = None

    def __init__(self, name: str):
        self.name = name

    def open(self, subtask: int, parallelism: int) -> None:
        self.subtask = subtask
        self.parallelism = parallelism

    def process_batch(self, batch: list) -> list:
        raise NotImplementedError

    def process_input(self, batch: list, input_index: int) -> list:
        """A batch read from input ``input_index`` of a task with several
        inputs (union, connect); only the operator heading such a task gets
        these. One-input operators do not care where a batch came from."""
        return self.process_batch(batch)

    def process_ts(self, batch: list, ts) -> tuple:
        """``process_batch`` on a chain that carries timestamps: ``ts`` holds the
        batch's times (None where its input has none); returns ``(output,
        its times)``. This default gives the output none: an operator whose
        output stream is timestamped overrides it."""
        return self.process_batch(batch), None

    def process_input_ts(self, batch: list, ts, input_index: int) -> tuple:
        """``process_input`` with the batch's times (see ``process_ts``)."""
        if type(self).process_input is Operator.process_input:
            return self.process_ts(batch, ts)
        return self.process_input(batch, input_index), None

    def finish(self) -> list:
        """Records to emit at end of input."""
        return []

    def snapshot_state(self) -> Any:
        """Operator state for a checkpoint (None when stateless): a copy, since
        the task goes on processing while it is written out."""
        return None

    def restore_state(self, state: Any) -> None:
        """Called before ``open`` when the job restores from a checkpoint."""

    # ---- state that moves between parallelisms (pyflowbuf.checkpoint.keygroups) ----
    # A keyed operator (``keyed_state``) hands its snapshot over as maps and
    # timer lists whose entries belong to keys; checkpoints store each with
    # the key group of every entry, and a restore at any parallelism gives
    # the operator back the entries of its subtask's groups.
    keyed_state = False
    # A keyed operator that records the keys it changes in ``touched`` (a set
    # the task installs when checkpoints are incremental, None otherwise):
    # a checkpoint then writes only the key groups of those keys.
    tracks_changes = False
    touched = None

    def keyed_parts(self, state) -> tuple[dict, dict, Any]:
        """A keyed snapshot as (maps, timers, common): ``maps`` {name: (dict,
        key_of)}, ``timers`` {name: (TimerQueue snapshot, key_of)}, where
        ``key_of(k)`` is the record key of an entry's key (None: the key
        itself), and ``common`` what belongs to no key."""
        raise NotImplementedError

    def from_keyed_parts(self, maps: dict, timers: dict, commons: list) -> Any:
        """``keyed_parts`` undone: the entries of one subtask's key groups
        (``commons``: the keyless rest of every subtask they came from)."""
        raise NotImplementedError

    def rescale_state(self, states: list, index: int, parallelism: int) -> Any:
        """The state of subtask ``index`` of ``parallelism`` from the
        per-subtask (non-keyed) states of a checkpoint taken at another
        parallelism. Only stateless subtasks move by default: per-subtask
        state has no rule for being split or joined."""
        if all(s is None for s in states):
            return None
        raise errors.ConfigurationError(
            f"operator {self.name!r} keeps per-subtask state that cannot be redistributed from parallelism "
            f"{len(states)} to {parallelism}; restore it at parallelism {len(states)}")

    def prepare_commit(self, checkpoint_id: int) -> list:
        """Sinks: close the transaction that checkpoint ``checkpoint_id`` covers
        and return the idempotent actions that commit it (and any earlier ones
        not known to be committed). -1 is the end of input."""
        return []

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` is complete: its actions were carried out."""

    # ---- the one kind check ----
    def _checked(self, out: list) -> list:
        """``out``, once every record in it fits the output stream's kind."""
        find = self._find_misfit
        if find is None:
            if not out:
                return out
            find = self._init_check(out[0])
        if find is _ANY:
            return out
        i = find(out)
        if i >= 0:
            raise record_type_error(self._kind, out[i], operator=self.name, origin=self._kind_origin)
        return out

    def _init_check(self, first):
        if not self.check_output:
            self._find_misfit = _ANY
            return _ANY
        if self.out_kind is not None:
            kind = self.out_kind
            self._kind_origin = "declared"
        else:
            kind = infer_kind(first)
            self._kind_origin = f"inferred from its first record, {short_repr(first)}"
        self._kind = kind if isinstance(kind, np.dtype) else get_serializer(kind)
        self._find_misfit = misfit_finder(self._kind) or _ANY
        return self._find_misfit

    def _extend(self, out: list, res) -> None:
        """Add what a process function returned (records, or None) to ``out``.

        The rule, one type check per call: a list, a generator or another
        iterable (iterator, set, deque...) holds the records; None is none; a
        str, bytes, tuple or Mapping is refused, since it could be one record
        as well as several and guessing would change records' shape."""
        t = type(res)
        if t is list or t is _GENERATOR:
            out.extend(res)
            return
        if res is None:
            return
        if isinstance(res, _NOT_RECORDS) or isinstance(res, Mapping) or _is_dataframe(res):
            raise self._not_records(res)
        try:
            out.extend(res)
        except TypeError:
            if hasattr(res, "__iter__"):
                raise  # the iteration itself failed, inside the user's iterable
            raise self._not_records(res) from None

    def _not_records(self, value) -> errors.RecordTypeError:
        t = type(value).__name__
        if isinstance(value, (str, bytes, bytearray, memoryview)):
            why = f"; a {t} would be split into its items"
        elif isinstance(value, tuple):
            why = (f"; a {t} is ambiguous (one record that is a tuple, or several records?), so it is "
                   "never taken apart. One record: return [record] (e.g. [(k, v)]) or yield it; "
                   "several: return a list or yield each")
        elif isinstance(value, Mapping) or _is_dataframe(value):
            why = (f"; iterating a {t} gives its keys/column labels, not records. One record: "
                   "return [record] or yield it")
        else:
            why = ""
        return errors.RecordTypeError(
            f"operator {self.name!r}: its function returned {short_repr(value)} ({t}) where an "
            f"iterable of records belongs{why}. Return a list of records (e.g. [value]), yield them, or "
            "use map() for one record per input")


class Map(Operator):
    def __init__(self, name, fn: Callable):
        super().__init__(name)
        self.fn = fn

    def process_batch(self, batch):
        fn = self.fn
        return self._checked([fn(x) for x in batch])

    def process_ts(self, batch, ts):
        fn = self.fn
        return self._checked([fn(x) for x in batch]), ts


class Filter(Operator):
    def __init__(self, name, fn):
        super().__init__(name)
        self.fn = fn

    def process_batch(self, batch):
        fn = self.fn
        return [x for x in batch if fn(x)]

    def process_ts(self, batch, ts):
        if ts is None:
            return self.process_batch(batch), None
        fn = self.fn
        keep = [fn(x) for x in batch]
        return list(compress(batch, keep)), ts_select(ts, keep)


class FlatMap(Operator):
    def __init__(self, name, fn):
        super().__init__(name)
        self.fn = fn

    def process_batch(self, batch):
        fn, add = self.fn, self._extend
        out: list = []
        for x in batch:
            res = fn(x)
            if res is None:         # process() may return None; flat_map returns an iterable
                raise self._not_records(res)
            add(out, res)
        return self._checked(out)

    def process_ts(self, batch, ts):
        if ts is None:
            return self.process_batch(batch), None
        fn, add = self.fn, self._extend
        out: list = []
        counts: list = []
        for x in batch:
            res = fn(x)
            if res is None:
                raise self._not_records(res)
            n = len(out)
            add(out, res)
            counts.append(len(out) - n)
        return self._checked(out), ts_repeat(ts, counts)


class MapBatch(Operator):
    """Calls ``fn`` once per whole batch (a NumPy array chunk of a rows stream,
    or each Arrow/pandas record of a batch stream)."""

    def __init__(self, name, fn, per_record: bool):
        super().__init__(name)
        self.fn = fn
        self.per_record = per_record

    def process_batch(self, batch):
        # A rows stream's batch is a list of array chunks, an arrow/pandas
        # stream's a list of RecordBatches/DataFrames: fn sees each one.
        fn = self.fn
        return self._checked([fn(b) for b in batch])

    def process_ts(self, batch, ts):
        return self.process_batch(batch), ts      # one output per record (a chunk, a batch)


class _Keyed(Operator):
    """Keyed operators: ``fn`` applied with per-key state held in the task."""

    def __init__(self, name, key_fn, fn):
        super().__init__(name)
        self.key_fn = key_fn
        self.fn = fn
        self.state: dict = {}


class _PerKeyState:
    """Keyed state as one map ``self.state`` (key -> value), stored per key
    group and recorded per changed key (incremental checkpoints)."""

    keyed_state = True
    tracks_changes = True

    def keyed_parts(self, state):
        return {"state": (state or {}, None)}, {}, None

    def from_keyed_parts(self, maps, timers, commons):
        return maps.get("state", {})


class KeyedReduce(_PerKeyState, _Keyed):
    """Rolling reduce per key; emits the updated aggregate for every input."""

    def process_batch(self, batch):
        key_fn, fn, state = self.key_fn, self.fn, self.state
        out = []
        touched = self.touched
        if touched is None:
            for x in batch:
                k = key_fn(x)
                if k in state:
                    x = fn(state[k], x)
                state[k] = x
                out.append(x)
        else:           # incremental checkpoints: a second loop keeps the plain one free of the test
            mark = touched.add
            for x in batch:
                k = key_fn(x)
                mark(k)
                if k in state:
                    x = fn(state[k], x)
                state[k] = x
                out.append(x)
        return self._checked(out)

    def process_ts(self, batch, ts):
        return self.process_batch(batch), ts

    def snapshot_state(self):
        return dict(self.state)

    def restore_state(self, state):
        self.state = dict(state or {})



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


def _copy_key_dicts(state) -> dict:
    """Per-key dict state, copied one level deep: a snapshot the task can keep
    mutating while it is written, and a restore that owns its dicts."""
    return {k: dict(v) for k, v in (state or {}).items()}


# ---- operators with several inputs: the head of their task, fed by input index ----

class Forward(Operator):
    """The records as they came: the head of the chain that reads a side
    output (the writer that sent them checked them against its kind), with
    their times where the side output carries them."""

    def process_batch(self, batch):
        return batch

    def process_ts(self, batch, ts):
        return batch, ts


class Union(Operator):
    """The records of every input, in the order they arrive. Still an
    operator: records of an input whose kind was inferred are checked here
    against the union's kind, as any operator's output is."""

    def process_batch(self, batch):
        return self._checked(batch)

    def process_ts(self, batch, ts):
        return self._checked(batch), ts

    def process_input_ts(self, batch, ts, input_index):
        return self._checked(batch), ts


class _TwoInput(Operator):
    """``fns[i]`` handles the records of input ``i``."""

    def __init__(self, name, fn1: Callable, fn2: Callable):
        super().__init__(name)
        self.fns = (fn1, fn2)

    def process_batch(self, batch):
        raise TypeError(f"operator {self.name!r} has two inputs: it takes batches with their input index")


class CoMap(_TwoInput):
    def process_input(self, batch, input_index):
        fn = self.fns[input_index]
        return self._checked([fn(x) for x in batch])

    def process_input_ts(self, batch, ts, input_index):
        return self.process_input(batch, input_index), ts


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



def _is_dataframe(x) -> bool:
    # by name, not isinstance: pandas may be half-imported by another task's
    # thread (pyarrow imports it lazily), and a stream without it need not import it
    return any(c.__name__ == "DataFrame" and c.__module__.split(".")[0] == "pandas" for c in type(x).__mro__)
